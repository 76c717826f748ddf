"""One Levenberg-Marquardt iteration, independent of where the residuals come from.

The engine sees a :class:`~secondorder.lm.iteration.Problem` (something that can
linearise its residuals at a point and evaluate ``Σ r²`` at a trial point) and the
parts chosen by the user: a linear solver, a damping rule and a damping matrix.  It
owns the loop of attempts, the gain-ratio acceptance and the termination tests; the
model optimizer (:class:`~secondorder.lm.LevenbergMarquardt`) and the functional
:func:`~secondorder.fitting.least_squares` are both thin drivers around
:func:`iterate`.

An attempt with damping λ solves ``(JᵀJ + λD) v = -Jᵀr``, optionally adds geodesic
acceleration, scales by ``lr`` and evaluates the trial point.  It is accepted when the
gain ratio

    ρ = (Σr²(x) - Σr²(x + δ)) / (-2gᵀδ - ‖Jδ‖²)

exceeds ``min_gain_ratio``; a step that raises the loss (ρ ≤ 0) is never kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .damping import DampingMatrix, DampingRule, DampingState, StepRecord, raise_damping
from .iteration import EngineConfig, Outcome, Problem, refuse, unmoved
from .linalg import Factorization, LinearSolver, NormalEquations
from .measure import HostView, convergence, measure, measure_on_host
from .precision import StepPrecision

__all__ = ["EngineConfig", "Outcome", "Problem", "iterate", "refuse"]


def _solve(
    fact: Factorization,
    damping: float,
    b: Tensor,
    w: Tensor | None,
    dtype: torch.dtype,
    check: bool = True,
) -> Tensor | None:
    """The solve, or None when it failed; ``check=False`` leaves finiteness to the caller."""
    try:
        delta = fact.solve(damping, b, w) if check else fact.solve_unchecked(damping, b, w)
    except torch.linalg.LinAlgError:
        return None
    if delta is None or (check and not bool(torch.isfinite(delta).all())):
        return None
    return delta.to(dtype)


@dataclass
class _Loop:
    """The attempts of one iteration: what they share, and the account of the last one."""

    problem: Problem
    x: Tensor
    system: NormalEquations
    fact: Factorization
    d: Tensor
    rule: DampingRule
    state: DampingState
    config: EngineConfig
    lr: float
    loss0: float
    #: ``‖x‖`` on the device (``None`` when the factorisation lives on the host).
    xnorm0: Tensor | None
    #: ``-r`` for solvers that need the residuals (dual form, QR, CG), else ``None``.
    w: Tensor | None
    reason: str = "attempts exhausted without reducing the loss"
    rho: float = 0.0
    cg_iterations: int = 0
    #: The magnitude of each coordinate of x, where ``|x|`` is not it (else ``None``).
    size: Tensor | None = None
    #: ``(‖D^½·size‖, ‖D^-½Jᵀr‖)`` for a rule that chooses λ itself, read once.
    scaled_norms: tuple[float, float] | None = None
    #: The LM direction at the λ the rule chose, kept from its search.
    chosen: tuple[float, Tensor] | None = None
    #: ``Jv`` of the current direction ``v`` when the factorisation formed it.
    image: Tensor | None = None
    #: NumPy views of the iteration's vectors when the factorisation lives on the host.
    host: HostView | None = None

    def reject(self, step: StepRecord | None = None) -> None:
        """Raise λ after a failed attempt, restarting from ``damping_restart`` at zero."""
        c = self.config
        raise_damping(
            self.rule,
            self.state,
            damping_min=c.damping_min,
            restart=c.damping_restart,
            step=step,
        )

    def stopped(self, attempt: int, status: int, reason: str) -> Outcome:
        """The iteration ends at ``x`` without a step."""
        return unmoved(
            self.x,
            self.loss0,
            attempts=attempt,
            status=status,
            reason=reason,
            stop=True,
            gain_ratio=self.rho,
            cg_iterations=self.cg_iterations,
            matrix_dtype=self.fact.dtype,
        )


def iterate(
    problem: Problem,
    x: Tensor,
    system: NormalEquations,
    *,
    solver: LinearSolver,
    rule: DampingRule,
    matrix: DampingMatrix,
    state: DampingState,
    config: EngineConfig,
    lr: float = 1.0,
    max_attempts: int | None = None,
    size: Tensor | None = None,
    precision: StepPrecision | None = None,
) -> Outcome:
    """Run the attempts of one LM iteration from ``x``, linearised as ``system``.

    ``state`` (λ, ν, Moré scale) is updated in place.  ``x`` is never modified; the
    returned ``Outcome.x`` is a new tensor when a step was accepted.  ``size``: the
    magnitude of each coordinate of ``x`` a trust region's first radius is measured
    from (``‖D^½·size‖``), where ``|x|`` is not it (``x`` a change of variables).
    ``precision``: the dtype of this iteration's normal matrix and, in the dual form,
    its float32 check (default: the record's own dtype).
    """
    # Host synchronisations: one here (loss and gtol test, shared with the caller's
    # finiteness check), then per attempt one before the trial evaluation (did the
    # solve succeed: a failed one must not be evaluated) and one after it (accept?).
    _, loss0, cos = system.scalars()
    if cos <= config.gtol:
        return unmoved(
            x,
            loss0,
            attempts=0,
            status=1,
            reason="gtol: the gradient is orthogonal to the residuals (max |cos| <= gtol)",
            stop=True,
            gain_ratio=0.0,
        )
    col = system.col_sq if system.scale_sq is None else system.scale_sq
    d = matrix.diagonal(col, state, config.damping_min)
    try:
        fact = solver.factor(system, d, matrix.uniform, precision or StepPrecision())
    except torch.linalg.LinAlgError as exc:
        # An eigendecomposition or QR that does not converge is a numerical fault of
        # this point, not of the program: raise λ and let the caller try again.
        raise_damping(
            rule,
            state,
            damping_min=config.damping_min,
            damping_max=config.damping_max,
            restart=config.damping_restart,
        )
        return unmoved(
            x,
            loss0,
            attempts=1,
            status=0,
            reason=f"factorisation failed: {exc}",
            stop=False,
            gain_ratio=math.nan,
        )
    loop = _Loop(
        problem=problem,
        x=x,
        system=system,
        fact=fact,
        d=d,
        rule=rule,
        state=state,
        config=config,
        lr=lr,
        loss0=loss0,
        xnorm0=None if fact.on_host else torch.linalg.vector_norm(x, dtype=torch.float64),
        w=_residual_w(system, fact),
        host=HostView.of(x, system, d, fact) if fact.on_host else None,
        size=size,
    )
    allowed = config.max_attempts if max_attempts is None else max_attempts
    attempt = 0
    while attempt < allowed:
        attempt += 1
        outcome = _attempt(loop, attempt)
        if outcome is not None:
            return outcome
        if state.damping > config.damping_max:
            state.damping = config.damping_max
            why = f"damping reached its maximum {config.damping_max:.3g}; last attempt: "
            return loop.stopped(attempt, 0, why + loop.reason)
    return loop.stopped(attempt, 0, f"{allowed} attempts exhausted; last: {loop.reason}")


def _residual_w(system: NormalEquations, fact: Factorization) -> Tensor | None:
    """``-r`` for the solvers that need it; a host factorisation that holds it gives it."""
    if system.residuals is None:
        return None
    # A host factorisation of [J, -r] recognises its own -r by identity; a fresh
    # negation would cost it a comparison of every entry.
    held = fact.held_residuals()
    return held if held is not None else -system.residuals


def _attempt(loop: _Loop, attempt: int) -> Outcome | None:
    """One attempt at the current λ: an :class:`Outcome` ends the iteration, ``None`` goes on.

    Every way an attempt fails raises λ once (:meth:`_Loop.reject`) and leaves its
    account in ``loop.reason``.
    """
    lam = _choose(loop) if loop.rule.chooses else loop.state.damping
    direction = _direction(loop, lam)
    if direction is None:
        loop.reject()
        return None
    if loop.host is not None:
        d = direction.numpy() if loop.lr == 1.0 else loop.lr * direction.numpy()
        xt = loop.host.x + d
        x_try = torch.from_numpy(xt)
        values = measure_on_host(loop.system, loop.host, d, xt, loop.rule.chooses)
    else:
        delta = loop.lr * direction
        x_try = loop.x + delta
        image = loop.image
        if image is not None and loop.lr != 1.0:
            image = loop.lr * image
        assert loop.xnorm0 is not None
        d_chosen = loop.d if loop.rule.chooses else None
        values = measure(loop.system, loop.xnorm0, d_chosen, delta, x_try, image)
    solved, pred, step_norm, xnorm_try, xnorm = values[:5]
    if not solved:
        loop.reason = f"linear solve failed at damping {lam:.3g}"
        loop.reject()
        return None
    measured = (values[5], values[6]) if loop.rule.chooses else None
    return _judge(loop, attempt, lam, x_try, pred, step_norm, xnorm_try, xnorm, measured)


def _choose(loop: _Loop) -> float:
    """λ from a rule that picks it (a trust region), by solves with this factorisation.

    The direction at the chosen λ is kept for :func:`_direction`, so the search costs
    no extra solve at the λ it settles on.
    """
    x, system, fact = loop.x, loop.system, loop.fact
    solved: dict[float, Tensor] = {}
    if fact.on_host:
        # A few parameters: the norms in NumPy, each λ a few vector operations.
        if loop.scaled_norms is None:
            view = loop.host
            assert view is not None
            size = view.x if loop.size is None else loop.size.to(torch.float64).numpy()
            with np.errstate(all="ignore"):
                xs = view.sqrt_d * size
                gs = view.grad / view.sqrt_d
                loop.scaled_norms = (math.sqrt(float(xs.dot(xs))), math.sqrt(float(gs.dot(gs))))
        w = loop.w
        assert w is not None

        def scaled_norm(lam: float) -> float | None:
            # The norm alone: the step is formed once, at the λ chosen (_direction).
            return fact.scaled_norm(lam, w)

    else:
        wide = torch.float64
        sqrt_d = loop.d.to(wide).sqrt()
        if loop.scaled_norms is None:
            at = x if loop.size is None else loop.size
            xs_norm, gs_norm = torch.stack(
                [
                    torch.linalg.vector_norm(sqrt_d * at.to(wide)),
                    torch.linalg.vector_norm(system.grad.to(wide) / sqrt_d),
                ]
            ).tolist()
            loop.scaled_norms = (xs_norm, gs_norm)

        def scaled_norm(lam: float) -> float | None:
            v = _solve(fact, lam, -system.grad, loop.w, x.dtype)
            loop.cg_iterations += fact.iterations
            if v is None:
                return None
            solved[lam] = v
            return float(torch.linalg.vector_norm(sqrt_d * v.to(wide)))

    lam = loop.rule.choose(loop.state, scaled_norm, *loop.scaled_norms)
    loop.chosen = (lam, solved[lam]) if lam in solved else None
    return lam


def _direction(loop: _Loop, lam: float) -> Tensor | None:
    """The LM direction ``v`` at λ, plus half the geodesic acceleration when enabled.

    ``None`` when the solve failed or the acceleration is unusable (the reason is left
    in ``loop.reason``).
    """
    x, system, fact, config = loop.x, loop.system, loop.fact, loop.config
    loop.image = None
    if loop.chosen is not None and loop.chosen[0] == lam:
        v: Tensor | None = loop.chosen[1]
    elif loop.host is not None and loop.w is not None:
        out = fact.solve_scaled(lam, loop.w)
        v = None if out is None else out[0]
    else:
        v = _solve(fact, lam, -system.grad, loop.w, x.dtype, check=config.geodesic)
        loop.cg_iterations += fact.iterations
        loop.image = fact.image()
    if v is None:
        loop.reason = f"linear solve failed at damping {lam:.3g}"
        return None
    if not config.geodesic:
        return v
    loop.image = None
    b_vv, r_vv = loop.problem.second_directional(x, v, system)
    a = _solve(fact, lam, -b_vv, None if r_vv is None else -r_vv, x.dtype)
    loop.cg_iterations += fact.iterations
    sd = loop.d.to(x.dtype).sqrt()
    vnorm = float(torch.linalg.vector_norm(sd * v))
    if a is None or vnorm == 0.0:
        loop.reason = "geodesic acceleration could not be computed"
        return None
    ratio = 2.0 * float(torch.linalg.vector_norm(sd * a)) / vnorm
    if ratio > config.geodesic_alpha:
        loop.reason = f"geodesic acceleration too large (2|a|/|v| = {ratio:.3g})"
        return None
    return v + 0.5 * a


def _judge(
    loop: _Loop,
    attempt: int,
    lam: float,
    x_try: Tensor,
    pred: float,
    step_norm: float,
    xnorm_try: float,
    xnorm: float,
    measured: tuple[float, float] | None = None,
) -> Outcome | None:
    """Evaluate the trial point and accept it (gain ratio ρ) or reject it.

    ``measured``: ``(‖D^½δ‖, gᵀδ)`` for a rule that measures the step.
    """
    config, state, loss0 = loop.config, loop.state, loop.loss0
    loss1 = float(loop.problem.loss_sum(x_try))
    if not math.isfinite(loss1):
        loop.reason = "non-finite residuals at the trial point"
        loop.reject()
        return None
    actual = loss0 - loss1
    rho = actual / pred if pred > 0 else -math.inf
    step = None
    if measured is not None:
        step = StepRecord(
            scaled_norm=measured[0], slope=measured[1], actual=actual, loss0=loss0, loss1=loss1
        )
    loop.rho = rho
    accepted = actual > 0 and rho > config.min_gain_ratio
    status, why = convergence(
        config.ftol,
        config.xtol,
        loss0,
        actual,
        pred,
        rho,
        step_norm,
        xnorm_try if accepted else xnorm,
    )
    if accepted:
        loop.rule.accept(state, rho, step)
        state.damping = max(state.damping, config.damping_min)
        return Outcome(
            x=x_try,
            accepted=True,
            loss_sum=loss1,
            loss_sum_before=loss0,
            attempts=attempt,
            status=status,
            reason=why or "step accepted",
            stop=status > 0,
            gain_ratio=rho,
            step_norm=step_norm,
            cg_iterations=loop.cg_iterations,
            matrix_dtype=loop.fact.dtype,
        )
    loop.reject(step)
    if status > 0:
        # MINPACK tests convergence after every attempt: a rejected step that is
        # already below xtol, or whose reductions are below ftol, means the current
        # point is the answer to that precision.  λ stays within its bound, as the
        # loop keeps it after any other rejection.
        state.damping = min(state.damping, config.damping_max)
        return loop.stopped(attempt, status, why)
    loop.reason = f"gain ratio {rho:.3g} too small at damping {lam:.3g}"
    return None
