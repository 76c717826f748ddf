"""The gain-ratio rules: Nielsen's smooth rule and fixed factors."""

from __future__ import annotations

import torch
from torch import Tensor

from .state import (
    NIELSEN_SHRINK,
    DampingRule,
    DampingState,
    StepRecord,
    check_damping_factors,
    check_damping_shrink,
)

__all__ = ["MultiplicativeRule", "NielsenRule"]


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

    def accepted(  # noqa: D102
        self, damping: Tensor, nu: Tensor, rho: Tensor
    ) -> tuple[Tensor, Tensor]:
        # pow with a tensor exponent is libm's pow, as Python's ``**`` on floats.
        cube = torch.pow(2.0 * rho - 1.0, torch.full_like(rho, 3.0))
        shrink = torch.clamp(1.0 - cube, min=self._floor)
        return damping * shrink, torch.full_like(nu, 2.0)

    def rejected(self, damping: Tensor, nu: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return damping * nu, nu * 2.0


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

    def accepted(  # noqa: D102
        self, damping: Tensor, nu: Tensor, rho: Tensor
    ) -> tuple[Tensor, Tensor]:
        return damping * self.down, nu

    def rejected(self, damping: Tensor, nu: Tensor) -> tuple[Tensor, Tensor]:  # noqa: D102
        return damping * self.up, nu
