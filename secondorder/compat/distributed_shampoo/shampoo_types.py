"""DistributedShampoo's configuration dataclasses, with its names, fields and defaults.

Mirrors ``distributed_shampoo.shampoo_types`` so that imports keep working; the
diagonal-method and distributed configs, which ``so.Shampoo`` takes natively, are
defined in :mod:`secondorder.shampoo.named_configs` and re-exported here.  Each
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

from ...shampoo.named_configs import (
    FLOAT_DTYPES,
    Abstract,
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DefaultSingleDeviceDistributedConfig,
    DistributedConfig,
    FSDPDistributedConfig,
    FSDPParamAssignmentStrategy,
    FSDPParameterMetadata,
    FullyShardDistributedConfig,
    HSDPDistributedConfig,
    HybridShardDistributedConfig,
    LoadBalancingConfig,
    PreconditionerConfig,
    RMSpropPreconditionerConfig,
    SGDPreconditionerConfig,
    SingleDeviceDistributedConfig,
    check_bool,
    check_dtype,
    check_in,
    check_int,
)
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
    "FLOAT_DTYPES",
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


class PreconditionerValueError(ValueError):
    """A value met while computing a preconditioner is invalid."""


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
    check_dtype(f"{name}.factor_matrix_dtype", self.factor_matrix_dtype)
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
        check_dtype(f"{type(self).__name__}.inv_factor_matrix_dtype", self.inv_factor_matrix_dtype)


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
            check_dtype(f"{type(self).__name__}.{f}", getattr(self, f))


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
            check_dtype(f"{type(self).__name__}.{f}", getattr(self, f))


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
    train_interp_coeff: float = 0.8


@dataclass(kw_only=True)
class ScheduleFreeConfig(IterateAveragingConfig):
    """Schedule-Free (not implemented by secondorder)."""

    train_interp_coeff: float = 0.8
    eval_coeff_lr_power: int = 2


class WeightDecayType(enum.Enum):
    """L2 (added to the gradient), DECOUPLED (added to the direction), and two scaled forms."""

    L2 = enum.auto()
    DECOUPLED = enum.auto()
    CORRECTED = enum.auto()
    INDEPENDENT = enum.auto()


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
