"""Host synchronisations per LM step on CUDA: the rule of ``tests/lm/test_host_sync.py``.

There, a :class:`~torch.overrides.TorchFunctionMode` (:mod:`secondorder.testing.syncs`)
counts the calls that read a device value on the host, on CPU.  Here the same rule (one
read per step, plus two per attempt) is checked against the synchronisations CUDA itself reports:
``torch.cuda.set_sync_debug_mode("warn")`` makes every blocking copy between host and
device and every stream or device synchronisation issue a warning, which the test
records with its site.  The model and the inputs are on the GPU from the start, so
any copy the step makes is the library's own.  The CPU-side counter counts the same
steps on CUDA and must find the same number (in CPU mode only the counter runs).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.testing.syncs import SyncCounter

pytestmark = pytest.mark.cuda


def cuda_syncs(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` under sync debug mode "warn": its result and one line per synchronisation."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sites, others = [], []
    for w in caught:
        text = str(w.message)
        if text.startswith("called a synchronizing"):  # CUDA's report of one sync
            sites.append(f"{Path(w.filename).name}:{w.lineno}: {text.splitlines()[0]}")
        elif "prototype feature" not in text:  # torch's note on turning the mode on
            others.append(f"{w.category.__name__} at {w.filename}:{w.lineno}: {text}")
    assert not others, f"unexpected warnings under sync debug mode: {others}"
    return out, sites


def device_for(instrument: str, device: torch.device) -> torch.device:
    """The device under test; sync debug mode exists on CUDA alone (skipped in CPU mode)."""
    if instrument == "sync-debug" and device.type != "cuda":
        pytest.skip("sync debug mode needs a CUDA device")
    return device


def count_syncs(instrument: str, fn: Callable[[], Any], counter: Any) -> tuple[Any, list[str]]:
    """``fn()`` and the synchronisations ``instrument`` saw: CUDA's own, or the counter's."""
    if instrument == "sync-debug":
        return cuda_syncs(fn)
    counter.sites = []
    with counter:
        out = fn()
    return out, list(counter.sites)


def check_rule(instrument: str, what: str, attempts: int, sites: list[str]) -> None:
    """One synchronisation per step plus two per attempt, or a message listing each site."""
    expected = 1 + 2 * attempts
    if len(sites) == expected:
        return
    tally = Counter(sites)
    listed = "\n  ".join(f"{n} x {site}" for site, n in tally.items())
    raise AssertionError(
        f"{what}: {instrument} saw {len(sites)} synchronisations, expected 1 + 2 x "
        f"{attempts} attempts = {expected}; by site:\n  {listed}"
    )


INSTRUMENTS = ["sync-debug", "function-mode"]


def sinc(points: int, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    x = torch.linspace(-1, 1, points).unsqueeze(1)
    return model, x.to(device), torch.sinc(10 * x).to(device)


def classifier_batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(64, 32, generator=gen).to(device),
            torch.randint(0, 10, (64,), generator=gen).to(device),
        )
        for _ in range(4)
    ]


def test_the_sync_debug_mode_sees_a_host_read(cuda_only: torch.device) -> None:
    """The instrument itself: one ``.item()`` is one reported synchronisation."""
    t = torch.ones(3, device=cuda_only)
    _, sites = cuda_syncs(lambda: t.sum().item())
    assert len(sites) == 1, sites
    _, sites = cuda_syncs(lambda: (t * 2).sum())
    assert sites == [], sites


@pytest.mark.parametrize("instrument", INSTRUMENTS)
@pytest.mark.parametrize(
    ("name", "options", "points"),
    [
        ("primal-float64", {"gram_dtype": torch.float64, "form": "primal"}, 256),
        ("primal-auto", {"form": "primal"}, 256),
        ("dual-auto", {"form": "dual"}, 24),
        ("rejections", {"damping": 1e-9, "damping_rule": "multiplicative"}, 256),
    ],
)
def test_an_lm_step_synchronises_once_plus_twice_per_attempt(
    name: str, options: dict[str, Any], points: int, instrument: str, device: torch.device
) -> None:
    """float32 sinc fits as in test_host_sync (``"rejections"``: steps from a tiny λ overshoot).

    The steps run one after another under one instrument: a step repeated on the same
    batch reuses the accepted trial's forward pass only while the torch function
    modes stay the same, so both the fresh and the reused linearisation are counted.
    """
    dev = device_for(instrument, device)
    model, x, y = sinc(points, dev)
    opt = so.LevenbergMarquardt(model, **{"damping": 1.0, **options})
    opt.step(x, y)  # the first step on a new input signature checks and caches choices
    counter = SyncCounter()
    attempts = []
    for step in range(1, 7):
        info, sites = count_syncs(instrument, lambda: opt.step(x, y), counter)
        check_rule(instrument, f"{name}, step {step} on {dev}", info.attempts, sites)
        attempts.append(info.attempts)
    if name == "rejections":
        assert max(attempts) > 1, attempts


@pytest.mark.parametrize("instrument", INSTRUMENTS)
def test_a_classifier_dual_step_synchronises_once_plus_twice_per_attempt(
    instrument: str, device: torch.device
) -> None:
    """The classifier defaults (D = I, dual form, J Jᵀ from the layers' factors), new batches."""
    dev = device_for(instrument, device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)).to(dev)
    opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy, form="dual")
    batches = classifier_batches(dev)
    opt.step(*batches[0])
    counter = SyncCounter()
    for i, (x, y) in enumerate(batches[1:], start=1):
        info, sites = count_syncs(instrument, lambda x=x, y=y: opt.step(x, y), counter)
        assert info.form == "dual", info
        check_rule(instrument, f"classifier batch {i} on {dev}", info.attempts, sites)
