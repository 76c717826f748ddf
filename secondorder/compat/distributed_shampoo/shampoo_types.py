"""DistributedShampoo's configuration dataclasses, with its names, fields and defaults.

Mirrors ``distributed_shampoo.shampoo_types`` so that imports keep working.  Each
dataclass checks its own fields when built; :class:`~secondorder.compat.
distributed_shampoo.DistributedShampoo` maps the supported ones onto
:class:`secondorder.Shampoo` and refuses the rest at construction, naming the option
and the nearest supported choice.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._base import Abstract, check_bool, check_in, check_int
from .preconditioner.matrix_functions_types import (
    DefaultEigenConfig,
    DefaultEigendecompositionConfig,
    DefaultNewtonSchulzOrthogonalizationConfig,
    EigendecompositionConfig,
    MatrixFunctionConfig,
    OrthogonalizationConfig,
    QREigendecompositionConfig,
    RootInvConfig,
)

__all__ = [
    "AdaGradPreconditionerConfig",
    "AdamPreconditionerConfig",
    "BaseShampooPreconditionerConfig",
    "ClassicMomentumConfig",
    "ClassicShampooPreconditionerConfig",
    "ConcurrencyConfig",
    "DDPDistributedConfig",
    "DefaultConcurrencyConfig",
    "DefaultEigenvalueCorrectedShampooConfig",
    "DefaultSOAPConfig",
    "DefaultShampooConfig",
    "DefaultShampooRuntimeConfig",
    "DefaultSignDescentPreconditionerConfig",
    "DefaultSingleDeviceDistributedConfig",
    "DefaultSpectralDescentPreconditionerConfig",
    "DistributedConfig",
    "EigendecomposedKLShampooPreconditionerConfig",
    "EigendecomposedShampooPreconditionerConfig",
    "EigenvalueCorrectedShampooPreconditionerConfig",
    "FSDPDistributedConfig",
    "FSDPParamAssignmentStrategy",
    "FSDPParameterMetadata",
    "FullyShardDistributedConfig",
    "GeneralizedPrimalAveragingConfig",
    "HSDPDistributedConfig",
    "HybridShardDistributedConfig",
    "IterateAveragingConfig",
    "LoadBalancingConfig",
    "PreconditionerConfig",
    "PreconditionerValueError",
    "RMSpropPreconditionerConfig",
    "RootInvKLShampooPreconditionerConfig",
    "RootInvShampooPreconditionerConfig",
    "SGDPreconditionerConfig",
    "ScheduleFreeConfig",
    "ShampooPT2CompileConfig",
    "ShampooRuntimeConfig",
    "SignDescentPreconditionerConfig",
    "SingleDeviceDistributedConfig",
    "SpectralDescentPreconditionerConfig",
    "WeightDecayType",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class PreconditionerValueError(ValueError):
    """A value met while computing a preconditioner is invalid."""


def _check_dtype(name: str, value: Any) -> None:
    if value not in FLOAT_DTYPES:
        raise ValueError(f"Invalid {name}={value!r}: must be a floating torch.dtype.")


# -- the preconditioners ----------------------------------------------------------------------
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
    """RMSprop: ``v ← β₂v + (1−β₂)g²``; ``drop_weighting_factor_on_gsquare`` drops ``1−β₂``."""

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
    """Adam: RMSprop's second moment with bias correction (β₁ is ``betas[0]``)."""

    beta2: float = 0.999


class BaseShampooPreconditionerConfig(PreconditionerConfig):
    """Base of the Kronecker-factored preconditioners (fields shared by all of them)."""


def _check_shampoo_fields(self: Any) -> None:
    name = type(self).__name__
    if not isinstance(self.amortized_computation_config, MatrixFunctionConfig):
        raise TypeError(
            f"Invalid {name}.amortized_computation_config={self.amortized_computation_config!r}:"
            " must be a matrix-function config such as EigenConfig()."
        )
    check_bool(f"{name}.drop_weighting_factor_on_gsquare", self.drop_weighting_factor_on_gsquare)
    _check_dtype(f"{name}.factor_matrix_dtype", self.factor_matrix_dtype)
    check_int(
        f"{name}.num_tolerated_failed_amortized_computations",
        self.num_tolerated_failed_amortized_computations,
        0,
    )
    check_bool(f"{name}.use_symmetric_packing", self.use_symmetric_packing)
    check_bool(f"{name}.use_trace_scaling", self.use_trace_scaling)
    if self.use_trace_scaling:
        check_in(
            f"{name}.trace_scaling_exponent", self.trace_scaling_exponent, 0.0, 1.0, low_open=True
        )
    for key, value in self.inverse_exponent_override.items():
        check_int(f"{name}.inverse_exponent_override key", key, 0)
        values = value.values() if isinstance(value, dict) else [value]
        for v in values:
            check_in(f"{name}.inverse_exponent_override[{key}]", v, 0.0)


class ClassicShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    """Base of Shampoo proper: one inverse root per factor."""


@dataclass(kw_only=True)
class RootInvShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    """Shampoo keeping the inverse roots ``(F + εI)^(−1/2r)``."""

    amortized_computation_config: RootInvConfig = field(default_factory=lambda: DefaultEigenConfig)
    drop_weighting_factor_on_gsquare: bool = False
    factor_matrix_dtype: torch.dtype = torch.float32
    num_tolerated_failed_amortized_computations: int = 3
    use_symmetric_packing: bool = True
    use_trace_scaling: bool = False
    trace_scaling_exponent: float = 0.5
    inverse_exponent_override: dict[int, Any] = field(default_factory=dict)
    inv_factor_matrix_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _check_shampoo_fields(self)
        _check_dtype(f"{type(self).__name__}.inv_factor_matrix_dtype", self.inv_factor_matrix_dtype)


DefaultShampooConfig = RootInvShampooPreconditionerConfig()


@dataclass(kw_only=True)
class EigendecomposedShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    """Shampoo keeping each factor's eigenvectors and eigenvalues instead of its root."""

    amortized_computation_config: EigendecompositionConfig = field(
        default_factory=lambda: DefaultEigendecompositionConfig
    )
    drop_weighting_factor_on_gsquare: bool = False
    factor_matrix_dtype: torch.dtype = torch.float32
    num_tolerated_failed_amortized_computations: int = 3
    use_symmetric_packing: bool = True
    use_trace_scaling: bool = False
    trace_scaling_exponent: float = 0.5
    inverse_exponent_override: dict[int, Any] = field(default_factory=dict)
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    factor_matrix_eigenvalues_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _check_shampoo_fields(self)
        for f in ("factor_matrix_eigenvectors_dtype", "factor_matrix_eigenvalues_dtype"):
            _check_dtype(f"{type(self).__name__}.{f}", getattr(self, f))


@dataclass(kw_only=True)
class EigenvalueCorrectedShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    """SOAP: Adam's second moment kept in the eigenbasis of the factors."""

    amortized_computation_config: EigendecompositionConfig = field(
        default_factory=lambda: DefaultEigendecompositionConfig
    )
    drop_weighting_factor_on_gsquare: bool = False
    factor_matrix_dtype: torch.dtype = torch.float32
    num_tolerated_failed_amortized_computations: int = 3
    use_symmetric_packing: bool = True
    use_trace_scaling: bool = False
    trace_scaling_exponent: float = 0.5
    ignored_basis_change_dims: dict[int, list[int]] = field(default_factory=dict)
    inverse_exponent_override: dict[int, float] = field(default_factory=dict)
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    corrected_eigenvalues_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _check_shampoo_fields(self)
        for f in ("factor_matrix_eigenvectors_dtype", "corrected_eigenvalues_dtype"):
            _check_dtype(f"{type(self).__name__}.{f}", getattr(self, f))


DefaultEigenvalueCorrectedShampooConfig = EigenvalueCorrectedShampooPreconditionerConfig()
DefaultSOAPConfig = EigenvalueCorrectedShampooPreconditionerConfig(
    amortized_computation_config=QREigendecompositionConfig()
)


@dataclass(kw_only=True)
class RootInvKLShampooPreconditionerConfig(RootInvShampooPreconditionerConfig):
    """KL-Shampoo with inverse roots (not implemented by secondorder)."""


@dataclass(kw_only=True)
class EigendecomposedKLShampooPreconditionerConfig(EigendecomposedShampooPreconditionerConfig):
    """KL-Shampoo with eigendecompositions (not implemented by secondorder)."""


@dataclass(kw_only=True)
class SpectralDescentPreconditionerConfig(PreconditionerConfig):
    """Spectral descent (Muon) on 2-D blocks (not implemented by secondorder)."""

    orthogonalization_config: OrthogonalizationConfig = field(
        default_factory=lambda: DefaultNewtonSchulzOrthogonalizationConfig
    )


DefaultSpectralDescentPreconditionerConfig = SpectralDescentPreconditionerConfig()


def _unit_scale(grad: torch.Tensor) -> float:
    return 1.0


@dataclass(kw_only=True)
class SignDescentPreconditionerConfig(PreconditionerConfig):
    """Sign descent, scaled by ``scale_fn(grad)`` (not implemented by secondorder)."""

    scale_fn: Callable[[torch.Tensor], float | torch.Tensor] = _unit_scale


DefaultSignDescentPreconditionerConfig = SignDescentPreconditionerConfig()


# -- iterate averaging and weight decay ----------------------------------------------------
class IterateAveragingConfig(Abstract):
    """Base of ``iterate_averaging_config``: momentum or averaged iterates."""


@dataclass(kw_only=True)
class ClassicMomentumConfig(IterateAveragingConfig):
    """SGD's momentum on the search direction ``P``: ``M ← μM + (1−d)P``, ``P ← M``."""

    momentum: float = 0.5
    dampening: float = 0.0
    use_nesterov: bool = False

    def __post_init__(self) -> None:
        check_in(
            "ClassicMomentumConfig.momentum", self.momentum, 0.0, 1.0, low_open=True, high_open=True
        )
        check_in("ClassicMomentumConfig.dampening", self.dampening, 0.0, 1.0, high_open=True)
        check_bool("ClassicMomentumConfig.use_nesterov", self.use_nesterov)


@dataclass(kw_only=True)
class GeneralizedPrimalAveragingConfig(IterateAveragingConfig):
    """Generalized primal averaging (not implemented by secondorder)."""

    eval_interp_coeff: float = 0.9
    train_interp_coeff: float = 1.0


@dataclass(kw_only=True)
class ScheduleFreeConfig(IterateAveragingConfig):
    """Schedule-Free (not implemented by secondorder)."""

    train_interp_coeff: float = 0.9
    iterate_weighting_power: float = 2.0
    eval_interp_coeff_upper_bound: float = 1.0


class WeightDecayType(enum.Enum):
    """L2 (added to the gradient), DECOUPLED (added to the direction), and two scaled forms."""

    L2 = enum.auto()
    DECOUPLED = enum.auto()
    CORRECTED = enum.auto()
    INDEPENDENT = enum.auto()


# -- distribution ---------------------------------------------------------------------------
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
class LoadBalancingConfig:
    """How blocks are balanced across ranks (secondorder: longest processing time first)."""

    cost_model: Any = None


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
class DDPDistributedConfig(DistributedConfig):
    """Data parallelism: blocks shared among ranks, directions all-gathered."""

    target_parameter_dimensionality: int | float = 1
    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)

    def __post_init__(self) -> None:
        _check_target(self)
        _check_dtype(f"{type(self).__name__}.communication_dtype", self.communication_dtype)
        n = self.num_trainers_per_group
        if n != -1:
            check_int(f"{type(self).__name__}.num_trainers_per_group", n, 1)
        check_bool(f"{type(self).__name__}.communicate_params", self.communicate_params)


@dataclass(kw_only=True)
class FSDPDistributedConfig(DistributedConfig):
    """FSDP (flat parameters): not supported by secondorder yet."""

    target_parameter_dimensionality: int | float = 1
    param_to_metadata: dict[Any, FSDPParameterMetadata]


@dataclass(kw_only=True)
class HSDPDistributedConfig(FSDPDistributedConfig, DDPDistributedConfig):
    """Hybrid-sharded FSDP: not supported by secondorder yet."""

    device_mesh: Any


@dataclass(kw_only=True)
class FullyShardDistributedConfig(DistributedConfig):
    """FSDP2 (``fully_shard``): not supported by secondorder yet."""

    target_parameter_dimensionality: int | float = 1
    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT
    num_sub_groups: int = 1
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)


@dataclass(kw_only=True)
class HybridShardDistributedConfig(FullyShardDistributedConfig, DDPDistributedConfig):
    """Hybrid-sharded FSDP2: not supported by secondorder yet."""

    device_mesh: Any


# -- run-time options -----------------------------------------------------------------------
class ShampooPT2CompileConfig:
    """``torch.compile`` options for the optimizer step (not supported: the step runs eagerly)."""

    def __init__(self, **kwargs: Any) -> None:
        self.options = kwargs

    def __repr__(self) -> str:
        return f"ShampooPT2CompileConfig({self.options!r})"


@dataclass(kw_only=True)
class ShampooRuntimeConfig:
    """``eager_nan_check``: secondorder checks every gradient for non-finite values anyway."""

    eager_nan_check: bool = False


DefaultShampooRuntimeConfig = ShampooRuntimeConfig()


@dataclass(kw_only=True)
class ConcurrencyConfig:
    """CUDA streams per parameter group (no effect on the results)."""

    enable_cuda_stream_for_param_groups: bool = True


DefaultConcurrencyConfig = ConcurrencyConfig()
