"""Running the engine for :func:`~secondorder.fitting.least_squares` until a test stops it.

Each :func:`~secondorder.lm.engine.iterate` call is one iteration as scipy counts them;
the budget of ``fun`` calls, the callback and scipy's verbose table are kept here.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..lm.damping import (
    DampingState,
    make_damping_matrix,
    make_damping_rule,
)
from ..lm.engine import iterate
from ..lm.iteration import EngineConfig, refuse
from ..lm.linalg import NormalEquations, make_solver
from .host import HostQRSolver
from .options import Options
from .outcome import Run, optimality
from .problem import FunctionProblem, is_finite_system
from .result import OptimizeResult

_NOT_FINITE = (
    "fun returned non-finite residuals at every trial point, down to the shortest step "
    "the damping allows: x is the last point where they were finite"
)


def _engine_config(opts: Options) -> EngineConfig:
    # No floor on λ: near a singular solution (Powell's) JᵀJ shrinks without bound
    # while D keeps its scale, and any fixed floor would cap the step.
    return EngineConfig.of(opts, max_attempts=1 << 30, damping_min=0.0, damping_max=1e15)


def _first_system(problem: FunctionProblem, y: Tensor) -> NormalEquations:
    system = problem.linearize(y, problem.residuals(y))
    if not is_finite_system(system):
        raise ValueError("The Jacobian (jac) is not finite at x0; cannot take a step.")
    return system


def _make_solver(opts: Options) -> Any:
    if opts.linear_solver == "qr":
        # A few parameters: QR's solves on the host (NumPy), LAPACK without wrappers.
        return HostQRSolver()
    options = opts.tr_options or {}
    tols = [float(options[k]) for k in ("atol", "btol") if k in options]
    return make_solver(
        opts.linear_solver,
        cg_rtol=min(tols) if tols else 1e-6,
        cg_max_iter=options.get("maxiter"),
        # A few parameters: QR's solves on the host (NumPy), not as torch calls.
        host=True,
    )


def _damping_matrix_name(opts: Options, problem: FunctionProblem) -> str:
    # A fixed x_scale is applied as a change of variables u = y / x_scale, in which the
    # damping matrix is the identity: D = diag(1/x_scale²) in y (MINPACK's mode 2).
    if problem.bounds.scale is not None:
        return "identity"
    return opts.damping_matrix or "more"


class _Printer:
    """Scipy's per-iteration table for ``verbose=2`` (columns of 15 characters)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        if on:
            names = ("Iteration", "Total nfev", "Cost", "Cost reduction", "Step norm")
            print("".join(f"{k:^15}" for k in names) + f"{'Optimality':^15}")

    def row(
        self,
        it: int,
        nfev: int,
        cost: float,
        reduction: float | None,
        step: float | None,
        opt: float,
    ) -> None:
        if not self.on:
            return
        red = " " * 15 if reduction is None else f"{reduction:^15.2e}"
        stp = " " * 15 if step is None else f"{step:^15.2e}"
        print(f"{it:^15}{nfev:^15}{cost:^15.4e}{red}{stp}{opt:^15.2e}")


def run_iterations(
    problem: FunctionProblem,
    y: Tensor,
    opts: Options,
    *,
    budget: int,
    callback: Callable[..., Any] | None,
    numpy_in: bool,
) -> Run:
    """LM iterations from ``y`` until a termination test, ``budget`` or ``callback`` stops.

    Each :func:`~secondorder.lm.engine.iterate` call (one *iteration*, as scipy counts
    them) retries with larger λ until a step is accepted or the evaluations left run
    out; the Jacobian is re-evaluated only after an accepted step.
    """
    rule = make_damping_rule(opts.damping_rule)
    matrix = make_damping_matrix(_damping_matrix_name(opts, problem))
    state = DampingState(damping=float(opts.damping))
    solver = _make_solver(opts)
    bounds = problem.bounds
    # Under bounds the step test is trf's, on x itself: in the bounds' free variable
    # y, scaled by D, a step that leaves one coordinate far from where it goes can look
    # negligible beside another coordinate's large ‖D^½y‖ (a fit driven against one
    # bound by a slow valley would stop there, reporting convergence).
    xtol = opts.xtol or 0.0
    xtol_in_x = bounds.bounded and xtol > 0
    config = _engine_config(opts)
    if xtol_in_x:
        config = replace(config, xtol=0.0)
    system = _first_system(problem, y)
    # MINPACK's first trust radius is factor·‖D^½x₀‖, the size of the start.  Measured
    # in the bounds' free variable it is the size of y₀, which says nothing of x₀: at
    # the middle of two-sided bounds (curve_fit's start without p0) y₀ = 0 and the
    # region would start at `factor` in D's units, far too small to leave the start.
    # So x₀'s size counts too, in the free variable's units (start_size).
    size = bounds.start_size(y) if bounds.bounded else None
    status, reason = 0, ""
    history = [0.5 * float(system.loss_sum)]
    printer = _Printer(opts.verbose == 2 and opts.method != "lm")
    if printer.on:
        printer.row(0, problem.nfev, history[0], None, None, optimality(problem, y, opts))
    call = _wrap_callback(callback)
    nit = 0
    while True:
        remaining = budget - problem.nfev
        if remaining <= 0:
            status, reason = 0, "max_nfev reached"
            break
        before, y_before = problem.nfev, y
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
            size=size if state.radius is None else None,
        )
        reason = out.reason
        if out.accepted:
            y = out.x
            history.append(0.5 * out.loss_sum)
        if out.status > 0:
            status = out.status
        elif out.stop and problem.nfev - before < remaining and not out.accepted:
            # λ reached its maximum: steps are as short as the arithmetic allows.  If
            # even the shortest was non-finite, fun is not finite anywhere near y.
            status, reason = (3, reason) if problem.last_finite else (-1, _NOT_FINITE)
        if out.accepted and xtol_in_x and status in (0, 2):
            unit = 1.0 if bounds.scale is None else bounds.scale
            x_new = bounds.to_x(y) / unit
            dx = float(torch.linalg.vector_norm(x_new - bounds.to_x(y_before) / unit))
            if dx <= xtol * (xtol + float(torch.linalg.vector_norm(x_new))):
                status = 4 if status == 2 else 3
        if out.accepted:
            system = problem.linearize(y, problem.residuals(y))
            if not is_finite_system(system):
                # No linear model here: rejected as the optimizer rejects such a point,
                # and the fit stops without claiming convergence.
                reason = refuse(
                    y,
                    out.loss_sum,
                    rule=rule,
                    state=state,
                    config=config,
                    reason="the Jacobian (jac) is not finite at the current point",
                ).reason
                status = -1
        if out.attempts == 0:
            break  # gtol held at the current point: no iteration was run
        nit += 1
        if printer.on:
            x_step = problem.bounds.to_x(y) - problem.bounds.to_x(y_before)
            printer.row(
                nit,
                problem.nfev,
                history[-1],
                0.5 * (out.loss_sum_before - out.loss_sum) if out.accepted else 0.0,
                float(torch.linalg.vector_norm(x_step)),
                optimality(problem, y, opts) if status != -1 else math.nan,
            )
        if call is not None and _stopped_by(call, problem, y, history[-1], nit, numpy_in):
            status, reason = -2, "callback raised StopIteration"
            break
        if status != 0:
            break
    return Run(y=y, status=status, reason=reason, history=history, damping=state.damping, nit=nit)


def _wrap_callback(callback: Callable[..., Any] | None) -> Callable[[OptimizeResult], Any] | None:
    """Scipy's two forms: ``callback(intermediate_result=res)`` or ``callback(x)``."""
    if callback is None:
        return None
    try:
        params = set(inspect.signature(callback).parameters)
    except (TypeError, ValueError):
        params = set()
    if params == {"intermediate_result"}:

        def keyword(res: OptimizeResult) -> Any:
            return callback(intermediate_result=res)

        return keyword

    def positional(res: OptimizeResult) -> Any:
        x = res["x"]
        return callback(x.copy() if isinstance(x, np.ndarray) else x.clone())

    return positional


def _stopped_by(
    call: Callable[[OptimizeResult], Any],
    problem: FunctionProblem,
    y: Tensor,
    cost: float,
    nit: int,
    numpy_in: bool,
) -> bool:
    """Call the callback with the current iterate; ``True`` when it raised StopIteration."""
    x = problem.bounds.to_x(y).detach().clone()
    f = problem.residuals(y).clone()
    res = OptimizeResult(
        x=x.numpy() if numpy_in else x,
        fun=f.numpy() if numpy_in else f,
        nit=nit,
        nfev=problem.nfev,
        cost=cost,
    )
    try:
        call(res)
    except StopIteration:
        return True
    return False
