"""One LM attempt for every unfinished fit of a batch, without a host read.

:func:`start` evaluates and linearises every fit at its starting point; each
:func:`step` then runs one attempt per unfinished fit, as one attempt of
:func:`~secondorder.lm.engine.iterate` inside :func:`~secondorder.least_squares`'s
loop: at the start of an iteration the evaluation budget and the gtol test, then λ
from the trust region, the trial point, the gain ratio, and, after an accepted step,
the linearisation at the new point.  Fits that finished keep their values (every
update is a ``torch.where`` on the ``done`` mask), so one fit never changes another,
and the host decides when to stop by reading ``done`` (the driver, every few steps).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .problem import BatchProblem, Linearization
from .rule import BatchTrustRegion, RuleState, StepMeasures
from .small_linalg import norm2, quadratic, solve_columns
from .small_linalg import parameter_major as pm

__all__ = ["AT_ZERO", "NOT_FINITE", "OWN_MESSAGES", "BatchState", "start", "step", "waiting"]

#: Status of a fit whose residuals, cost or Jacobian stopped being finite.
NOT_FINITE = -1
#: Status of a Poisson fit that stopped on ftol/xtol after attempts refused for a model
#: ``μ ≤ 0`` (where the deviance is undefined): pressed against ``μ = 0``, not shown
#: converged (unless its deviance is within ftol of 0, its lower bound).
AT_ZERO = -3
#: A stop counts as against μ = 0 when a trial was refused for ``μ ≤ 0`` in its
#: iteration or in one of this many before it (the radius those refusals shrank is
#: carried into the next iterations; in float32 the last one often has no refusal).
WALL_ITERATIONS = 2
#: The sentences of the statuses the batch gives of its own (scipy's are in ``MESSAGES``).
OWN_MESSAGES = {
    NOT_FINITE: "The residuals, cost or Jacobian are not finite (NaN or inf in the data, the "
    "start or the model's values).",
    AT_ZERO: "The Poisson fit stopped against μ = 0: its last steps were refused because the "
    "model went below zero (or to zero at a nonzero count), so it may end short of the "
    "optimum; bound the parameters that can take μ there (a background: lb = 0) so that the "
    "model stays ≥ 0.",
}
#: The dtype of the per-fit counts and status while fits run (int64 in the results):
#: half the width of int64 in a compiled step's vector lanes.
COUNT = torch.int32


@dataclass
class BatchState:
    """Everything a batch of fits carries between attempts, one row per fit.

    ``y`` ``(B, n)`` the point in the bounds' free variable with residuals ``f`` and
    ``2·cost`` ``cost2``; the linearisation there (``A`` ``(n, n, B)``, ``g``, ``col``,
    ``dcol``); this iteration's ``sqrt_d = D^½``, ``‖D^½x‖`` and ``‖D^-½g‖``; the rule's
    state; scipy's ``status``, ``nfev``, ``nit``; and the iteration's bookkeeping
    (``fresh``: an iteration starts at the next step; ``attempts`` and the evaluations
    at and left at its start; ``last_try``, the last point evaluated; ``wall_at``, the
    iteration (``nit``) of the last trial refused for a Poisson model ``μ ≤ 0``, or -1).
    ``new``: fits placed at their start ``y`` and not yet evaluated (see :func:`waiting`); the next
    step evaluates and linearises them there, as :func:`start` does, and attempts
    nothing (with ``restart``, it also resets the rest of their state).  In a compiled
    step the ``(B, k)`` fields are stored column by column (``parameter_major``).
    """

    y: Tensor
    f: Tensor
    cost2: Tensor
    A: Tensor
    g: Tensor
    col: Tensor
    dcol: Tensor
    sqrt_d: Tensor
    xs_norm: Tensor
    gs_norm: Tensor
    rule: RuleState
    fresh: Tensor
    done: Tensor
    status: Tensor
    nfev: Tensor
    nit: Tensor
    njev: Tensor
    attempts: Tensor
    nfev_start: Tensor
    left_start: Tensor
    last_try: Tensor
    wall_at: Tensor
    new: Tensor

    def take(self, index: Tensor) -> BatchState:
        """The state of the fits at ``index`` (a 1-D index tensor)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "rule":
                out[f.name] = value.take(index)
            elif f.name == "A":
                out[f.name] = value[..., index]
            else:
                out[f.name] = value[index]
        return BatchState(**out)

    def put(self, index: Tensor, other: BatchState) -> None:
        """Write ``other`` (one fit per entry of ``index``) into these fits, in place."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "rule":
                value.put(index, other.rule)
            elif f.name == "A":
                value[..., index] = other.A
            else:
                value[index] = getattr(other, f.name)


def _set(state: BatchState, lin: Linearization, where: Tensor | None = None) -> None:
    """Store ``lin`` as the state's linearisation (where ``where``, if given)."""
    if where is None:
        state.A, state.g, state.col, state.dcol = lin.A, lin.g, lin.col, lin.dcol
        return
    w = where.unsqueeze(-1)
    state.A = torch.where(where, lin.A, state.A)
    state.g = pm(torch.where(w, lin.g, state.g))
    state.col = pm(torch.where(w, lin.col, state.col))
    state.dcol = pm(torch.where(w, lin.dcol, state.dcol))


def start(problem: BatchProblem, y0: Tensor, damping: float) -> BatchState:
    """Evaluate and linearise every fit at ``y0``; a fit not finite there is done (-1)."""
    f = problem.residuals(y0)
    cost2 = problem.objective.cost2(f, problem.counts)
    lin = problem.linearize(y0, f, cost2)
    b = y0.shape[0]
    ints = torch.zeros(b, dtype=COUNT, device=y0.device)
    batch = torch.zeros_like(cost2)
    state = BatchState(
        y=y0,
        f=f,
        cost2=cost2,
        A=lin.A,
        g=lin.g,
        col=lin.col,
        dcol=lin.dcol.clone(),
        sqrt_d=torch.ones_like(y0),
        xs_norm=batch,
        gs_norm=batch.clone(),
        rule=RuleState.initial(damping, y0),
        fresh=torch.ones(b, dtype=torch.bool, device=y0.device),
        done=~lin.finite,
        status=torch.where(lin.finite, 0, NOT_FINITE).to(COUNT),
        nfev=ints + 1,
        nit=ints,
        njev=ints + 1,
        attempts=ints.clone(),
        nfev_start=ints.clone(),
        left_start=ints.clone(),
        last_try=y0.clone(),
        wall_at=ints - 1,
        new=torch.zeros(b, dtype=torch.bool, device=y0.device),
    )
    # No two fields share a tensor: a compiled step is specialised to its inputs'
    # aliasing, and the fields it returns are always distinct.
    return state


def waiting(y0: Tensor, m: int, damping: float) -> BatchState:
    """Fits at their starts ``y0``, to be evaluated by the next :func:`step`.

    What :func:`start` would give, before its evaluation: one evaluation and one
    Jacobian counted, the rule's initial state, and ``new`` set, so the step that
    follows evaluates and linearises them at ``y0`` (its own model call and Jacobian,
    which it makes for every fit anyway) instead of attempting a step.
    """
    b, n = y0.shape
    ints = torch.zeros(b, dtype=COUNT, device=y0.device)
    zeros = torch.zeros(b, dtype=y0.dtype, device=y0.device)
    flags = torch.zeros(b, dtype=torch.bool, device=y0.device)
    return BatchState(
        y=y0.clone(),
        f=y0.new_zeros(b, m),
        cost2=zeros.clone(),
        A=y0.new_zeros(n, n, b),
        g=torch.zeros_like(y0),
        col=torch.zeros_like(y0),
        dcol=torch.zeros_like(y0),
        sqrt_d=torch.ones_like(y0),
        xs_norm=zeros.clone(),
        gs_norm=zeros.clone(),
        rule=RuleState.initial(damping, y0),
        fresh=~flags,
        done=flags.clone(),
        status=ints.clone(),
        nfev=ints + 1,
        nit=ints.clone(),
        njev=ints + 1,
        attempts=ints.clone(),
        nfev_start=ints.clone(),
        left_start=ints.clone(),
        last_try=y0.clone(),
        wall_at=ints - 1,
        new=~flags,
    )


def step(
    state: BatchState,
    problem: BatchProblem,
    rule: BatchTrustRegion,
    *,
    budget: int,
    xtol_in_x: float = 0.0,
    restart: float | None = None,
) -> None:
    """One attempt for every unfinished fit; ``state`` is updated in place, no host read.

    ``budget``: evaluations allowed per fit (``max_nfev``).  ``xtol_in_x``: with
    bounds, the xtol test on ``x`` itself (trf's), for the fits with a bound; the rule's
    own xtol test is then off for them, as in least_squares.  ``restart``: the first λ
    of a fit put in a used slot; given, every ``new`` fit also gets the rest of what
    :func:`waiting` gives (its counts, the rule's state), so refilling a slot only
    writes its start ``y`` and ``new``.
    """
    transform = problem.transform
    new = state.new
    active = ~state.done & ~new
    # -- the start of an iteration: the budget, then gtol, then D and the norms.
    fresh = active & state.fresh
    left = budget - state.nfev
    spent = fresh & (left <= 0)
    gtol = fresh & ~spent & rule.gtol_reached(state.g, state.col, state.cost2)
    state.status = torch.where(spent, 0, torch.where(gtol, 1, state.status))
    state.done = state.done | spent | gtol
    fresh = fresh & ~spent & ~gtol
    active = ~state.done & ~new
    d = rule.diagonal(state.dcol, state.rule, fresh)
    sqrt_d = torch.where(fresh.unsqueeze(-1), d.sqrt(), state.sqrt_d)
    size = transform.start_size(state.y) if transform.bounded else state.y
    size = torch.where(state.rule.started.unsqueeze(-1), state.y, size)
    state.xs_norm = torch.where(fresh, norm2(sqrt_d * size, dim=-1), state.xs_norm)
    state.gs_norm = torch.where(fresh, norm2(state.g / sqrt_d, dim=-1), state.gs_norm)
    state.sqrt_d = pm(sqrt_d)
    state.attempts = torch.where(fresh, 0, state.attempts)
    state.nfev_start = torch.where(fresh, state.nfev, state.nfev_start)
    state.left_start = torch.where(fresh, left, state.left_start)
    state.fresh = state.fresh & ~active
    # -- λ and the step, in the scaled variable z = D^½δ.
    # Parameter-major (n, B): the batch is the contiguous axis of every solve.
    sd = sqrt_d.T.contiguous()
    As = (state.A / (sd.unsqueeze(0) * sd.unsqueeze(1))).contiguous()
    minus_gs = -(state.g.T.contiguous() / sd)

    def solve(lam: Tensor) -> tuple[Tensor, Tensor]:
        z = solve_columns(As, lam, minus_gs)
        return z, norm2(z, dim=0)

    _, z = rule.choose(state.rule, solve, state.xs_norm, state.gs_norm, active)
    delta = z.T / sqrt_d
    solved = torch.isfinite(delta).all(-1)
    state.attempts = state.attempts + active.to(state.attempts.dtype)
    go = active & solved
    delta = torch.where(go.unsqueeze(-1), delta, torch.zeros_like(delta))
    y_try = torch.where(new.unsqueeze(-1), state.y, state.y + delta)
    f_try = problem.residuals(y_try)
    c_try = problem.objective.cost2(f_try, problem.counts)
    # least_squares evaluates a point once: a trial equal to the last one tried (the
    # same Gauss-Newton step after a rejection) or to the current point costs no call.
    repeat = (y_try == state.last_try).all(-1) | (delta == 0).all(-1)
    state.last_try = pm(torch.where(go.unsqueeze(-1), y_try, state.last_try))
    state.nfev = state.nfev + (go & ~repeat).to(state.nfev.dtype)
    evaluated = go & torch.isfinite(c_try)
    # A Poisson trial refused because its model left the deviance's domain (μ < 0, or
    # μ = 0 at a count): its iteration is recorded, and a stop on ftol/xtol within
    # WALL_ITERATIONS of it is the trust region shrunk against μ = 0, not convergence.
    wall_at = torch.where(new, -1, state.wall_at)
    if problem.counts is not None:
        outside = ((f_try < 0) | ((f_try == 0) & (problem.counts > 0))).any(-1)
        wall_at = torch.where(go & ~evaluated & outside, state.nit, wall_at)
    state.wall_at = wall_at
    slope = (state.g * delta).sum(-1)
    measures = StepMeasures(
        scaled_norm=norm2(sqrt_d * delta, dim=-1),
        slope=slope,
        actual=state.cost2 - c_try,
        pred=-2.0 * slope - quadratic(state.A, delta.T),
        loss0=state.cost2,
        loss1=c_try,
        step_norm=norm2(delta, dim=-1),
        xnorm_before=norm2(state.y, dim=-1),
        xnorm_after=norm2(y_try, dim=-1),
    )
    xtol_off = None
    if xtol_in_x > 0:
        xtol_off = (transform.lo | transform.hi).any(-1)
    accepted, conv = rule.judge(state.rule, measures, evaluated, active, xtol_off=xtol_off)
    conv = conv.to(COUNT)
    # -- how the attempt ends the iteration, if it does.
    rejected = active & ~accepted
    stop_conv = rejected & (conv > 0)
    going = rejected & ~stop_conv
    capped = going & (state.rule.damping > rule.damping_max)
    state.rule.damping = torch.where(capped, rule.damping_max, state.rule.damping)
    exhausted = going & ~capped & (state.attempts >= state.left_start)
    ended = capped | exhausted
    # λ at its maximum with evaluations left: steps are as short as arithmetic allows.
    end_status = torch.where(state.nfev - state.nfev_start < state.left_start, 3, 0).to(COUNT)
    # -- an accepted step moves, and is linearised; so is a new fit, at its start.
    y_old = state.y
    moved = accepted | new
    acc = moved.unsqueeze(-1)
    state.y = pm(torch.where(acc, y_try, state.y))
    state.f = pm(torch.where(acc, f_try, state.f))
    state.cost2 = torch.where(moved, c_try, state.cost2)
    if xtol_off is not None:
        unit = 1.0 if transform.scale is None else transform.scale
        x_new = transform.to_x(state.y) / unit
        dx = norm2(x_new - transform.to_x(y_old) / unit, dim=-1)
        near = dx <= xtol_in_x * (xtol_in_x + norm2(x_new, dim=-1))
        hit = accepted & xtol_off & ((conv == 0) | (conv == 2)) & near
        conv = torch.where(hit, torch.where(conv == 2, 4, 3), conv)
    lin = problem.linearize(state.y, state.f, state.cost2)
    _set(state, lin, moved)
    bad = accepted & ~lin.finite
    status_acc = torch.where(bad, NOT_FINITE, conv)
    status = torch.where(
        stop_conv,
        conv,
        torch.where(ended, end_status, torch.where(accepted, status_acc, state.status)),
    )
    if problem.counts is not None:
        stops = stop_conv | ended | (accepted & (status_acc != 0))
        walled = (wall_at >= 0) & (state.nit - wall_at <= WALL_ITERATIONS)
        # The deviance is never below 0: within ftol of 0 (in counts), the fit is at
        # its optimum even against μ = 0 (no counts where μ is 0: the rate 0).
        walled = walled & ~(state.cost2 <= rule.ftol)
        status = torch.where(stops & walled & (status >= 2), AT_ZERO, status)
    state.status = torch.where(new, torch.where(lin.finite, 0, NOT_FINITE), status).to(COUNT)
    done = state.done | stop_conv | ended | (accepted & (status_acc != 0))
    state.done = torch.where(new, ~lin.finite, done)
    counted = (stop_conv | ended | accepted).to(state.nit.dtype)
    state.nit = state.nit + counted
    state.njev = state.njev + accepted.to(state.njev.dtype)
    state.fresh = state.fresh | (accepted & ~state.done)
    if restart is not None:
        _restart(state, new, restart)
    state.new = new & False


def _restart(state: BatchState, new: Tensor, damping: float) -> None:
    """What :func:`waiting` gives a fit, besides ``y`` and what the step just set."""
    w = new.unsqueeze(-1)
    first = RuleState.initial(damping, state.y)
    rule = state.rule
    rule.damping = torch.where(new, first.damping, rule.damping)
    rule.nu = torch.where(new, first.nu, rule.nu)
    rule.radius = torch.where(new, first.radius, rule.radius)
    rule.started = rule.started & ~new
    rule.chosen_norm = torch.where(new, first.chosen_norm, rule.chosen_norm)
    rule.scale = pm(torch.where(w, first.scale, rule.scale))
    rule.scaled = rule.scaled & ~new
    state.sqrt_d = pm(torch.where(w, 1.0, state.sqrt_d))
    state.xs_norm = torch.where(new, 0.0, state.xs_norm)
    state.gs_norm = torch.where(new, 0.0, state.gs_norm)
    state.fresh = state.fresh | new
    one, zero = torch.ones_like(state.nfev), torch.zeros_like(state.nfev)
    state.nfev = torch.where(new, one, state.nfev)
    state.njev = torch.where(new, one, state.njev)
    state.nit = torch.where(new, zero, state.nit)
    state.attempts = torch.where(new, zero, state.attempts)
    state.nfev_start = torch.where(new, zero, state.nfev_start)
    state.left_start = torch.where(new, zero, state.left_start)
    state.last_try = pm(torch.where(w, state.y, state.last_try))
