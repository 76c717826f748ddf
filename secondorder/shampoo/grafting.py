"""The grafted diagonal methods, on stacks of equal-shape blocks.

Each keeps at most one elementwise state ``v`` (the sum or moving average of ``g²``)
and turns the filtered gradient ``m`` into its direction:

* SGD: ``d = m``;
* AdaGrad: ``v ← v + g²``, ``d = m / (sqrt(v) + ε)``;
* RMSprop: ``v ← β₂v + (1−β₂)g²``, ``d = m / (sqrt(v) + ε)``;
* Adam: as RMSprop, with ``sqrt(v) / sqrt(1 − β₂ᵗ)`` in the denominator.

The operation order follows ``torch.optim`` (``sqrt(v) / sqrt(bc)`` rather than
``sqrt(v / bc)``) so that Shampoo that never preconditions matches it to the last bits.
"""

from __future__ import annotations

from torch import Tensor

from .config import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    GraftingConfig,
    RMSpropGraftingConfig,
)

__all__ = [
    "grafting_direction",
    "grafting_has_state",
    "update_grafting",
    "update_grafting_out_of_place",
]


def grafting_has_state(config: GraftingConfig | None) -> bool:
    """Whether the method keeps a second-moment state."""
    return isinstance(config, (AdaGradGraftingConfig, RMSpropGraftingConfig, AdamGraftingConfig))


def update_grafting(config: GraftingConfig | None, v: Tensor | None, g: Tensor) -> None:
    """Accumulate ``g²`` into ``v`` in place."""
    if v is None:
        return
    if isinstance(config, AdaGradGraftingConfig):
        v.addcmul_(g, g, value=1.0)
    elif isinstance(config, (RMSpropGraftingConfig, AdamGraftingConfig)):
        v.mul_(config.beta2).addcmul_(g, g, value=1.0 - config.beta2)


def update_grafting_out_of_place(config: GraftingConfig | None, v: Tensor, g2: Tensor) -> Tensor:
    """What :func:`update_grafting` would make of ``v``, given ``g2 = g²``; ``v`` is kept."""
    if isinstance(config, AdaGradGraftingConfig):
        return v + g2
    if isinstance(config, (RMSpropGraftingConfig, AdamGraftingConfig)):
        return v * config.beta2 + g2 * (1.0 - config.beta2)
    return v


def grafting_direction(
    config: GraftingConfig | None, v: Tensor | None, m: Tensor, step: int
) -> Tensor:
    """The grafted method's direction for the filtered gradient ``m`` at ``step``."""
    if v is None:
        return m
    denom = v.sqrt()
    if isinstance(config, AdamGraftingConfig):
        denom = denom / (1.0 - config.beta2**step) ** 0.5
    assert isinstance(config, (AdaGradGraftingConfig, RMSpropGraftingConfig, AdamGraftingConfig))
    return m / denom.add_(config.epsilon)
