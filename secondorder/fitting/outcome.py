"""The result of a :func:`~secondorder.fitting.least_squares` call, reported in ``x``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .losses import rho
from .options import EPS, Options
from .problem import FunctionProblem
from .result import MESSAGES, OptimizeResult


@dataclass(frozen=True)
class Run:
    """How the iterations ended: the point in ``y``, scipy's status and the cost history."""

    y: Tensor
    status: int
    reason: str
    history: list[float]
    damping: float
    nit: int


def _gradient(problem: FunctionProblem, f: Tensor, J: Tensor, opts: Options) -> Tensor:
    """``Jᵀ(ρ'·f)``, the gradient of the cost in ``x``."""
    if opts.loss == "linear":
        return J.T @ f
    return J.T @ (rho(opts.loss, (f / opts.f_scale) ** 2)[1] * f)


def _reported_jacobian(f: Tensor, J: Tensor, opts: Options) -> Tensor:
    """The ``res.jac`` scipy reports: J, under a robust loss with rows scaled by ``√(ρ' + 2zρ'')``.

    ``z = (f/f_scale)²``, the factor floored at machine epsilon as scipy floors it: then
    ``JᵀJ`` is the Gauss-Newton model of the robust cost's Hessian, which is what
    :func:`~secondorder.fitting.covariance` (and scipy's ``curve_fit``) invert.
    """
    if opts.loss == "linear":
        return J
    z = (f / opts.f_scale) ** 2
    _, d1, d2 = rho(opts.loss, z)
    return J * torch.clamp(d1 + 2 * z * d2, min=EPS).sqrt()[:, None]


def optimality(problem: FunctionProblem, y: Tensor, opts: Options) -> float:
    """Scipy's first-order optimality at ``y``: ``‖grad‖∞``, Coleman-Li scaled under bounds."""
    transform = problem.bounds
    x = transform.to_x(y).detach()
    f = problem.residuals(y)
    grad = _gradient(problem, f, problem.jacobian(y, f), opts)
    vec = grad * transform.cl_scale(x, grad) if transform.bounded else grad
    return float(vec.abs().max())


def result_in_x(
    problem: FunctionProblem, run: Run, opts: Options, *, numpy_in: bool
) -> OptimizeResult:
    """The result's fields at the solution ``x(y)``: its residuals and Jacobian in ``x``.

    Both were computed by the run (the residuals when the point was tried, the Jacobian
    when it was linearised) and are reused; only a point accepted in the last iteration
    needs its Jacobian, counted in ``njev``.  Under bounds ``optimality`` is Coleman-Li
    scaled, as scipy's "trf" reports it.
    """
    transform = problem.bounds
    x = transform.to_x(run.y).detach()
    f = problem.residuals(run.y)
    J = problem.jacobian(run.y, f)
    cost2 = problem.cost2(f)
    grad = _gradient(problem, f, J, opts)
    opt_vec = grad * transform.cl_scale(x, grad) if transform.bounded else grad
    optimality = float(opt_vec.abs().max())
    active = transform.active(x)

    def out_arr(t: Tensor) -> Any:
        return t.numpy() if numpy_in else t

    njev: int | None = problem.njev
    if opts.method == "lm" and problem.differences:
        njev = None  # scipy's "lm" reports no Jacobian evaluations with finite differences
    return OptimizeResult(
        x=out_arr(x),
        cost=0.5 * float(cost2),
        fun=out_arr(f.detach()),
        jac=out_arr(_reported_jacobian(f.detach(), J, opts)),
        grad=out_arr(grad.detach()),
        optimality=optimality,
        active_mask=out_arr(active),
        nfev=problem.nfev,
        njev=njev,
        status=run.status,
        message=run.reason if run.status == -1 else MESSAGES[run.status],
        success=run.status > 0,
        nit=run.nit,
        damping=run.damping,
        reason=run.reason,
        history=run.history,
    )
