"""DistributedShampoo's matrix-function configurations, with its names, fields and defaults.

Each is checked when it is built; :class:`~secondorder.compat.distributed_shampoo.
DistributedShampoo` decides at construction which ones secondorder runs (eigh-based
roots and eigenbases, the coupled Newton iteration) and refuses the others, naming the
nearest supported choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._base import Abstract, check_bool, check_in, check_int

__all__ = [
    "CoupledHigherOrderConfig",
    "CoupledNewtonConfig",
    "DefaultEigenConfig",
    "DefaultEigendecompositionConfig",
    "DefaultNewtonSchulzOrthogonalizationConfig",
    "DefaultPerturbationConfig",
    "EigenConfig",
    "EigendecompositionConfig",
    "EighEigendecompositionConfig",
    "MatrixFunctionConfig",
    "NewtonSchulzOrthogonalizationConfig",
    "OrthogonalizationConfig",
    "PerturbationConfig",
    "PseudoInverseConfig",
    "QREigendecompositionConfig",
    "RankDeficientStabilityConfig",
    "RootInvConfig",
    "SVDOrthogonalizationConfig",
]


class RankDeficientStabilityConfig(Abstract):
    """How a singular factor is made safe: a perturbation ε·I or a pseudo-inverse."""


@dataclass(kw_only=True)
class PerturbationConfig(RankDeficientStabilityConfig):
    """Add ``epsilon·I`` (before the decomposition, or to its eigenvalues after: the same)."""

    perturb_before_computation: bool = True

    def __post_init__(self) -> None:
        check_bool("PerturbationConfig.perturb_before_computation", self.perturb_before_computation)


DefaultPerturbationConfig = PerturbationConfig()


@dataclass(kw_only=True)
class PseudoInverseConfig(RankDeficientStabilityConfig):
    """Give eigenvalues below ``rank_atol + rank_rtol·λ_max`` a zero inverse root."""

    rank_atol: float = 0.0
    rank_rtol: float | None = 0.0

    def __post_init__(self) -> None:
        check_in("PseudoInverseConfig.rank_atol", self.rank_atol, 0.0)
        if self.rank_rtol is not None:
            check_in("PseudoInverseConfig.rank_rtol", self.rank_rtol, 0.0, 1.0)


class MatrixFunctionConfig(Abstract):
    """Base of the amortized matrix computations (roots, eigenbases, orthogonalization)."""


def _default_stability() -> RankDeficientStabilityConfig:
    return DefaultPerturbationConfig


class EigendecompositionConfig(MatrixFunctionConfig):
    """Base of the eigendecompositions; ``tolerance`` > 0 may skip a refresh."""


@dataclass(kw_only=True)
class EighEigendecompositionConfig(EigendecompositionConfig):
    """``torch.linalg.eigh``, retried in float64 if it fails (``retry_double_precision``)."""

    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=_default_stability
    )
    tolerance: float = 0.0
    retry_double_precision: bool = True
    eigendecomposition_offload_device: str = ""

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_in(f"{name}.tolerance", self.tolerance, 0.0, 1.0)
        check_bool(f"{name}.retry_double_precision", self.retry_double_precision)
        if not isinstance(self.rank_deficient_stability_config, RankDeficientStabilityConfig):
            raise TypeError(
                f"Invalid {name}.rank_deficient_stability_config="
                f"{self.rank_deficient_stability_config!r}: must be PerturbationConfig(...) or "
                "PseudoInverseConfig(...)."
            )


DefaultEigendecompositionConfig = EighEigendecompositionConfig()


@dataclass(kw_only=True)
class QREigendecompositionConfig(EigendecompositionConfig):
    """QR iterations warm-started from the previous eigenbasis (``max_iterations`` of them)."""

    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=_default_stability
    )
    tolerance: float = 0.0
    max_iterations: int = 1

    def __post_init__(self) -> None:
        check_in("QREigendecompositionConfig.tolerance", self.tolerance, 0.0, 1.0)
        check_int("QREigendecompositionConfig.max_iterations", self.max_iterations, 1)


class RootInvConfig(MatrixFunctionConfig):
    """Base of the inverse-root computations ``(F + εI)^(−1/p)``."""


@dataclass(kw_only=True)
class EigenConfig(RootInvConfig, EighEigendecompositionConfig):
    """The inverse root through ``eigh``: exact up to rounding (``tolerance`` must be 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tolerance != 0.0:
            raise ValueError(f"Invalid EigenConfig.tolerance={self.tolerance!r}: must be 0.0.")


DefaultEigenConfig = EigenConfig()


@dataclass(kw_only=True)
class CoupledNewtonConfig(RootInvConfig):
    """Coupled inverse Newton iteration: matrix products only, to ``tolerance``."""

    max_iterations: int = 100
    tolerance: float = 1e-6

    def __post_init__(self) -> None:
        check_int("CoupledNewtonConfig.max_iterations", self.max_iterations, 1)
        check_in("CoupledNewtonConfig.tolerance", self.tolerance, 0.0, low_open=True)


@dataclass(kw_only=True)
class CoupledHigherOrderConfig(RootInvConfig):
    """Higher-order coupled iteration (``order`` ≥ 2).

    ``rel_epsilon`` and ``abs_epsilon`` are DistributedShampoo's fields (required
    there); the iteration is refused when the optimizer is built, so they are only
    kept.
    """

    rel_epsilon: float = 0.0
    abs_epsilon: float = 0.0
    max_iterations: int = 100
    tolerance: float = 1e-8
    order: int = 3
    disable_tf32: bool = True

    def __post_init__(self) -> None:
        check_int("CoupledHigherOrderConfig.max_iterations", self.max_iterations, 1)
        check_int("CoupledHigherOrderConfig.order", self.order, 2)


def _unit_scale(d_in: int, d_out: int) -> float:
    return 1.0


def _default_scale() -> Callable[[int, int], float]:
    return _unit_scale


class OrthogonalizationConfig(MatrixFunctionConfig):
    """Base of the orthogonalizations used by spectral descent."""


@dataclass(kw_only=True)
class SVDOrthogonalizationConfig(OrthogonalizationConfig):
    """Orthogonalize through an SVD."""

    scale_by_dims_fn: Callable[[int, int], float] = field(default_factory=_default_scale)
    scale_by_nuclear_norm: bool = False


@dataclass(kw_only=True)
class NewtonSchulzOrthogonalizationConfig(OrthogonalizationConfig):
    """Orthogonalize by a quintic Newton-Schulz iteration."""

    scale_by_dims_fn: Callable[[int, int], float] = field(default_factory=_default_scale)
    num_iterations: int = 5
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

    def __post_init__(self) -> None:
        check_int("NewtonSchulzOrthogonalizationConfig.num_iterations", self.num_iterations, 1)


DefaultNewtonSchulzOrthogonalizationConfig = NewtonSchulzOrthogonalizationConfig()
