"""kfac-pytorch's constructor arguments, checked and mapped onto so.KFAC's."""

from __future__ import annotations

import math
import re

from torch import nn

from .enums import DistributedStrategy, parse

__all__ = ["check_scheduled", "kaisa_modules", "native_fraction"]


def check_scheduled(name: str, value: object) -> None:
    """KAISA's rules for a constant hyperparameter (a callable is checked at each step)."""
    if callable(value):
        return
    if name == "kl_clip" and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Invalid {name}={value!r}: must be a number or a callable of the step.")
    if name in ("factor_update_steps", "inv_update_steps"):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid {name}={value!r}: must be an integer >= 1.")
        return
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"Invalid {name}={value!r}: must be finite.")
    if name == "factor_decay":
        if v == 1.0:
            raise ValueError(
                "Invalid factor_decay=1.0: kfac-pytorch accepts it and then never updates the "
                "factors (they stay the identity); use a value in [0, 1)."
            )
        if not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid factor_decay={value!r}: must be in [0, 1).")
    elif name == "lr":
        if v < 0.0:
            raise ValueError(f"Invalid lr={value!r}: must be >= 0.")
    elif v <= 0.0:
        raise ValueError(f"Invalid {name}={value!r}: must be > 0.")


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
