"""LM's stage breakdown reaches the optimizer through one adapter, before and after the
public ``internals()`` hook: both paths must give the same view and the same floor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from benchmarks import lm_floor, lm_methods
from secondorder import LevenbergMarquardt
from secondorder.lm.residuals import mse


@dataclass(frozen=True)
class FakeInternals:
    """The shape of the announced ``LMInternals`` record."""

    problem: Any
    damping_matrix: Any
    damping_rule: Any
    damping_state: Any


def _stepped() -> LevenbergMarquardt:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = LevenbergMarquardt(model, mse, damping=0.25)
    x = torch.linspace(-1, 1, 20).unsqueeze(1)
    opt.step(x, torch.sin(3 * x))
    return opt


def test_the_hook_is_used_when_the_optimizer_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    opt = _stepped()

    class State:
        damping = 0.125

    record = FakeInternals(object(), object(), object(), State())
    monkeypatch.setattr(LevenbergMarquardt, "internals", lambda self: record, raising=False)
    view = lm_floor.lm_internals(opt)
    assert view.problem is record.problem and view.damping_matrix is record.damping_matrix
    assert view.damping_state is record.damping_state and view.damping == 0.125


def test_hook_and_fallback_give_the_same_view_and_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    opt = _stepped()
    plain = lm_floor.lm_internals(opt)
    assert plain.damping == opt.damping  # λ after the step, as the public property says
    assert plain.problem.n == opt.num_parameters
    problem = lm_methods.build_problems(tiny=True, keys=["sinc"])["sinc"]
    structural = ("jacobian_shape", "slices", "form", "solver", "jacobian", "gram_dtype")
    before = lm_floor.measure_floor(problem, "c", {}, 1, mse)

    def hook(self: LevenbergMarquardt) -> FakeInternals:
        monkeypatch.undo()  # read the parts the way the versions without the hook did
        v = lm_floor.lm_internals(self)
        monkeypatch.setattr(LevenbergMarquardt, "internals", hook, raising=False)
        return FakeInternals(v.problem, v.damping_matrix, "rule", v.damping_state)

    monkeypatch.setattr(LevenbergMarquardt, "internals", hook, raising=False)
    assert lm_floor.lm_internals(opt) == plain
    after = lm_floor.measure_floor(problem, "c", {}, 1, mse)
    assert {k: after[k] for k in structural} == {k: before[k] for k in structural}
    assert after["jacobian_shape"] == [200, problem.num_parameters]
    assert after["factor_solve_s"] > 0 and after["gram_solve_over_gemm_f32"] > 0
