"""Functional nonlinear least squares with scipy.optimize.least_squares's interface.

:func:`least_squares` minimises ``½ Σ ρ(fᵢ(x)²)`` over a 1-D parameter vector with
the same Levenberg-Marquardt engine as the model optimizer, in float64, with the
Jacobian from automatic differentiation (or a callable, or finite differences for
functions written with NumPy).  Its result object has scipy's fields and meanings, so
porting a fit is a change of import.

It runs in named steps: check the call (:class:`_Options`, :func:`_start_point`), adapt
the user's functions (:mod:`.functions`), build the problem in the free variable of the
bounds' change of variables (:mod:`.bounds`, :mod:`.problem`; robust losses in
:mod:`.losses`), run the engine until a termination test or the budget stops it
(:func:`_solve`), and report in ``x`` (:func:`_result`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._validation import check_choice, check_integer, check_number
from ..lm.damping import (
    DAMPING_MATRICES,
    FITTING_DAMPING_RULES,
    DampingState,
    make_damping_matrix,
    make_damping_rule,
)
from ..lm.engine import EngineConfig, iterate
from ..lm.linalg import NormalEquations, make_solver
from .bounds import BoxTransform, parse_bounds
from .functions import (
    CallCounter,
    flat_residuals,
    jacobian_function,
    output_eps,
    residual_function,
)
from .losses import LOSSES, rho
from .problem import FunctionProblem, is_finite_system
from .result import MESSAGES, OptimizeResult

# LOSSES, MESSAGES and OptimizeResult stay importable from here (the old module path).
__all__ = ["JACS", "LOSSES", "MESSAGES", "SOLVERS", "OptimizeResult", "least_squares"]

JACS = ("auto", "fwd", "rev", "2-point", "3-point")
SOLVERS = ("cholesky", "eigh", "qr", "cg")


def least_squares(
    fun: Callable[..., Any],
    x0: Any,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    jac: str | Callable[..., Any] = "auto",
    loss: str = "linear",
    f_scale: float = 1.0,
    bounds: Any = None,
    ftol: float = 1e-8,
    xtol: float = 1e-8,
    gtol: float = 1e-8,
    max_nfev: int | None = None,
    damping: float = 1e-3,
    damping_rule: str = "trust",
    damping_matrix: str = "more",
    solver: str = "qr",
    geodesic: bool = False,
) -> OptimizeResult:
    """Solve ``min_x ½ Σ ρ(fᵢ(x)²)`` by Levenberg-Marquardt, with scipy's interface.

    Args:
        fun: ``fun(x, *args, **kwargs)`` returning the residuals (any shape,
            flattened) for a 1-D float64 ``x``.  Written with torch operations it is
            differentiated exactly; written with NumPy (``x0`` a NumPy array and
            ``fun`` returning one) its Jacobian comes from finite differences or
            from ``jac``.
        x0: starting point, 1-D and finite (tensor, array or sequence).
        jac: ``"auto"`` (forward mode when residuals outnumber parameters, else
            reverse), ``"fwd"``, ``"rev"``, ``"2-point"``, ``"3-point"``, or a
            callable ``jac(x, *args, **kwargs) -> (m, n)``.
        loss: ``"linear"``, ``"soft_l1"``, ``"huber"``, ``"cauchy"``, ``"arctan"``
            with scipy's definitions, applied to ``(f / f_scale)²``.
        f_scale: soft margin between inlier and outlier residuals.
        bounds: ``(lb, ub)`` scalars or arrays (``±inf`` for none), or a
            ``scipy.optimize.Bounds``; ``lb < ub`` elementwise, ``x0`` within.
        ftol: scipy's tolerance on the relative reduction of the cost.
        xtol: scipy's tolerance on the relative step.
        gtol: scipy's tolerance on the cosine between residuals and columns of J
            (MINPACK's measure).
        max_nfev: calls of ``fun`` allowed, counted as ``nfev`` is (default
            ``100·n``, or ``100·n·(n+1)`` with finite differences, as scipy's "lm").
            The run stops once it is spent; the Jacobian at the last accepted point
            may take it past by one Jacobian's calls.  ``max_nfev=1`` calls ``fun``
            for the value and the Jacobian at ``x0`` only: 2 calls with autodiff
            (the first records a graph to check the residuals depend on ``x``),
            ``1 + n`` with ``"2-point"``, ``1 + 2n`` with ``"3-point"``.
        damping: initial λ.
        damping_rule: ``"trust"`` (MINPACK's trust region on ``‖D^½δ‖``; ``damping``
            is then only its first guess of λ), ``"nielsen"`` or ``"multiplicative"``.
        damping_matrix: ``"more"``, ``"marquardt"`` or ``"identity"``.
        solver: ``"qr"``, ``"cholesky"``, ``"eigh"`` or ``"cg"``.
        geodesic: add geodesic acceleration.  The defaults of these LM parts
            mirror MINPACK (Moré's scaling and a QR of J).

        args: extra positional arguments of ``fun`` (and of a callable ``jac``).
        kwargs: extra keyword arguments of ``fun`` (and of a callable ``jac``).

    Returns:
        An :class:`OptimizeResult` with scipy's fields.  ``nfev`` counts every call of
        ``fun`` except those made inside an automatic-differentiation Jacobian: residual
        values (the first at ``x0`` included), finite-difference columns (as scipy's
        "lm" counts them) and geodesic second derivatives.  ``njev`` counts Jacobian
        evaluations; ``"fwd"``/``"rev"`` call ``fun`` once per Jacobian, so with them
        ``fun`` is called exactly ``nfev + njev`` times, otherwise exactly ``nfev``
        times.  Nothing is evaluated twice: the result reuses the last residuals and
        Jacobian.
    """
    kwargs = _check_call(fun, args, kwargs, geodesic)
    x_start, numpy_in = _start_point(x0)
    n = x_start.numel()
    opts = _Options(
        jac=jac,
        loss=loss,
        f_scale=f_scale,
        ftol=ftol,
        xtol=xtol,
        gtol=gtol,
        max_nfev=max_nfev,
        damping=damping,
        damping_rule=damping_rule,
        damping_matrix=damping_matrix,
        solver=solver,
        geodesic=geodesic,
    )
    transform = BoxTransform(*parse_bounds(bounds, n))
    _check_feasible(x_start, transform)
    y_start = transform.to_y(transform.strictly_feasible(x_start))
    problem = _build_problem(fun, args, kwargs, y_start, numpy_in, transform, opts)
    if max_nfev is not None:
        budget = int(max_nfev)
    else:
        # scipy's "lm" default: finite-difference columns count as evaluations too.
        differences = not callable(jac) and (not problem.differentiable or jac in JACS[3:])
        budget = 100 * n * (n + 1) if differences else 100 * n
    run = _solve(problem, y_start, opts, budget=budget)
    return _result(problem, run, opts, numpy_in=numpy_in)


# ---------------------------------------------------------------------------------------
# Checking the call


@dataclass(frozen=True)
class _Options:
    """The solver's options, checked on construction with the messages users see."""

    jac: str | Callable[..., Any]
    loss: str
    f_scale: float
    ftol: float
    xtol: float
    gtol: float
    max_nfev: int | None
    damping: float
    damping_rule: str
    damping_matrix: str
    solver: str
    geodesic: bool

    def __post_init__(self) -> None:
        if not callable(self.jac):
            check_choice("jac", self.jac, JACS, extra=" or a callable")
        check_choice("loss", self.loss, LOSSES)
        check_number("f_scale", self.f_scale, above=0, type_error=False)
        for name, tol in (("ftol", self.ftol), ("xtol", self.xtol), ("gtol", self.gtol)):
            check_number(name, tol, at_least=0, type_error=False)
        check_integer("max_nfev", self.max_nfev, allow_none=True)
        check_choice("damping_rule", self.damping_rule, FITTING_DAMPING_RULES)
        check_choice("damping_matrix", self.damping_matrix, DAMPING_MATRICES)
        check_choice("solver", self.solver, SOLVERS)
        check_number("damping", self.damping, at_least=0, type_error=False)


def _check_call(
    fun: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None, geodesic: bool
) -> dict[str, Any]:
    """Check ``args``, ``geodesic`` and ``fun``; return ``kwargs`` as a fresh dict."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments of fun, got {args!r}")
    if not isinstance(geodesic, bool):
        raise TypeError(f"geodesic must be a bool, got {geodesic!r}")
    kwargs = dict(kwargs or {})
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}")
    return kwargs


def _start_point(x0: Any) -> tuple[Tensor, bool]:
    """``x0`` as a fresh 1-D finite float64 tensor, and whether it came as NumPy/sequence."""
    if (isinstance(x0, Tensor) and x0.is_complex()) or (
        not isinstance(x0, Tensor) and np.iscomplexobj(x0)
    ):
        raise ValueError(f"x0 must be real, got a complex array {x0!r}")
    if isinstance(x0, Tensor) and x0.device.type != "cpu":
        raise ValueError(
            f"x0 is on device {x0.device}; least_squares runs on the CPU: pass x0.cpu()"
        )
    numpy_in = not isinstance(x0, Tensor)
    try:
        x_start = torch.as_tensor(np.asarray(x0, dtype=np.float64)) if numpy_in else x0
    except (TypeError, ValueError) as exc:
        raise TypeError(f"x0 must be a 1-D array of numbers, got {x0!r}") from exc
    if not x_start.is_floating_point():
        x_start = x_start.to(torch.float64)
    x_start = x_start.detach().to(torch.float64).clone()
    if x_start.ndim != 1 or x_start.numel() == 0:
        raise ValueError(f"x0 must be a non-empty 1-D array, got shape {tuple(x_start.shape)}")
    if not bool(torch.isfinite(x_start).all()):
        raise ValueError(f"x0 must be finite, got {x_start.tolist()}")
    return x_start, numpy_in


def _check_feasible(x_start: Tensor, transform: BoxTransform) -> None:
    lb, ub = transform.lb, transform.ub
    if bool(((x_start < lb) | (x_start > ub)).any()):
        raise ValueError(
            f"x0 is infeasible: it lies outside bounds lb={lb.tolist()}, ub={ub.tolist()}"
        )


# ---------------------------------------------------------------------------------------
# Building the problem


def _build_problem(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    y_start: Tensor,
    numpy_in: bool,
    transform: BoxTransform,
    opts: _Options,
) -> FunctionProblem:
    """Adapt ``fun`` and ``jac`` to tensors, check the residuals at ``x0``, wire the problem.

    Whether ``fun`` speaks torch (differentiable) or NumPy is decided by calling it once
    with the kind of array ``x0`` is: what it returns decides, and it is kept as the
    residuals at the start ``x(y_start)`` (the first of ``nfev``).
    """
    counter = CallCounter(fun)
    x_eval = transform.to_x(y_start)
    autodiff = isinstance(opts.jac, str) and opts.jac in ("auto", "fwd", "rev")
    probe = _probe(counter, args, kwargs, x_eval, numpy_in, autodiff=autodiff)
    numpy_fun = not isinstance(probe, Tensor)
    residuals = residual_function(counter, args, kwargs, numpy_fun=numpy_fun)
    f0 = flat_residuals(probe, numpy_fun=numpy_fun).detach()
    if f0.numel() == 0:
        raise ValueError("fun returned no residuals at x0")
    if not bool(torch.isfinite(f0).all()):
        raise ValueError("Residuals are not finite in the initial point x0.")
    jac = jacobian_function(
        opts.jac,
        residuals,
        numpy_fun=numpy_fun,
        shape=(f0.numel(), x_eval.numel()),
        args=args,
        kwargs=kwargs,
        eps=output_eps(probe),
        counter=counter,
    )
    problem = FunctionProblem(
        residuals,
        jac,
        transform,
        opts.loss,
        float(opts.f_scale),
        need_gram=opts.solver in ("cholesky", "eigh"),
        differentiable=not numpy_fun,
        counter=counter,
        takes_residuals=True,
    )
    problem.remember(y_start, f0)
    return problem


def _probe(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    x_start: Tensor,
    numpy_in: bool,
    *,
    autodiff: bool,
) -> Any:
    """``fun(x0)``; a torch ``fun`` to be differentiated is checked to depend on ``x``.

    Autodiff of residuals that were detached from ``x`` (``.detach()``, ``.item()``, a
    NumPy round trip, ``torch.no_grad()``) gives a zero Jacobian, and the zero gradient
    would pass the gtol test at ``x0``: a false success.  So the first call records a
    graph and the residuals must reach ``x`` through it.
    """
    if numpy_in:
        return fun(x_start.numpy().copy(), *args, **kwargs)
    if not autodiff:
        return fun(x_start.clone(), *args, **kwargs)
    leaf = x_start.clone().requires_grad_(True)
    with torch.enable_grad(), warnings.catch_warnings():
        # float(x[i]) on the recording x warns; the check below says what is wrong.
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
        out = fun(leaf.clone(), *args, **kwargs)
        connected = (
            isinstance(out, Tensor)
            and out.is_floating_point()
            and out.requires_grad
            and torch.autograd.grad(out.sum(), leaf, allow_unused=True)[0] is not None
        )
    if isinstance(out, Tensor) and out.is_floating_point() and not connected:
        raise ValueError(
            "fun's residuals do not depend on the parameters x: the residuals at x0 are "
            "not connected to x by autograd (detached with .detach(), .item(), .numpy() or "
            "torch.no_grad(), or computed from other tensors only), so their Jacobian "
            "would be 0 and x0 would pass for a minimum; compute the residuals from x "
            "with torch operations, or pass jac= (a callable, '2-point' or '3-point')"
        )
    return out.detach() if isinstance(out, Tensor) else out


# ---------------------------------------------------------------------------------------
# Running the engine


@dataclass(frozen=True)
class _Run:
    """How the iterations ended: the point in ``y``, scipy's status and the cost history."""

    y: Tensor
    status: int
    reason: str
    history: list[float]
    damping: float


def _engine_config(opts: _Options) -> EngineConfig:
    return EngineConfig(
        max_attempts=1 << 30,
        min_gain_ratio=1e-4,
        # No floor: near a singular solution (Powell's) JᵀJ shrinks without bound
        # while D keeps its scale, and any fixed floor would cap the step.
        damping_min=0.0,
        damping_max=1e15,
        ftol=opts.ftol,
        xtol=opts.xtol,
        gtol=opts.gtol,
        geodesic=opts.geodesic,
    )


def _first_system(problem: FunctionProblem, y: Tensor) -> NormalEquations:
    system = problem.linearize(y, problem.residuals(y))
    if not is_finite_system(system):
        raise ValueError("The Jacobian (jac) is not finite at x0; cannot take a step.")
    return system


def _solve(problem: FunctionProblem, y: Tensor, opts: _Options, *, budget: int) -> _Run:
    """LM iterations from ``y`` until a termination test holds or ``budget`` evaluations.

    Each :func:`~secondorder.lm.engine.iterate` call retries with larger λ until a step
    is accepted or the evaluations left run out; the Jacobian is re-evaluated only
    after an accepted step.
    """
    rule = make_damping_rule(opts.damping_rule)
    matrix = make_damping_matrix(opts.damping_matrix)
    state = DampingState(damping=float(opts.damping))
    solver = make_solver(opts.solver)
    config = _engine_config(opts)
    system = _first_system(problem, y)
    status, reason = 0, ""
    history = [0.5 * float(system.loss_sum)]
    while True:
        remaining = budget - problem.nfev
        if remaining <= 0:
            status, reason = 0, "max_nfev reached"
            break
        before = problem.nfev
        out = iterate(
            problem,
            y,
            system,
            solver=solver,
            rule=rule,
            matrix=matrix,
            state=state,
            config=config,
            max_attempts=remaining,
        )
        reason = out.reason
        if out.accepted:
            y = out.x
            history.append(0.5 * out.loss_sum)
        if out.status > 0:
            status = out.status
            break
        if out.stop and problem.nfev - before < remaining and not out.accepted:
            # λ reached its maximum: steps are as short as the arithmetic allows.
            status = 3
            break
        if out.accepted:
            system = problem.linearize(y, problem.residuals(y))
            if not is_finite_system(system):
                # No linear model here: stop without claiming convergence.
                status, reason = -1, "the Jacobian (jac) is not finite at the current point"
                break
    return _Run(y=y, status=status, reason=reason, history=history, damping=state.damping)


# ---------------------------------------------------------------------------------------
# Reporting in x


def _result(
    problem: FunctionProblem, run: _Run, opts: _Options, *, numpy_in: bool
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
    loss, f_scale = opts.loss, opts.f_scale
    rho1 = torch.ones_like(f) if loss == "linear" else rho(loss, (f / f_scale) ** 2)[1]
    grad = J.T @ (rho1 * f)
    opt_vec = grad * transform.cl_scale(x, grad) if transform.any else grad
    optimality = float(opt_vec.abs().max())
    active = transform.active(x)

    def out_arr(t: Tensor) -> Any:
        return t.numpy() if numpy_in else t

    return OptimizeResult(
        x=out_arr(x),
        cost=0.5 * float(cost2),
        fun=out_arr(f.detach()),
        jac=out_arr(J),
        grad=out_arr(grad.detach()),
        optimality=optimality,
        active_mask=out_arr(active),
        nfev=problem.nfev,
        njev=problem.njev,
        status=run.status,
        message=run.reason if run.status == -1 else MESSAGES[run.status],
        success=run.status > 0,
        damping=run.damping,
        reason=run.reason,
        history=run.history,
    )
