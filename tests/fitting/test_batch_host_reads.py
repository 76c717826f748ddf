"""Batched fits read the device on the host once per ``check_every`` attempts, no more.

Counted as in tests/lm/test_host_sync.py: a :class:`~torch.overrides.TorchFunctionMode`
sees every call that makes the host wait for a tensor's value (``.item()``,
``.tolist()``, ``bool(t)``, ``nonzero``, boolean-mask indexing, ...), on CPU too.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

import secondorder as so
from secondorder.fitting.batch import driver

SYNCS = {
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__repr__",
    "__format__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "equal",
    "allclose",
    "numpy",
    "cpu",
}


def _bool_index(args: tuple[Any, ...]) -> bool:
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool and i.ndim > 0 for i in index)


class SyncCounter(TorchFunctionMode):
    """Every host read, with the file and function of secondorder that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCS or (name == "__getitem__" and _bool_index(args)):
            frames = [f for f in traceback.extract_stack()[:-1] if "secondorder" in f.filename]
            where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].name}" if frames else "?"
            self.sites.append(where)
        return func(*args, **(kwargs or {}))


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
        for s in counter.sites
        if s.split(":")[0] in ("engine.py", "rule.py", "problem.py", "small_linalg.py")
    ]
    assert inside == []  # no read inside a step, the linearisation or the solves
    checks = [s for s in counter.sites if s == "driver.py:_run_chunk"]
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
