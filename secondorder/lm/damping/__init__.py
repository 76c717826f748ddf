"""Damping: how λ moves between attempts, and the matrix ``D`` it multiplies.

The damped normal equations are ``(JᵀJ + λD) δ = -Jᵀr``.  Large λ gives a short step
along the scaled gradient ``-D⁻¹Jᵀr``; small λ gives the Gauss-Newton step.  A *rule*
decides how λ changes after an attempt, from the gain ratio

    ρ = (actual reduction of ½‖r‖²) / (reduction predicted by the linear model),

and a *damping matrix* decides the shape of the trust region.
"""

from __future__ import annotations

from ..._validation import check_choice
from .matrices import (
    DAMPING_MATRICES,
    DampingMatrix,
    IdentityMatrix,
    MarquardtMatrix,
    MoreMatrix,
    make_damping_matrix,
)
from .rules import MultiplicativeRule, NielsenRule
from .state import (
    NIELSEN_SHRINK,
    DampingRule,
    DampingState,
    DeviceDamping,
    StepRecord,
    check_damping_factors,
    check_damping_shrink,
    raise_damping,
)
from .trust import TrustRegionRule

__all__ = [
    "DAMPING_MATRICES",
    "DAMPING_RULES",
    "FITTING_DAMPING_RULES",
    "NIELSEN_SHRINK",
    "DampingMatrix",
    "DampingRule",
    "DampingState",
    "DeviceDamping",
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


DAMPING_RULES = ("nielsen", "multiplicative")
#: The rules :func:`~secondorder.fitting.least_squares` accepts: the trust region too, whose
#: radius the model optimizer's checkpoints do not carry.
FITTING_DAMPING_RULES = (*DAMPING_RULES, "trust")


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
