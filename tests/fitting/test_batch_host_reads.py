"""Batched fits read the device on the host once per ``check_every`` attempts, no more.

Counted by :class:`secondorder.testing.syncs.SyncCounter`, as LM's host reads are: a
:class:`~torch.overrides.TorchFunctionMode` sees every call that makes the host wait
for a tensor's value (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``,
boolean-mask indexing, ...), on CPU too.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import secondorder as so
from secondorder.fitting.batch import driver
from secondorder.testing.syncs import SyncCounter


def _problem(count: int = 64):
    gen = torch.Generator().manual_seed(0)
    t = torch.linspace(0, 4, 30, dtype=torch.float64)
    a = 1 + torch.rand(count, 1, generator=gen, dtype=torch.float64)
    y = a * torch.exp(-t) + 0.02 * torch.randn(count, 30, generator=gen, dtype=torch.float64)
    y[3, 4] = math.nan  # a failed fit does not add reads either

    def model(t, a, k):
        return a * torch.exp(-k * t)

    return model, t, y


@pytest.mark.parametrize("check_every", [1, 4, 7])
def test_one_host_read_per_check_interval(monkeypatch, check_every):
    model, t, y = _problem()
    steps = []
    real_step = driver.step

    def counted_step(*args: Any, **kwargs: Any) -> None:
        steps.append(1)
        real_step(*args, **kwargs)

    monkeypatch.setattr(driver, "step", counted_step)
    counter = SyncCounter()
    with counter:
        _, _, info = so.curve_fit_batch(model, t, y, p0=[0.5, 0.5], check_every=check_every)
    assert int(info.status[3]) == -1 and bool(info.success[torch.arange(64) != 3].all())
    inside = [
        s
        for s in counter.functions
        if s.split(":")[0] in ("engine.py", "rule.py", "problem.py", "small_linalg.py")
    ]
    assert inside == []  # no read inside a step, the linearisation or the solves
    checks = [s for s in counter.functions if s == "driver.py:_run_chunk"]
    assert len(steps) >= 5
    assert len(checks) == math.ceil(len(steps) / check_every)


def test_a_step_reads_nothing(monkeypatch):
    from secondorder.fitting.batch import api, engine

    model, t, y = _problem(8)
    captured: dict[str, Any] = {}

    def capture(problem, y0, rule, opts):
        captured.update(problem=problem, y0=y0, rule=rule, opts=opts)
        return driver.run(problem, y0, rule, opts)

    monkeypatch.setattr(api, "run", capture)
    so.curve_fit_batch(model, t, y, p0=[0.5, 0.5])
    state = engine.start(captured["problem"], captured["y0"], 1e-3)
    counter = SyncCounter()
    with counter:
        for _ in range(6):
            engine.step(state, captured["problem"], captured["rule"], budget=200)
    assert counter.sites == []
