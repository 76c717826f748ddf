"""Adaptive damping by the Levenberg-Marquardt rule (the rule of kfac-jax).

Every ``interval`` steps the optimizer compares the loss reduction it obtained with the
reduction its quadratic model predicted,

    ρ = (L(θ + δ) − L(θ)) / (∇ᵀδ + ½ δᵀ(F̂ + λI)δ),

where ``F̂`` is the Kronecker-factored curvature.  ``ρ`` near 1 means the model is
trusted, so λ shrinks (steps move toward the natural-gradient step); ``ρ`` small or
negative means the model overshot, so λ grows (steps move toward a short gradient
step)::

    ρ > 3/4: λ ← ω λ        ρ < 1/4: λ ← λ / ω        ω = decay ** interval
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LMDampingRule"]


@dataclass(frozen=True)
class LMDampingRule:
    """Raise or lower λ from the reduction ratio ρ; see the module docstring.

    Attributes:
        interval: steps between adaptations (each costs two extra forward passes).
        decay: per-step factor; λ changes by ``decay ** interval`` per adaptation.
        min_damping, max_damping: bounds on λ.
    """

    interval: int = 5
    decay: float = 0.95
    min_damping: float = 1e-8
    max_damping: float = 1e8

    def __post_init__(self) -> None:
        if (
            isinstance(self.interval, bool)
            or not isinstance(self.interval, int)
            or self.interval < 1
        ):
            raise ValueError(
                f"Invalid damping_adaptation_interval={self.interval!r}: must be an integer >= 1."
            )
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"Invalid damping_adaptation_decay={self.decay!r}: must be in (0, 1).")
        if not 0.0 < self.min_damping <= self.max_damping or not math.isfinite(self.max_damping):
            raise ValueError(
                f"Invalid min_damping={self.min_damping!r}, max_damping={self.max_damping!r}: "
                "need 0 < min_damping <= max_damping < inf."
            )

    def ratio(self, loss_before: float, loss_after: float, predicted: float) -> float:
        """``ρ``; a non-decreasing model (``predicted >= 0``) or a non-finite loss gives -inf."""
        actual = loss_after - loss_before
        if not (math.isfinite(actual) and predicted < 0):
            return -math.inf
        return actual / predicted

    def update(self, damping: float, rho: float) -> float:
        """The next λ from the current one and ``ρ``."""
        omega = self.decay**self.interval
        if rho > 0.75:
            damping = damping * omega
        elif rho < 0.25:
            damping = damping / omega
        return min(max(damping, self.min_damping), self.max_damping)
