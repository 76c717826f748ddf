"""The attempt rule of :func:`~secondorder.least_squares`, for a batch of fits at once.

:class:`BatchTrustRegion` makes every decision of one LM attempt for all fits together:
the damping matrix ``D`` (Moré's running column scale), the λ that makes the step
fill the trust region, the gain-ratio test, the radius and λ updates, and scipy's
termination tests.  It is :class:`~secondorder.lm.damping.TrustRegionRule` and the
tests of :func:`~secondorder.lm.engine.iterate`, written with masks: every branch of
those is a ``torch.where`` here, so the same numbers come out fit by fit, and no
decision reads a value on the host (the state is tensors of the batch's shape, ``(B,)``
or 0-d for one fit).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .small_linalg import parameter_major

__all__ = ["BatchTrustRegion", "RuleState", "StepMeasures"]

#: ``z(λ) -> (z, ‖z‖)``: the scaled step ``D^½δ`` at λ and its norm (NaN where it failed).
ScaledSolve = Callable[[Tensor], tuple[Tensor, Tensor]]


@dataclass
class RuleState:
    """λ, the trust radius Δ and their companions, one entry per fit.

    ``nu`` is 1 until the first step shrinks Δ to it (MINPACK's marker), then 2;
    ``started``: whether Δ has been set; ``chosen_norm``: ``‖D^½δ‖`` of the step the
    rule chose (NaN where its solve failed); ``scale``: Moré's running maximum of the
    squared column norms ``(B, n)``, valid where ``scaled``.
    """

    damping: Tensor
    nu: Tensor
    radius: Tensor
    started: Tensor
    chosen_norm: Tensor
    scale: Tensor
    scaled: Tensor

    @classmethod
    def initial(cls, damping: float, like: Tensor) -> RuleState:
        """The state before the first iteration, for points ``like`` of shape ``(*B, n)``."""
        batch = like[..., 0]
        return cls(
            damping=torch.full_like(batch, damping),
            nu=torch.full_like(batch, 2.0),
            radius=torch.zeros_like(batch),
            started=torch.zeros_like(batch, dtype=torch.bool),
            chosen_norm=torch.full_like(batch, math.nan),
            scale=torch.zeros_like(like),
            scaled=torch.zeros_like(batch, dtype=torch.bool),
        )

    def take(self, index: Tensor) -> RuleState:
        """The state of the fits at ``index`` (a 1-D index tensor)."""
        return RuleState(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def put(self, index: Tensor, other: RuleState) -> None:
        """Write ``other`` (one fit per entry of ``index``) into these fits, in place."""
        for f in fields(self):
            getattr(self, f.name)[index] = getattr(other, f.name)


@dataclass(frozen=True)
class StepMeasures:
    """What the rule needs of an evaluated attempt, per fit (as ``StepRecord``).

    ``scaled_norm`` ``‖D^½δ‖``, ``slope`` ``gᵀδ``, ``actual`` ``Σr²(x) - Σr²(x+δ)``,
    ``pred`` the reduction the linear model predicts, ``loss0``/``loss1`` the two sums,
    ``step_norm`` ``‖δ‖`` and ``xnorm`` the norm the xtol test compares it with.
    """

    scaled_norm: Tensor
    slope: Tensor
    actual: Tensor
    pred: Tensor
    loss0: Tensor
    loss1: Tensor
    step_norm: Tensor
    xnorm_before: Tensor
    xnorm_after: Tensor


class BatchTrustRegion:
    """MINPACK's trust region and scipy's tests, for every fit of a batch at once.

    Per fit, exactly :class:`~secondorder.lm.damping.TrustRegionRule` with
    :class:`~secondorder.lm.damping.MoreMatrix` (or the identity, for a fixed
    ``x_scale``) and the acceptance and termination tests of
    :func:`~secondorder.lm.engine.iterate`: λ is chosen so that the step fills the
    radius Δ (the Gauss-Newton step when it fits within 1.1Δ, else regula falsi on
    ``1/‖D^½δ(λ)‖``, at most 10 solves); a step is accepted when its gain ratio
    exceeds ``min_gain_ratio``; Δ then moves with the gain ratio.  Every method takes
    and returns tensors of the batch's shape and never reads one on the host, so a
    step can run inside a CUDA graph.

    Args:
        ftol, xtol, gtol: scipy's tolerances (0 disables one).
        identity: ``D = I`` (a fixed ``x_scale``, applied as a change of variables),
            else Moré's scaling.
        factor: the first radius is ``factor·‖D^½x₀‖`` (10, as least_squares).
    """

    min_gain_ratio = 1e-4
    damping_max = 1e15
    damping_restart = 1e-3
    floor = 1e-9

    def __init__(
        self,
        *,
        ftol: float,
        xtol: float,
        gtol: float,
        identity: bool = False,
        factor: float = 10.0,
    ) -> None:
        self.ftol, self.xtol, self.gtol = float(ftol), float(xtol), float(gtol)
        self.identity = identity
        self.factor = float(factor)

    # ---------------------------------------------------------------- iteration start

    def gtol_reached(self, grad: Tensor, col_sq: Tensor, loss: Tensor) -> Tensor:
        """MINPACK's gtol test: ``max_i |gᵢ| / (‖Jᵢ‖·‖r‖) ≤ gtol`` (0 where ``r = 0``).

        A column with ``‖Jᵢ‖ = 0`` counts 0 where ``gᵢ = 0`` (least squares: always),
        else inf.
        """
        rnorm = loss.clamp(min=0.0).sqrt()
        colnorm = col_sq.sqrt()
        ratio = grad.abs() / (colnorm * rnorm.unsqueeze(-1))
        # A column without curvature can still have a gradient (a Poisson fit whose
        # counts are 0 wherever the parameter acts: k/μ² = 0, 1 - k/μ = 1): not converged.
        idle = torch.where(grad == 0, 0.0, math.inf)
        cos = torch.where(colnorm > 0, ratio, idle).amax(-1)
        cos = torch.where(rnorm > 0, cos, torch.zeros_like(cos))
        return cos <= self.gtol

    def diagonal(self, col_sq: Tensor, state: RuleState, fresh: Tensor) -> Tensor:
        """``D`` for the fits starting an iteration (``fresh``); Moré's scale moves there.

        Moré's ``D`` is the running maximum of the squared column norms, floored at
        ``1e-9·max(D)``; when λ is 0 (the last step was Gauss-Newton) only columns with
        no usable scale of their own are floored.
        """
        if self.identity:
            return torch.ones_like(col_sq)
        first = fresh & ~state.scaled
        grown = torch.where(first.unsqueeze(-1), col_sq, torch.maximum(state.scale, col_sq))
        state.scale = parameter_major(torch.where(fresh.unsqueeze(-1), grown, state.scale))
        state.scaled = state.scaled | fresh
        d = state.scale
        tiny = torch.finfo(d.dtype).tiny
        one = torch.ones_like(d)
        usable = torch.isfinite(d) & (d >= tiny)
        largest = torch.where(usable, d, torch.zeros_like(d)).amax(-1, keepdim=True)
        fill = torch.clamp(largest * self.floor, min=tiny)
        at_min = torch.where(largest > 0, torch.where(usable, d, fill), one)
        top = d.amax(-1, keepdim=True)
        floor = torch.clamp(top * self.floor, min=tiny**0.5)
        ok = torch.isfinite(top) & (top > 0)
        above = torch.where(ok, torch.maximum(d, floor), one)
        return torch.where((state.damping <= 0).unsqueeze(-1), at_min, above)

    # ---------------------------------------------------------------- choosing λ

    def choose(
        self,
        state: RuleState,
        solve: ScaledSolve,
        xs_norm: Tensor,
        gs_norm: Tensor,
        active: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """``(λ, z)`` for the active fits: λ fills the region, ``z = D^½δ(λ)``.

        ``xs_norm`` is ``‖D^½x₀‖`` (read where Δ is not yet set), ``gs_norm``
        ``‖D^-½g‖``.  ``state.damping`` and ``state.chosen_norm`` move where active.
        """
        new = active & ~state.started
        first = torch.where(xs_norm > 0, self.factor * xs_norm, self.factor)
        state.radius = torch.where(new, first, state.radius)
        state.nu = torch.where(new, torch.ones_like(state.nu), state.nu)
        state.started = state.started | active
        radius = state.radius
        _, n0 = solve(torch.zeros_like(radius))
        newton = torch.isfinite(n0) & (n0 <= 1.1 * radius)
        lam = self._fill_region(solve, radius, gs_norm, state.damping)
        lam = torch.where(newton, torch.zeros_like(lam), lam)
        # The step at the chosen λ, solved once more: the same operations on the same
        # numbers as the round that chose it, so the same z, and no z carried per round.
        z, norm = solve(lam)
        state.damping = torch.where(active, lam, state.damping)
        state.chosen_norm = torch.where(active, norm, state.chosen_norm)
        return lam, z

    def _fill_region(
        self, solve: ScaledSolve, radius: Tensor, gnorm: Tensor, guess: Tensor
    ) -> Tensor:
        """λ with ``‖z(λ)‖`` within 10% of Δ: Illinois regula falsi, at most 10 solves.

        ``ψ(λ) = 1/‖z(λ)‖ - 1/Δ`` rises with λ, negative at 0 and not negative at
        ``‖D^-½g‖/Δ``.  As :func:`secondorder.lm.damping._fill_region`, with each fit's
        branches as masks; a fit that has not met the tolerance after 10 solves takes
        the bracket's upper end (a degenerate bracket, its guess).
        """
        inv = 1.0 / radius
        zero = torch.zeros_like(radius)
        lo, psi_lo = zero, -inv
        hi = gnorm / radius
        degenerate = ~(torch.isfinite(hi) & (hi > 0))
        inside = (guess > 0) & (guess < hi)
        lam = torch.where(inside, guess, hi)
        lam = torch.where(degenerate, torch.where(guess > 0, guess, zero + 1.0), lam)
        out_lam = lam
        psi_hi = torch.full_like(radius, math.nan)
        side = zero
        searching = ~degenerate
        for _ in range(10):
            _, norm = solve(lam)
            ok = torch.isfinite(norm)
            hit = searching & ok & ((norm - radius).abs() <= 0.1 * radius)
            out_lam = torch.where(hit, lam, out_lam)
            searching = searching & ~hit
            psi = torch.where(ok & (norm != 0), 1.0 / norm - inv, -inv)
            neg = psi < 0
            halved_hi = torch.where((side == -1) & torch.isfinite(psi_hi), 0.5 * psi_hi, psi_hi)
            halved_lo = torch.where(side == 1, 0.5 * psi_lo, psi_lo)
            lo = torch.where(neg, lam, lo)
            psi_lo = torch.where(neg, psi, halved_lo)
            hi = torch.where(neg, hi, lam)
            psi_hi = torch.where(neg, halved_hi, psi)
            side = torch.where(neg, -1.0, 1.0)
            falsi = torch.isfinite(psi_hi) & (psi_hi > psi_lo)
            secant = lo - psi_lo * (hi - lo) / torch.where(falsi, psi_hi - psi_lo, 1.0)
            fallback = torch.where(lo > 0, 0.5 * (lo + hi), 0.1 * hi)
            nxt = torch.where(falsi, secant, fallback)
            lam = torch.where((lo < nxt) & (nxt < hi), nxt, 0.5 * (lo + hi))
        return torch.where(searching, hi, out_lam)

    # ---------------------------------------------------------------- judging

    def judge(
        self,
        state: RuleState,
        step: StepMeasures,
        evaluated: Tensor,
        active: Tensor,
        xtol_off: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(accepted, status)`` of each active fit's attempt; λ and Δ move.

        ``evaluated``: the solve succeeded and the trial cost is finite; an active fit
        that is not evaluated failed (Δ shrinks tenfold below its chosen step).
        ``status`` is scipy's convergence code of the attempt (2 ftol, 3 xtol, 4 both,
        0 none), whether accepted or not: a rejected attempt below tolerance means the
        current point is the answer to that precision (MINPACK's rule).  ``xtol_off``:
        fits whose xtol test is made elsewhere (on ``x``, under bounds).
        """
        actual, pred = step.actual, step.pred
        rho = torch.where(pred > 0, actual / pred, -math.inf)
        accepted = evaluated & (actual > 0) & (rho > self.min_gain_ratio)
        ftol_hit = (
            (actual.abs() <= self.ftol * step.loss0)
            & (pred <= self.ftol * step.loss0)
            & (rho <= 2.0)
        )
        xnorm = torch.where(accepted, step.xnorm_after, step.xnorm_before)
        xtol = torch.full_like(xnorm, self.xtol)
        if xtol_off is not None:
            xtol = torch.where(xtol_off, 0.0, xtol)
        xtol_hit = step.step_norm <= xtol * (xtol + xnorm)
        status = torch.where(
            ftol_hit & xtol_hit,
            4,
            torch.where(ftol_hit, 2, torch.where(xtol_hit, 3, 0)),
        )
        status = torch.where(evaluated, status, 0)
        self._move(state, torch.where(accepted, rho, -math.inf), step, evaluated, active)
        # After a rejection λ restarts from damping_restart where it was 0 (Gauss-Newton).
        rejected = active & ~accepted
        restart = rejected & (state.damping <= 0)
        state.damping = torch.where(restart, self.damping_restart, state.damping)
        state.damping = state.damping.clamp(min=0.0)
        return accepted, status

    def _move(
        self,
        state: RuleState,
        rho: Tensor,
        step: StepMeasures,
        evaluated: Tensor,
        active: Tensor,
    ) -> None:
        """Δ and λ after an attempt (``TrustRegionRule._move``), masked per fit."""
        failed = active & ~evaluated
        # A failed attempt: shrink below the step that failed, so the next one differs.
        shrunk = torch.where(
            state.chosen_norm > 0, torch.minimum(state.radius, state.chosen_norm), state.radius
        )
        fail_radius = 0.1 * shrunk
        fail_damping = 10.0 * state.damping
        judged = active & evaluated
        pnorm = step.scaled_norm
        marker = judged & (state.nu == 1.0)
        radius = torch.where(marker, torch.minimum(state.radius, pnorm), state.radius)
        nu = torch.where(marker, torch.full_like(state.nu, 2.0), state.nu)
        denom = step.slope + 0.5 * step.actual
        safe = torch.where(denom < 0, denom, denom - 1.0)
        mu = torch.where(step.actual < 0, torch.where(denom < 0, 0.5 * step.slope / safe, 0.1), 0.5)
        mu = torch.where((step.loss1 >= 100.0 * step.loss0) | ~(mu >= 0.1), 0.1, mu)
        poor = rho <= 0.25
        good = ~poor & ((state.damping == 0.0) | (rho >= 0.75))
        radius = torch.where(
            poor, mu * torch.minimum(radius, pnorm / 0.1), torch.where(good, pnorm / 0.5, radius)
        )
        damping = torch.where(
            poor, state.damping / mu, torch.where(good, state.damping * 0.5, state.damping)
        )
        state.radius = torch.where(failed, fail_radius, torch.where(judged, radius, state.radius))
        state.damping = torch.where(
            failed, fail_damping, torch.where(judged, damping, state.damping)
        )
        state.nu = torch.where(judged, nu, state.nu)
