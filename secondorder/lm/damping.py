"""Damping: how λ moves between attempts, and the matrix ``D`` it multiplies.

The damped normal equations are ``(JᵀJ + λD) δ = -Jᵀr``.  Large λ gives a short step
along the scaled gradient ``-D⁻¹Jᵀr``; small λ gives the Gauss-Newton step.  A *rule*
decides how λ changes after an attempt, from the gain ratio

    ρ = (actual reduction of ½‖r‖²) / (reduction predicted by the linear model),

and a *damping matrix* decides the shape of the trust region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._validation import check_choice, check_number

__all__ = [
    "DAMPING_MATRICES",
    "DAMPING_RULES",
    "DampingMatrix",
    "DampingRule",
    "DampingState",
    "IdentityMatrix",
    "MarquardtMatrix",
    "MoreMatrix",
    "MultiplicativeRule",
    "NielsenRule",
    "check_damping_factors",
    "make_damping_matrix",
    "make_damping_rule",
    "raise_damping",
]


@dataclass
class DampingState:
    """The mutable part of damping: λ, Nielsen's growth factor ν, Moré's running scale."""

    damping: float
    nu: float = 2.0
    scale: Tensor | None = None


class DampingRule:
    """Base class: update λ after an accepted or a rejected attempt."""

    name = ""

    def accept(self, state: DampingState, rho: float) -> None:
        """Update ``state`` after an attempt with gain ratio ``rho`` was accepted."""
        raise NotImplementedError

    def reject(self, state: DampingState) -> None:
        """Update ``state`` after an attempt was rejected (or failed numerically)."""
        raise NotImplementedError


class NielsenRule(DampingRule):
    """Nielsen's gain-ratio rule (Nielsen 1999; Madsen, Nielsen & Tingleff 2004).

    On success ``λ ← λ·max(1/3, 1 - (2ρ - 1)³)`` and ``ν ← 2``: a step that matched
    its model well (ρ near 1) shrinks λ by up to 3x, a barely useful one leaves it
    almost unchanged.  On failure ``λ ← λ·ν`` and ``ν ← 2ν``, so consecutive failures
    raise λ ever faster.  Smooth in ρ, it avoids the oscillation of fixed factors.
    """

    name = "nielsen"

    def accept(self, state: DampingState, rho: float) -> None:  # noqa: D102
        state.damping *= max(1.0 / 3.0, 1.0 - (2.0 * rho - 1.0) ** 3)
        state.nu = 2.0

    def reject(self, state: DampingState) -> None:  # noqa: D102
        state.damping *= state.nu
        state.nu *= 2.0


class MultiplicativeRule(DampingRule):
    """Fixed factors: ``λ ← λ·down`` on success, ``λ ← λ·up`` on failure (cuPyLMA's rule)."""

    name = "multiplicative"

    def __init__(self, up: float = 10.0, down: float = 0.1) -> None:
        check_damping_factors(up, down)
        self.up = float(up)
        self.down = float(down)

    def accept(self, state: DampingState, rho: float) -> None:  # noqa: D102
        state.damping *= self.down

    def reject(self, state: DampingState) -> None:  # noqa: D102
        state.damping *= self.up


DAMPING_RULES = ("nielsen", "multiplicative")


def check_damping_factors(up: object, down: object) -> None:
    """The multiplicative rule's factors: ``up`` a finite number > 1, ``down`` in (0, 1)."""
    check_number("damping_up", up, above=1, type_error=False)
    if not (isinstance(down, (int, float)) and not isinstance(down, bool) and 0 < down < 1):
        raise ValueError(f"Invalid damping_down={down!r}: must be in (0, 1).")


def make_damping_rule(name: str, up: float = 10.0, down: float = 0.1) -> DampingRule:
    """Build the damping rule called ``name`` (one of :data:`DAMPING_RULES`)."""
    if name == "nielsen":
        return NielsenRule()
    if name == "multiplicative":
        return MultiplicativeRule(up, down)
    check_choice("damping_rule", name, DAMPING_RULES)
    raise AssertionError(name)  # pragma: no cover - check_choice raised


def raise_damping(
    rule: DampingRule,
    state: DampingState,
    *,
    damping_min: float,
    damping_max: float | None = None,
    restart: float | None = None,
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

    Then ``λ ← max(λ, damping_min)`` and, with ``damping_max``, ``λ ← min(λ, damping_max)``.
    """
    rule.reject(state)
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


class IdentityMatrix(DampingMatrix):
    """``D = I``: the original Levenberg damping; λ is then in units of ``JᵀJ``."""

    name = "identity"

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
