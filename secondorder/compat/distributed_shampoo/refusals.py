"""Refusals of the DistributedShampoo drop-in: the message shape and the later group keys.

The parameter groups hold secondorder.Shampoo's options, translated from
DistributedShampoo's when a group is added; one of DistributedShampoo's own names set
on a group afterwards would be ignored, so it is refused at the next step, before
anything changes, with the native key to set instead.
"""

from __future__ import annotations

from typing import Any

from .shampoo_types import (
    ClassicMomentumConfig,
    GeneralizedPrimalAveragingConfig,
    ScheduleFreeConfig,
    WeightDecayType,
)

__all__ = ["check_later_keys", "momentum_options", "refuse"]


def refuse(option: str, value: Any, nearest: str, why: str = "") -> ValueError:
    """The error for an option secondorder does not run, with the nearest it does."""
    shown = (
        type(value).__name__ + "(...)" if hasattr(value, "__dataclass_fields__") else repr(value)
    )
    return ValueError(
        f"DistributedShampoo: {option}={shown} is not supported by secondorder"
        + (f" ({why})" if why else "")
        + f"; the nearest supported choice is {nearest}."
    )


def momentum_options(cfg: Any) -> dict[str, Any]:
    """``iterate_averaging_config`` as so.Shampoo's momentum, dampening and Nesterov."""
    if cfg is None:
        return {"momentum": 0.0, "dampening": 0.0, "use_nesterov": False}
    if isinstance(cfg, ClassicMomentumConfig):
        return {
            "momentum": cfg.momentum,
            "dampening": cfg.dampening,
            "use_nesterov": cfg.use_nesterov,
        }
    if isinstance(cfg, (GeneralizedPrimalAveragingConfig, ScheduleFreeConfig)):
        raise refuse(
            "iterate_averaging_config",
            cfg,
            "ClassicMomentumConfig(momentum=...)",
            "iterate averaging is not implemented",
        )
    raise refuse("iterate_averaging_config", cfg, "None or ClassicMomentumConfig(...)")


def check_later_keys(group: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """Refuse a DistributedShampoo-only key set on ``group`` after it was added."""
    for key in _PEER_ONLY:
        if key in group and _ignored(key, group[key], group):
            where = f"param_groups[{_index(groups, group)}][{key!r}]"
            raise ValueError(
                f"DistributedShampoo: {where}={group[key]!r} was set after the optimizer "
                f"was built, and would be ignored: the groups hold secondorder.Shampoo's "
                f"options, translated when the group was added. {_instead(key, group[key])} "
                f"and delete {key!r}; nothing changed."
            )


#: DistributedShampoo's group options that so.Shampoo's groups do not hold.
_PEER_ONLY = (
    "weight_decay_type",
    "iterate_averaging_config",
    "beta3",
    "preconditioner_config",
    "distributed_config",
)


def _ignored(key: str, value: Any, group: dict[str, Any]) -> bool:
    """Whether ``group[key] = value`` asks for something the group does not do."""
    if key == "beta3":
        return bool(value != -1.0 and value != group["betas"][0])
    if key == "weight_decay_type":
        return (value is WeightDecayType.DECOUPLED) != group["use_decoupled_weight_decay"]
    if key == "iterate_averaging_config":
        try:
            wanted = momentum_options(value)
        except ValueError:
            return True
        return any(group[k] != v for k, v in wanted.items())
    return True  # preconditioner_config, distributed_config: fixed when it was built


def _instead(key: str, value: Any) -> str:
    """What to do in secondorder's terms instead of setting ``key``."""
    if key == "weight_decay_type":
        if value not in (WeightDecayType.L2, WeightDecayType.DECOUPLED):
            refused = refuse(key, value, "WeightDecayType.DECOUPLED")
            return f"{str(refused).rstrip('.')}: keep the group's"
        return f"Set use_decoupled_weight_decay={value is WeightDecayType.DECOUPLED} instead"
    if key == "iterate_averaging_config":
        try:
            wanted = momentum_options(value)
        except ValueError as exc:
            return f"{str(exc).rstrip('.')}: keep the group's"
        shown = ", ".join(f"{k}={v!r}" for k, v in wanted.items())
        return f"Set {shown} instead (switching momentum on or off needs a new optimizer)"
    if key == "beta3":
        return "The gradient filter is betas[0] (a separate beta3 is not implemented): keep it"
    return "It is fixed when the group is added: build a new DistributedShampoo for another"


def _index(groups: list[dict[str, Any]], group: dict[str, Any]) -> str:
    return next((str(i) for i, g in enumerate(groups) if g is group), "new")
