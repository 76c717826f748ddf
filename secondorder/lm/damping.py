"""Damping: how λ moves between attempts, and the matrix ``D`` it multiplies.

The damped normal equations are ``(JᵀJ + λD) δ = -Jᵀr``.  Large λ gives a short step
along the scaled gradient ``-D⁻¹Jᵀr``; small λ gives the Gauss-Newton step.  A *rule*
decides how λ changes after an attempt, from the gain ratio

    ρ = (actual reduction of ½‖r‖²) / (reduction predicted by the linear model),

and a *damping matrix* decides the shape of the trust region.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._validation import check_choice, check_number

__all__ = [
    "DAMPING_MATRICES",
    "DAMPING_RULES",
    "FITTING_DAMPING_RULES",
    "NIELSEN_SHRINK",
    "DampingMatrix",
    "DampingRule",
    "DampingState",
    "IdentityMatrix",
    "MarquardtMatrix",
    "MoreMatrix",
    "MultiplicativeRule",
    "NielsenRule",
    "StepRecord",
    "TrustRegionRule",
    "check_damping_factors",
    "check_damping_shrink",
    "make_damping_matrix",
    "make_damping_rule",
    "raise_damping",
]


@dataclass
class DampingState:
    """The mutable part of damping: λ, Nielsen's growth factor ν, Moré's running scale.

    ``radius`` is the trust radius Δ of :class:`TrustRegionRule` (``None`` until its
    first iteration sets it), in the damping matrix's norm ``‖D^½δ‖``, and
    ``chosen_norm`` that norm of the last step it chose.
    """

    damping: float
    nu: float = 2.0
    scale: Tensor | None = None
    radius: float | None = None
    chosen_norm: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """What a trust-region rule needs to know about an evaluated attempt.

    ``scaled_norm`` is ``‖D^½δ‖``, ``slope`` is ``gᵀδ`` (half the derivative of
    ``Σr²`` along δ), ``actual`` the reduction ``Σr²(x) - Σr²(x + δ)``, and
    ``loss0`` and ``loss1`` the two sums of squares.
    """

    scaled_norm: float
    slope: float
    actual: float
    loss0: float
    loss1: float


class DampingRule:
    """Base class: update λ after an accepted or a rejected attempt."""

    name = ""
    #: Whether the rule picks λ itself before each attempt (:meth:`choose`).
    chooses = False

    def accept(self, state: DampingState, rho: float, step: StepRecord | None = None) -> None:
        """Update ``state`` after an attempt with gain ratio ``rho`` was accepted."""
        raise NotImplementedError

    def reject(self, state: DampingState, step: StepRecord | None = None) -> None:
        """Update ``state`` after an attempt was rejected (``step`` is ``None`` when it failed).

        A failed attempt (a failed solve, non-finite residuals) has no ``step``.
        """
        raise NotImplementedError

    def choose(
        self,
        state: DampingState,
        scaled_norm: Callable[[float], float | None],
        scaled_xnorm: float,
        scaled_gnorm: float,
    ) -> float:
        """λ for the next attempt, given ``λ ↦ ‖D^½δ(λ)‖`` (``None`` where the solve fails).

        ``scaled_xnorm`` is ``‖D^½x‖`` and ``scaled_gnorm`` is ``‖D^-½Jᵀr‖``.  Called
        only when :attr:`chooses` is true; the other rules move λ in :meth:`accept` and
        :meth:`reject` alone.
        """
        return state.damping


#: Nielsen's largest decrease of λ per accepted step (``damping_shrink``'s default).
NIELSEN_SHRINK = 3.0


class NielsenRule(DampingRule):
    """Nielsen's gain-ratio rule (Nielsen 1999; Madsen, Nielsen & Tingleff 2004).

    On success ``λ ← λ·max(1/s, 1 - (2ρ - 1)³)`` and ``ν ← 2``: a step that matched
    its model well (ρ near 1) shrinks λ by up to ``s``-fold (``shrink``, Nielsen's 3),
    a barely useful one leaves it almost unchanged.  On failure ``λ ← λ·ν`` and
    ``ν ← 2ν``, so consecutive failures raise λ ever faster.  Smooth in ρ, it avoids
    the oscillation of fixed factors.  A larger ``shrink`` lets λ fall faster while
    the linear model keeps predicting the loss (ρ above ~0.87, where
    ``1 - (2ρ - 1)³ < 1/3``): the end of a fit, where Gauss-Newton converges fast.
    """

    name = "nielsen"

    def __init__(self, shrink: float = NIELSEN_SHRINK) -> None:
        check_damping_shrink(shrink)
        self.shrink = float(shrink)
        self._floor = 1.0 / self.shrink

    def accept(  # noqa: D102
        self, state: DampingState, rho: float, step: StepRecord | None = None
    ) -> None:
        state.damping *= max(self._floor, 1.0 - (2.0 * rho - 1.0) ** 3)
        state.nu = 2.0

    def reject(self, state: DampingState, step: StepRecord | None = None) -> None:  # noqa: D102
        state.damping *= state.nu
        state.nu *= 2.0


class MultiplicativeRule(DampingRule):
    """Fixed factors: ``λ ← λ·down`` on success, ``λ ← λ·up`` on failure (cuPyLMA's rule)."""

    name = "multiplicative"

    def __init__(self, up: float = 10.0, down: float = 0.1) -> None:
        check_damping_factors(up, down)
        self.up = float(up)
        self.down = float(down)

    def accept(  # noqa: D102
        self, state: DampingState, rho: float, step: StepRecord | None = None
    ) -> None:
        state.damping *= self.down

    def reject(self, state: DampingState, step: StepRecord | None = None) -> None:  # noqa: D102
        state.damping *= self.up


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


DAMPING_RULES = ("nielsen", "multiplicative")
#: The rules :func:`~secondorder.fitting.least_squares` accepts: the trust region too, whose
#: radius the model optimizer's checkpoints do not carry.
FITTING_DAMPING_RULES = (*DAMPING_RULES, "trust")


def check_damping_factors(up: object, down: object) -> None:
    """The multiplicative rule's factors: ``up`` a finite number > 1, ``down`` in (0, 1)."""
    check_number("damping_up", up, above=1, type_error=False)
    if not (isinstance(down, (int, float)) and not isinstance(down, bool) and 0 < down < 1):
        raise ValueError(f"Invalid damping_down={down!r}: must be in (0, 1).")


def check_damping_shrink(shrink: object) -> None:
    """Nielsen's largest decrease of λ per accepted step: a finite number > 1."""
    if not (
        isinstance(shrink, (int, float))
        and not isinstance(shrink, bool)
        and math.isfinite(shrink)
        and shrink > 1
    ):
        raise ValueError(
            f"Invalid damping_shrink={shrink!r}: must be a finite number > 1 (the largest "
            "factor by which Nielsen's rule lowers λ after one accepted step; Nielsen's is 3)."
        )


def make_damping_rule(
    name: str, up: float = 10.0, down: float = 0.1, shrink: float = NIELSEN_SHRINK
) -> DampingRule:
    """Build the damping rule called ``name`` (one of :data:`DAMPING_RULES`).

    ``up`` and ``down`` are the multiplicative rule's factors, ``shrink`` Nielsen's
    largest decrease per accepted step.
    """
    if name == "nielsen":
        return NielsenRule(shrink)
    if name == "multiplicative":
        return MultiplicativeRule(up, down)
    if name == "trust":
        return TrustRegionRule()
    check_choice("damping_rule", name, FITTING_DAMPING_RULES)
    raise AssertionError(name)  # pragma: no cover - check_choice raised


def raise_damping(
    rule: DampingRule,
    state: DampingState,
    *,
    damping_min: float,
    damping_max: float | None = None,
    restart: float | None = None,
    step: StepRecord | None = None,
) -> None:
    """Raise λ after a failed attempt: the rule's ``reject``, then the bounds.

    The one λ-after-failure rule of the package.  Its callers differ on purpose:

    - ``restart``: the λ to restart from when the rule left λ at zero (a rejected
      pure Gauss-Newton attempt; multiplying zero would leave it at zero for ever).
      The attempt loop (:func:`secondorder.lm.engine.iterate`) passes its
      ``damping_restart``; the optimizer's non-finite linearisation passes ``None``,
      and λ = 0 then rises only to ``damping_min``.
    - ``damping_max``: clamp λ to it here; ``None`` leaves λ above the maximum for a
      caller that ends the iteration when it gets there.

    - ``step``: the evaluated attempt, for a rule that measures it (``None``: it failed
      before its trial point could be judged).

    Then ``λ ← max(λ, damping_min)`` and, with ``damping_max``, ``λ ← min(λ, damping_max)``.
    """
    rule.reject(state, step)
    if restart is not None and state.damping <= 0.0:
        state.damping = restart
    state.damping = max(state.damping, damping_min)
    if damping_max is not None:
        state.damping = min(state.damping, damping_max)


class DampingMatrix:
    """Base class: the diagonal ``D`` of the damping term, from the column norms of J.

    Every matrix has a floor, ``d ≥ floor·max(d)`` (and a tiny absolute floor), so a
    zero column of J (a dead unit, an unused parameter) still gets positive damping and
    ``JᵀJ + λD`` stays positive definite for every λ > 0.  Without it, Marquardt's
    ``diag(JᵀJ)`` leaves such a system singular whatever λ is, and LM stalls.  The
    floor also bounds how far a parameter with a tiny but nonzero column may move
    while the linear model is not yet trusted (a saturated unit of a network).

    Once λ has fallen to ``damping_min``, the linear model has predicted every recent
    step and λ can fall no further; the floor, ``λ·floor·max(d)``, would then be the
    only damping left on a column with ``‖J_j‖² < λ·floor·max(d)``, and LM would crawl
    along it (a column-scaled problem with cond(J) = 1e12 gains ~1% per step).  So at
    ``damping_min`` only zero, subnormal and non-finite columns are floored, and every
    other column is damped by its own curvature: with ``D = diag(JᵀJ)`` the damped
    system is ``S(C + λI)S`` with ``S = D^½`` and ``C`` the correlation matrix of J's
    columns: up to a diagonal scaling, as well conditioned as ``C + λI`` whatever the
    column scales.
    """

    name = ""
    #: Whether ``D`` is always a multiple of the identity (known without reading it).
    uniform = False

    def __init__(self, floor: float = 1e-9) -> None:
        self.floor = floor

    def diagonal(self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0) -> Tensor:
        """Return ``D`` (a positive vector) for squared column norms ``col_sq``.

        ``damping_min`` is the lower bound of λ; at it only unusable columns are floored.
        """
        raise NotImplementedError

    def _floored(self, d: Tensor, state: DampingState, damping_min: float) -> Tensor:
        # Computed on the device (no host read): floors in float64, as Python would,
        # then rounded to d's dtype; D = I when no column is usable.
        if _small_host(d):
            return torch.from_numpy(self._floored_host(d.numpy(), state, damping_min))
        if state.damping <= damping_min:
            # Floor only the columns that carry no scale of their own.
            if d.numel() == 0:
                return torch.ones_like(d)
            tiny = torch.finfo(d.dtype).tiny
            usable = torch.isfinite(d) & (d >= tiny)
            largest = torch.where(usable, d, torch.zeros_like(d)).max().to(torch.float64)
            fill = torch.clamp(largest * self.floor, min=tiny).to(d.dtype)
            return torch.where(largest > 0.0, torch.where(usable, d, fill), torch.ones_like(d))
        top = d.max().to(torch.float64)
        tiny = torch.finfo(d.dtype).tiny ** 0.5
        floor = torch.clamp(top * self.floor, min=tiny).to(d.dtype)
        usable = torch.isfinite(top) & (top > 0.0)
        return torch.where(usable, torch.maximum(d, floor), torch.ones_like(d))

    def _floored_host(self, d: np.ndarray, state: DampingState, damping_min: float) -> np.ndarray:
        """:meth:`_floored` for a few float64 columns on the CPU, in NumPy.

        The same exact operations (maxima, one product, comparisons): the same D,
        without torch calls.
        """
        if state.damping <= damping_min:
            if d.size == 0:
                return np.ones_like(d)
            tiny = _TINY64
            if all(tiny <= v < math.inf for v in d.tolist()):
                # Every column usable (the usual case): D is d, which np.where would copy
                # (a Python loop over a few entries costs less than the five array calls).
                return d.copy()
            usable = np.isfinite(d) & (d >= tiny)
            largest = float(np.where(usable, d, 0.0).max())
            fill = max(largest * self.floor, tiny)
            return np.where(usable, d, fill) if largest > 0.0 else np.ones_like(d)
        top = float(d.max())
        floor = max(top * self.floor, _TINY64**0.5)
        if not (math.isfinite(top) and top > 0.0):
            return np.ones_like(d)
        return np.maximum(d, floor)


#: The smallest normal float64 (``np.finfo`` is a call per use).
_TINY64 = float(np.finfo(np.float64).tiny)


def _small_host(t: Tensor) -> bool:
    """A few float64 entries on the CPU: NumPy does their arithmetic without dispatch."""
    return t.dtype == torch.float64 and t.numel() <= 16 and t.is_cpu


class IdentityMatrix(DampingMatrix):
    """``D = I``: the original Levenberg damping; λ is then in units of ``JᵀJ``."""

    name = "identity"
    uniform = True

    def diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0
    ) -> Tensor:
        return torch.ones_like(col_sq)


class MarquardtMatrix(DampingMatrix):
    """``D = diag(JᵀJ)`` (Marquardt 1963, Fletcher 1971), floored.

    Invariant to a rescaling of each parameter, so λ is dimensionless; the usual choice
    for neural networks whose layers have very different gradient scales.
    """

    name = "marquardt"

    def diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0
    ) -> Tensor:
        return self._floored(col_sq, state, damping_min)


class MoreMatrix(DampingMatrix):
    """Moré's scaling (MINPACK): the running maximum of ``diag(JᵀJ)`` over iterations.

    Like Marquardt's, but a parameter whose column shrinks keeps the damping of its
    largest seen scale, which makes the trust region steadier on curve-fitting
    problems.  The running maximum lives in the optimizer's state.
    """

    name = "more"

    def diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0
    ) -> Tensor:
        if state.scale is None or state.scale.shape != col_sq.shape:
            state.scale = col_sq.clone()
        elif _small_host(col_sq) and _small_host(state.scale):
            # The running maximum and its floor in NumPy, crossing to torch once each way.
            scale = np.maximum(state.scale.numpy(), col_sq.numpy())
            state.scale = torch.from_numpy(scale)
            return torch.from_numpy(self._floored_host(scale, state, damping_min))
        else:
            state.scale = torch.maximum(state.scale.to(col_sq), col_sq)
        return self._floored(state.scale, state, damping_min)


DAMPING_MATRICES = ("identity", "marquardt", "more")


def make_damping_matrix(name: str, floor: float = 1e-9) -> DampingMatrix:
    """Build the damping matrix called ``name`` (one of :data:`DAMPING_MATRICES`)."""
    if name == "identity":
        return IdentityMatrix(floor)
    if name == "marquardt":
        return MarquardtMatrix(floor)
    if name == "more":
        return MoreMatrix(floor)
    check_choice("damping_matrix", name, DAMPING_MATRICES)
    raise AssertionError(name)  # pragma: no cover - check_choice raised
