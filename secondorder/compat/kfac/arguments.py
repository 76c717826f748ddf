"""kfac-pytorch's constructor arguments, checked and mapped onto so.KFAC's."""

from __future__ import annotations

import re

from torch import nn

from ..._validation import check_integer, check_number
from .enums import DistributedStrategy, parse

__all__ = ["check_scheduled", "kaisa_modules", "native_fraction"]


def check_scheduled(name: str, value: object) -> None:
    """KAISA's rules for a constant hyperparameter (a callable is checked at each step)."""
    if callable(value):
        return
    if name == "kl_clip" and value is None:
        return
    also = ", or a callable of the step"
    if name in ("factor_update_steps", "inv_update_steps"):
        check_integer(name, value)
    elif name == "factor_decay":
        if value == 1.0 and not isinstance(value, bool):
            raise ValueError(
                "Invalid factor_decay=1.0: kfac-pytorch accepts it and then never updates the "
                "factors (they stay the identity); use a value in [0, 1)."
            )
        check_number(name, value, at_least=0, below=1, also=also)
    elif name == "lr":
        check_number(name, value, at_least=0, also=also)
    else:
        check_number(name, value, above=0, also=also)


def native_fraction(value: object) -> tuple[float | str, DistributedStrategy]:
    """KAISA's ``grad_worker_fraction`` as so.KFAC's, and the strategy it names."""
    if isinstance(value, (DistributedStrategy, str)):
        strategy = parse("grad_worker_fraction", DistributedStrategy, value)
        names: dict[DistributedStrategy, float | str] = {
            DistributedStrategy.COMM_OPT: 1.0,
            DistributedStrategy.HYBRID_OPT: 0.5,
            DistributedStrategy.MEM_OPT: "mem-opt",
        }
        native = names[strategy]
        return native, strategy
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(
            f"Invalid grad_worker_fraction={value!r}: must be a number in [0, 1] (0 means "
            "1/world_size) or a DistributedStrategy."
        )
    if value == 0:
        return "mem-opt", DistributedStrategy.MEM_OPT
    if value == 1:
        return 1.0, DistributedStrategy.COMM_OPT
    return float(value), DistributedStrategy.HYBRID_OPT


def _any_match(text: str, patterns: list[str]) -> bool:
    return any(re.search(p, text) for p in patterns)


def kaisa_modules(model: nn.Module, skip_layers: list[str]) -> list[str]:
    """The names of the modules kfac-pytorch registers: trainable leaf Linear/Conv2d."""
    names = []
    for name, m in model.named_modules():
        if next(m.children(), None) is not None or not isinstance(m, (nn.Linear, nn.Conv2d)):
            continue
        if _any_match(name, skip_layers) or _any_match(type(m).__name__, skip_layers):
            continue
        if all(p.requires_grad for p in m.parameters()):
            names.append(name)
    return names
