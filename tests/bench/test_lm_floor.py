"""LM's stage breakdown reaches the optimizer through one adapter, before and after the
public ``internals()`` hook: both paths must give the same view and the same floor."""

from __future__ import annotations

import torch

from benchmarks import lm_floor, lm_methods
from secondorder import LevenbergMarquardt
from secondorder.lm.residuals import mse


def _stepped() -> LevenbergMarquardt:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = LevenbergMarquardt(model, mse, damping=0.25)
    x = torch.linspace(-1, 1, 20).unsqueeze(1)
    opt.step(x, torch.sin(3 * x))
    return opt


def test_the_view_is_the_optimizers_internals() -> None:
    opt = _stepped()
    inner = opt.internals()
    view = lm_floor.lm_internals(opt)
    assert view.problem is inner.problem and view.damping_matrix is inner.damping_matrix
    assert view.damping_state is inner.damping_state
    assert view.damping == opt.damping  # λ after the step, as the public property says
    assert view.problem.n == opt.num_parameters


def test_the_floor_measures_the_step_the_optimizer_took() -> None:
    problem = lm_methods.build_problems(tiny=True, keys=["sinc"])["sinc"]
    floor = lm_floor.measure_floor(problem, "c", {}, 1, mse)
    assert floor["jacobian_shape"] == [200, problem.num_parameters]
    assert floor["factor_solve_s"] > 0 and floor["gram_solve_over_gemm_f32"] > 0
