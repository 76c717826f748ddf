"""compile=True: the slots driver against the eager driver, and the compiled step itself."""

from __future__ import annotations

import math

import pytest
import torch

import secondorder as so
from secondorder.fitting.batch import compiled, engine

F64 = torch.float64


def decay(t, a, k, c):
    return a * torch.exp(-k * t) + c


def _data(count: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 5, 30, dtype=F64)
    true = torch.rand(count, 3, generator=gen, dtype=F64) * torch.tensor([2.0, 1.5, 0.3]) + 0.3
    y = decay(t, *[true[:, j : j + 1] for j in range(3)])
    y = y + 0.02 * torch.randn(y.shape, generator=gen, dtype=F64)
    p0 = true * (1 + 0.3 * torch.randn(true.shape, generator=gen, dtype=F64))
    return t, y, p0


def _eager(monkeypatch):
    """The slots driver with the eager step and covariance pass (no compile, quick)."""
    monkeypatch.setattr(compiled, "compiled_step", lambda: engine.step)
    monkeypatch.setattr(compiled, "compiled_report", lambda: compiled.solution_report)


KEYS = ("cost", "nfev", "njev", "nit", "status", "fun")


def test_slots_refilled_as_fits_finish_give_each_fit_its_own_answer(monkeypatch):
    """The slots driver with the eager step: the same numbers as the compaction driver."""
    _eager(monkeypatch)
    t, y, p0 = _data(37, seed=1)
    y[6, 2] = math.nan
    lb = torch.tensor([0.0, 0.0, -1.0], dtype=F64)
    ub = torch.tensor([10.0, 5.0, 1.0], dtype=F64)
    p0 = p0.clamp(min=lb + 0.01, max=ub - 0.01)
    whole = so.curve_fit_batch(decay, t, y, p0=p0, bounds=(lb, ub))
    seen: list[tuple[int, int]] = []
    slots = so.curve_fit_batch(
        decay,
        t,
        y,
        p0=p0,
        bounds=(lb, ub),
        compile=True,
        chunk_size=8,
        check_every=2,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert int(slots[2].status[6]) == -1
    torch.testing.assert_close(slots[0], whole[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(slots[1], whole[1], rtol=1e-10, atol=1e-14)
    for key in KEYS:
        torch.testing.assert_close(
            slots[2][key], whole[2][key], rtol=1e-12, atol=1e-14, equal_nan=True
        )
    assert seen[-1] == (37, 37) and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_slots_driver_for_least_squares_batch_with_per_fit_args(monkeypatch):
    _eager(monkeypatch)
    t, y, p0 = _data(11, seed=2)

    def fun(q, rows):
        return decay(t, q[:, :1], q[:, 1:2], q[:, 2:]) - rows

    ref = so.least_squares_batch(fun, p0, args=(y,))
    got = so.least_squares_batch(fun, p0, args=(y,), compile=True, chunk_size=4)
    torch.testing.assert_close(got.x, ref.x, rtol=1e-12, atol=1e-14)
    assert torch.equal(got.nfev, ref.nfev) and torch.equal(got.status, ref.status)


def test_an_empty_batch_with_compile(monkeypatch):
    _eager(monkeypatch)
    t = torch.linspace(0, 1, 4, dtype=F64)
    popt, pcov, info = so.curve_fit_batch(
        decay, t, torch.zeros(0, 4, dtype=F64), p0=[1.0, 1.0, 0.0], compile=True
    )
    assert popt.shape == (0, 3) and pcov.shape == (0, 3, 3) and info.message == []


def test_compile_must_be_a_bool():
    t, y, p0 = _data(2, seed=3)
    with pytest.raises(TypeError, match="compile must be True or False, got 'yes'"):
        so.curve_fit_batch(decay, t, y, p0=p0, compile="yes")


@pytest.mark.slow
# torch's own deprecation notices, raised while it compiles (inductor, jit scripting).
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_compiled_step_gives_the_eager_answers_and_isolates_a_poisoned_fit():
    """torch.compile of the step (tens of seconds): float64 answers as eager, fit by fit."""
    t, y, p0 = _data(40, seed=4)
    eager = so.curve_fit_batch(decay, t, y, p0=p0)
    fast = so.curve_fit_batch(decay, t, y, p0=p0, compile=True, chunk_size=16)
    # Fused loops may contract a*b+c into one rounding: the same fits to ~1e-10.
    torch.testing.assert_close(fast[0], eager[0], rtol=1e-9, atol=1e-12)
    # The covariance's compiled pass: the same Jacobian and inverse, summed in another order.
    torch.testing.assert_close(fast[1], eager[1], rtol=1e-6, atol=0)
    assert torch.equal(fast[2].success, eager[2].success)
    assert (fast[2].nfev == eager[2].nfev).double().mean() >= 0.9
    bad_y = y.clone()
    bad_y[5, 3] = math.nan
    poisoned = so.curve_fit_batch(decay, t, bad_y, p0=p0, compile=True, chunk_size=16)
    assert int(poisoned[2].status[5]) == -1
    others = [b for b in range(40) if b != 5]
    torch.testing.assert_close(poisoned[0][others], fast[0][others], rtol=1e-12, atol=0)
    assert torch.equal(poisoned[2].nfev[others], fast[2].nfev[others])
