"""DistributedShampoo's configuration dataclasses that :class:`~secondorder.shampoo.Shampoo` takes.

A script written for DistributedShampoo passes these by their names and fields:

* ``grafting_config``: :class:`SGDPreconditionerConfig`, :class:`AdaGradPreconditionerConfig`,
  :class:`RMSpropPreconditionerConfig`, :class:`AdamPreconditionerConfig`, with the
  reference's defaults (``epsilon=1e-10``, RMSprop's ``beta2=0.99`` up to 1, and
  ``drop_weighting_factor_on_gsquare``), which differ from the older
  ``RMSpropGraftingConfig``/``AdamGraftingConfig`` (``epsilon=1e-8``, ``beta2 < 1``);
* ``distributed_config``: :class:`SingleDeviceDistributedConfig` (no parallelism),
  :class:`DDPDistributedConfig` (blocks divided among data-parallel ranks),
  :class:`FullyShardDistributedConfig` and :class:`HybridShardDistributedConfig`
  (``fully_shard`` parameters: each rank steps its own shards).  The FSDP1 configs are
  defined so that a script imports, and refused when a Shampoo is built.

Each dataclass checks its fields when built, naming the field and the allowed range.
:mod:`secondorder.compat.distributed_shampoo` re-exports them beside the rest of
DistributedShampoo's configuration names.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "FLOAT_DTYPES",
    "Abstract",
    "AdaGradPreconditionerConfig",
    "AdamPreconditionerConfig",
    "DDPDistributedConfig",
    "DefaultSingleDeviceDistributedConfig",
    "DistributedConfig",
    "FSDPDistributedConfig",
    "FSDPParamAssignmentStrategy",
    "FSDPParameterMetadata",
    "FullyShardDistributedConfig",
    "HSDPDistributedConfig",
    "HybridShardDistributedConfig",
    "LoadBalancingConfig",
    "PreconditionerConfig",
    "RMSpropPreconditionerConfig",
    "SGDPreconditionerConfig",
    "SingleDeviceDistributedConfig",
    "check_bool",
    "check_dtype",
    "check_in",
    "check_int",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Abstract:
    """A base that cannot be built itself; its concrete subclasses are dataclasses."""

    def __init__(self) -> None:
        subclasses = sorted(c.__name__ for c in _concrete(type(self)))
        raise TypeError(
            f"{type(self).__name__} is abstract; build one of its subclasses: "
            f"{', '.join(subclasses) or 'none'}."
        )


def _concrete(cls: type) -> list[type]:
    out: list[type] = []
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        if "__init__" in vars(sub) and vars(sub)["__init__"] is not Abstract.__init__:
            out.append(sub)
        out.extend(_concrete(sub))
    return out


def check_in(
    name: str,
    value: Any,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise naming ``name`` unless ``value`` is a number in the given interval."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"Invalid {name}={value!r}: must be in {left}{low}, {high}{right}.")


def check_int(name: str, value: Any, low: int) -> None:
    """Raise naming ``name`` unless ``value`` is an integer ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}={value!r}: must be an integer >= {low}.")


def check_bool(name: str, value: Any) -> None:
    """Raise naming ``name`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}={value!r}: must be True or False.")


def check_dtype(name: str, value: Any) -> None:
    """Raise naming ``name`` unless ``value`` is a floating torch dtype."""
    if value not in FLOAT_DTYPES:
        raise ValueError(f"Invalid {name}={value!r}: must be a floating torch.dtype.")


# -- the diagonal methods (grafting) ----------------------------------------------------------
class PreconditionerConfig(Abstract):
    """Base of everything ``preconditioner_config`` and ``grafting_config`` take."""


@dataclass
class SGDPreconditionerConfig(PreconditionerConfig):
    """The (filtered) gradient itself."""


@dataclass(kw_only=True)
class AdaGradPreconditionerConfig(PreconditionerConfig):
    """AdaGrad: ``m / (sqrt(Σ g²) + epsilon)``."""

    epsilon: float = 1e-10

    def __post_init__(self) -> None:
        check_in(f"{type(self).__name__}.epsilon", self.epsilon, 0.0, low_open=True)


@dataclass(kw_only=True)
class RMSpropPreconditionerConfig(AdaGradPreconditionerConfig):
    """RMSprop: ``v ← β₂v + (1−β₂)g²``; ``drop_weighting_factor_on_gsquare`` drops ``1−β₂``.

    ``beta2=1`` is allowed as in DistributedShampoo: with the weight ``1 − β₂ = 0`` the
    second moment then stays 0 (unless the weight is dropped: AdaGrad).
    """

    beta2: float = 0.99
    drop_weighting_factor_on_gsquare: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_in(f"{type(self).__name__}.beta2", self.beta2, 0.0, 1.0, low_open=True)
        check_bool(
            f"{type(self).__name__}.drop_weighting_factor_on_gsquare",
            self.drop_weighting_factor_on_gsquare,
        )


@dataclass(kw_only=True)
class AdamPreconditionerConfig(RMSpropPreconditionerConfig):
    """Adam: RMSprop's second moment with bias correction (β₁ is ``betas[0]``).

    Dropping the weight ``1 − β₂`` also drops the bias correction, as in DistributedShampoo.
    """

    beta2: float = 0.999


# -- distribution ---------------------------------------------------------------------------
class DistributedConfig(Abstract):
    """Base of ``distributed_config``."""


def _check_target(self: Any) -> None:
    t = self.target_parameter_dimensionality
    if not (t == float("inf") or (isinstance(t, int) and not isinstance(t, bool) and t >= 1)):
        raise ValueError(
            f"Invalid {type(self).__name__}.target_parameter_dimensionality={t!r}: must be "
            "an integer >= 1 or math.inf."
        )


@dataclass(kw_only=True)
class SingleDeviceDistributedConfig(DistributedConfig):
    """No parallelism: every rank computes every block."""

    target_parameter_dimensionality: int | float = 1

    def __post_init__(self) -> None:
        _check_target(self)


DefaultSingleDeviceDistributedConfig = SingleDeviceDistributedConfig()


@dataclass(kw_only=True)
class LoadBalancingConfig:
    """How blocks are balanced across ranks (secondorder: longest processing time first)."""

    cost_model: Any = None


@dataclass(kw_only=True)
class DDPDistributedConfig(DistributedConfig):
    """Data parallelism: blocks shared among ranks, directions all-gathered."""

    target_parameter_dimensionality: int | float = 1
    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)

    def __post_init__(self) -> None:
        _check_target(self)
        check_dtype(f"{type(self).__name__}.communication_dtype", self.communication_dtype)
        n = self.num_trainers_per_group
        if n != -1:
            check_int(f"{type(self).__name__}.num_trainers_per_group", n, 1)
        check_bool(f"{type(self).__name__}.communicate_params", self.communicate_params)


@dataclass
class FSDPParameterMetadata:
    """Where an FSDP shard lies in its parameter (for the FSDP distributor)."""

    fqn: str
    shape: torch.Size
    numel: int
    start_idx: int
    end_idx: int
    sharding_strategy: Any


class FSDPParamAssignmentStrategy(enum.Enum):
    """How FSDP2 parameters are assigned to ranks."""

    DEFAULT = enum.auto()
    REPLICATE = enum.auto()
    ROUND_ROBIN = enum.auto()


@dataclass(kw_only=True)
class FSDPDistributedConfig(DistributedConfig):
    """FSDP1 (``FullyShardedDataParallel``'s flat parameters): refused by secondorder."""

    target_parameter_dimensionality: int | float = 1
    param_to_metadata: dict[Any, FSDPParameterMetadata]


@dataclass(kw_only=True)
class HSDPDistributedConfig(FSDPDistributedConfig, DDPDistributedConfig):
    """Hybrid-sharded FSDP1: refused by secondorder."""

    device_mesh: Any


@dataclass(kw_only=True)
class FullyShardDistributedConfig(DistributedConfig):
    """FSDP2 (``fully_shard``): each rank steps the blocks of its own shards.

    secondorder supports ``param_assignment_strategy=DEFAULT`` and ``num_sub_groups=1``.
    """

    target_parameter_dimensionality: int | float = 1
    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT
    num_sub_groups: int = 1
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)


@dataclass(kw_only=True)
class HybridShardDistributedConfig(FullyShardDistributedConfig, DDPDistributedConfig):
    """Hybrid-sharded FSDP2: each rank steps its own shards (replicas compute alike)."""

    device_mesh: Any
