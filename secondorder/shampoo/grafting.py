"""The grafted diagonal methods, on stacks of equal-shape blocks.

Each keeps at most one elementwise state ``v`` (the sum or moving average of ``g²``)
and turns the filtered gradient ``m`` into its direction:

* SGD: ``d = m``;
* AdaGrad: ``v ← v + g²``, ``d = m / (sqrt(v) + ε)``;
* RMSprop: ``v ← β₂v + w·g²`` (``w = 1 − β₂``), ``d = m / (sqrt(v) + ε)``;
* Adam: as RMSprop, with ``sqrt(v) / sqrt(1 − β₂ᵗ)`` in the denominator.

Both spellings of the configs are read: ``AdamGraftingConfig`` and the others of
:mod:`.config`, and DistributedShampoo's ``AdamPreconditionerConfig`` and the others of
:mod:`.named_configs` (whose ``drop_weighting_factor_on_gsquare`` sets ``w = 1`` and,
for Adam, drops the bias correction, as the reference does).

The operation order follows ``torch.optim`` (``sqrt(v) / sqrt(bc)`` rather than
``sqrt(v / bc)``) so that Shampoo that never preconditions matches it to the last bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .config import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    RMSpropGraftingConfig,
)
from .named_configs import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    RMSpropPreconditionerConfig,
)

__all__ = [
    "GraftingRule",
    "grafting_direction",
    "grafting_has_state",
    "grafting_rule",
    "update_grafting",
    "update_grafting_out_of_place",
    "updated_grafting",
]


class GraftingRule(NamedTuple):
    """``v ← β₂v + weight·g²`` (no decay when ``β₂ = 1``), ``d = m / (sqrt(v / bc) + ε)``."""

    beta2: float
    weight: float
    epsilon: float
    bias_correction: bool


def grafting_rule(config: object) -> GraftingRule | None:
    """The second-moment rule of a grafting config; ``None`` for SGD (no state)."""
    if isinstance(config, AdaGradGraftingConfig):
        return GraftingRule(1.0, 1.0, config.epsilon, False)
    if isinstance(config, (RMSpropGraftingConfig, AdamGraftingConfig)):
        adam = isinstance(config, AdamGraftingConfig)
        return GraftingRule(config.beta2, 1.0 - config.beta2, config.epsilon, adam)
    if isinstance(config, RMSpropPreconditionerConfig):  # Adam's config is one too
        if config.drop_weighting_factor_on_gsquare:
            return GraftingRule(config.beta2, 1.0, config.epsilon, False)
        adam = isinstance(config, AdamPreconditionerConfig)
        return GraftingRule(config.beta2, 1.0 - config.beta2, config.epsilon, adam)
    if isinstance(config, AdaGradPreconditionerConfig):
        return GraftingRule(1.0, 1.0, config.epsilon, False)
    return None


def grafting_has_state(config: object) -> bool:
    """Whether the method keeps a second-moment state."""
    return grafting_rule(config) is not None


def update_grafting(config: object, v: Tensor | None, g: Tensor) -> None:
    """Accumulate ``g²`` into ``v`` in place."""
    rule = grafting_rule(config)
    if v is None or rule is None:
        return
    if rule.beta2 != 1.0:
        v.mul_(rule.beta2)
    v.addcmul_(g, g, value=rule.weight)


def updated_grafting(config: object, v: Tensor, g: Tensor) -> Tensor:
    """What :func:`update_grafting` would make of ``v``, as a new tensor; ``v`` is kept."""
    rule = grafting_rule(config)
    if rule is None:
        return v
    if rule.beta2 != 1.0:
        return v.mul(rule.beta2).addcmul_(g, g, value=rule.weight)
    return torch.addcmul(v, g, g, value=rule.weight)


def update_grafting_out_of_place(config: object, v: Tensor, g2: Tensor) -> Tensor:
    """What :func:`update_grafting` would make of ``v``, given ``g2 = g²``; ``v`` is kept."""
    rule = grafting_rule(config)
    if rule is None:
        return v
    return (v * rule.beta2 if rule.beta2 != 1.0 else v) + g2 * rule.weight


def grafting_direction(config: object, v: Tensor | None, m: Tensor, step: int) -> Tensor:
    """The grafted method's direction for the filtered gradient ``m`` at ``step``."""
    rule = grafting_rule(config)
    if v is None or rule is None:
        return m
    denom = v.sqrt()
    if rule.bias_correction and rule.beta2 < 1.0:
        denom.div_((1.0 - rule.beta2**step) ** 0.5)
    return m / denom.add_(rule.epsilon)
