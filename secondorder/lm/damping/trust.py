"""MINPACK's trust region: λ solved for so that the step fills a radius Δ."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..._validation import check_number
from .state import DampingRule, DampingState, StepRecord

__all__ = ["TrustRegionRule"]


class TrustRegionRule(DampingRule):
    """MINPACK's trust region (Moré 1978): λ follows a radius Δ on ``‖D^½δ‖``.

    Before each attempt λ is solved for, so that the step fills the region: λ = 0 (the
    Gauss-Newton step) when ``‖D^½δ(0)‖ ≤ 1.1Δ``, else a λ with ``|‖D^½δ(λ)‖ - Δ| ≤
    0.1Δ`` (regula falsi on ``1/‖D^½δ(λ)‖``, nearly linear in λ).  After the attempt Δ
    moves with the gain ratio ρ:

    - ρ ≤ ¼: ``Δ ← μ·min(Δ, 10‖D^½δ‖)``, with μ ∈ [0.1, ½] the minimiser of the
      quadratic through the loss and its slope along δ (½ when the loss fell);
    - ρ ≥ ¾, or a Gauss-Newton step: ``Δ ← 2‖D^½δ‖``.

    It starts from ``Δ = factor·‖D^½x₀‖`` and, after the first step, ``Δ ≤ ‖D^½δ₀‖``.
    MINPACK's default factor is 100; 10 is used here: with 100 the first Gauss-Newton
    step of NIST's BoxBOD (start 1) carries the rate constant from 1 to 112, where the
    exponential has saturated, its Jacobian column vanishes and the fit ends on that
    plateau (as MINPACK's does); with 10 it reaches the certified values, and MGH10
    needs 285 evaluations instead of 367 (MINPACK: 295).  A factor of 1 costs MGH's
    Powell badly scaled problem 150 evaluations instead of 16: a region too small for
    its curved valley.
    Unlike a rule on λ alone, the region is measured in parameter space, so a jump of
    the scale ``D`` (Moré's running maximum after a visit to a steep region) does not
    freeze the step length: Nielsen's rule then keeps λ and the steps shrink by the
    jump.  Choose it for curve fitting with badly scaled parameters (MGH10, NIST's
    higher-difficulty problems); each attempt costs a few solves with the iteration's
    factorisation (the QR of the small stacked matrix), so it suits small n.
    """

    name = "trust"
    chooses = True

    def __init__(self, factor: float = 10.0) -> None:
        check_number("factor", factor, above=0, type_error=False)
        self.factor = float(factor)

    def choose(  # noqa: D102
        self,
        state: DampingState,
        scaled_norm: Callable[[float], float | None],
        scaled_xnorm: float,
        scaled_gnorm: float,
    ) -> float:
        if state.radius is None:
            state.radius = self.factor * scaled_xnorm if scaled_xnorm > 0 else self.factor
            # ν = 1 marks the first step, after which Δ shrinks to the step (MINPACK).
            state.nu = 1.0
        radius = state.radius
        gauss_newton = scaled_norm(0.0)
        if gauss_newton is not None and gauss_newton <= 1.1 * radius:
            state.damping, state.chosen_norm = 0.0, gauss_newton
            return 0.0
        state.damping, state.chosen_norm = _fill_region(
            scaled_norm, radius, scaled_gnorm, state.damping
        )
        return state.damping

    def accept(  # noqa: D102
        self, state: DampingState, rho: float, step: StepRecord | None = None
    ) -> None:
        self._move(state, rho, step)

    def reject(self, state: DampingState, step: StepRecord | None = None) -> None:  # noqa: D102
        self._move(state, -math.inf, step)

    def _move(self, state: DampingState, rho: float, step: StepRecord | None) -> None:
        if state.radius is None:
            return
        if step is None:
            # A failed attempt (solve, non-finite residuals, geodesic acceleration too
            # large): shrink below the step that failed, so the next one differs.
            if state.chosen_norm is not None and state.chosen_norm > 0.0:
                state.radius = min(state.radius, state.chosen_norm)
            state.radius *= 0.1
            state.damping *= 10.0
            return
        pnorm = step.scaled_norm
        if state.nu == 1.0:
            state.radius = min(state.radius, pnorm)
            state.nu = 2.0
        if rho <= 0.25:
            mu = 0.5
            if step.actual < 0:
                # Minimiser of the quadratic with the loss's value and slope at x and
                # its value at x + δ, in units of δ: ½·s / (s + ½·actual), s = gᵀδ.
                denom = step.slope + 0.5 * step.actual
                mu = 0.5 * step.slope / denom if denom < 0 else 0.1
            if step.loss1 >= 100.0 * step.loss0 or not mu >= 0.1:
                mu = 0.1
            state.radius = mu * min(state.radius, pnorm / 0.1)
            state.damping /= mu
        elif state.damping == 0.0 or rho >= 0.75:
            state.radius = pnorm / 0.5
            state.damping *= 0.5


def _fill_region(
    scaled_norm: Callable[[float], float | None], radius: float, gnorm: float, guess: float
) -> tuple[float, float | None]:
    """``(λ, ‖D^½δ(λ)‖)`` with the norm within 10% of ``radius`` (at most 10 solves).

    ``ψ(λ) = 1/‖D^½δ(λ)‖ - 1/Δ`` increases with λ; it is negative at 0 (the
    Gauss-Newton step is longer than Δ, or does not exist) and not negative at
    ``‖D^-½g‖/Δ``, which bounds the step.  Regula falsi (the Illinois variant) on that
    bracket, started from the previous λ; if it has not converged after 10 solves, the
    upper end of the bracket (a step inside the region).
    """
    inv = 1.0 / radius
    lo, psi_lo = 0.0, -inv
    hi = gnorm / radius
    if not (math.isfinite(hi) and hi > 0.0):
        lam = guess if guess > 0.0 else 1.0
        return lam, scaled_norm(lam)
    psi_hi, hi_norm = math.nan, None
    lam = guess if lo < guess < hi else hi
    side = 0
    for _ in range(10):
        norm = scaled_norm(lam)
        if norm is not None and abs(norm - radius) <= 0.1 * radius:
            return lam, norm
        psi = -inv if norm is None or norm == 0.0 else 1.0 / norm - inv
        if psi < 0.0:
            lo, psi_lo = lam, psi
            if side == -1 and math.isfinite(psi_hi):
                psi_hi *= 0.5
            side = -1
        else:
            hi, psi_hi, hi_norm = lam, psi, norm
            if side == 1:
                psi_lo *= 0.5
            side = 1
        if math.isfinite(psi_hi) and psi_hi > psi_lo:
            lam = lo - psi_lo * (hi - lo) / (psi_hi - psi_lo)
        else:
            lam = 0.5 * (lo + hi) if lo > 0.0 else 0.1 * hi
        if not lo < lam < hi:
            lam = 0.5 * (lo + hi)
    if hi_norm is None:
        hi_norm = scaled_norm(hi)
    return hi, hi_norm
