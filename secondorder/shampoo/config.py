"""Typed, frozen, validated configuration of Shampoo.

Each concern is one small dataclass, checked when it is built: a bad value raises at
once with the field's name, the value and what is allowed.  The names and defaults
follow DistributedShampoo's ``shampoo_types.py`` so a tuned configuration ports over.

The configurations round-trip through plain dictionaries (:func:`config_to_dict`,
:func:`config_from_dict`) because optimizer state dicts are loaded with
``torch.load(..., weights_only=True)``, which refuses arbitrary classes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from .._validation import check_integer, check_number
from .named_configs import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    RMSpropPreconditionerConfig,
    SGDPreconditionerConfig,
)

__all__ = [
    "GRAFTING_CONFIGS",
    "PRECONDITIONERS",
    "AdaGradGraftingConfig",
    "AdamGraftingConfig",
    "CoupledNewtonConfig",
    "EigenConfig",
    "GraftingConfig",
    "RMSpropGraftingConfig",
    "RootInvConfig",
    "SGDGraftingConfig",
    "config_from_dict",
    "config_to_dict",
    "factor_dtype",
    "resolved_start",
    "state_dtype",
]

#: The preconditioner choices of :class:`~secondorder.shampoo.Shampoo`.
PRECONDITIONERS = ("root_inverse", "eigenvalue_corrected")


def check_range(
    name: str,
    value: object,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise naming ``name`` unless ``value`` is a finite number in the given interval."""
    finite_high = high != math.inf
    check_number(
        name,
        value,
        above=low if low_open else None,
        at_least=None if low_open else low,
        below=high if finite_high and high_open else None,
        at_most=high if finite_high and not high_open else None,
    )


def check_int(name: str, value: object, low: int) -> None:
    """Raise naming ``name`` unless ``value`` is an integer ``>= low``."""
    check_integer(name, value, minimum=low)


@dataclass(frozen=True)
class GraftingConfig:
    """Base of the grafting choices: the diagonal method whose step size Shampoo borrows.

    After preconditioning starts, each block's Shampoo direction is rescaled to the
    Frobenius norm of this method's direction ("layer-wise grafting"), so a learning
    rate tuned for the grafted method carries over.  Before it starts, the grafted
    method's direction is used as is.
    """


@dataclass(frozen=True)
class SGDGraftingConfig(GraftingConfig):
    """Graft the norm of the (momentum-filtered) gradient itself."""


@dataclass(frozen=True)
class AdaGradGraftingConfig(GraftingConfig):
    """AdaGrad: ``d = m / (sqrt(Σ g²) + epsilon)``; torch.optim.Adagrad's default eps."""

    epsilon: float = 1e-10

    def __post_init__(self) -> None:
        check_range("AdaGradGraftingConfig.epsilon", self.epsilon, 0.0, low_open=True)


@dataclass(frozen=True)
class RMSpropGraftingConfig(GraftingConfig):
    """RMSprop: ``v ← β₂v + (1−β₂)g²``, ``d = m / (sqrt(v) + epsilon)``, no bias correction."""

    beta2: float = 0.99
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        check_range(
            "RMSpropGraftingConfig.beta2", self.beta2, 0.0, 1.0, low_open=True, high_open=True
        )
        check_range("RMSpropGraftingConfig.epsilon", self.epsilon, 0.0, low_open=True)


@dataclass(frozen=True)
class AdamGraftingConfig(GraftingConfig):
    """Adam: RMSprop's second moment with bias correction ``v / (1 − β₂ᵗ)``."""

    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        check_range("AdamGraftingConfig.beta2", self.beta2, 0.0, 1.0, low_open=True, high_open=True)
        check_range("AdamGraftingConfig.epsilon", self.epsilon, 0.0, low_open=True)


@dataclass(frozen=True)
class RootInvConfig:
    """Base of the methods that compute a factor's inverse root ``(F + εI)^(−1/p)``."""


@dataclass(frozen=True)
class EigenConfig(RootInvConfig):
    """Symmetric eigendecomposition ``F = Q diag(λ) Qᵀ``, then ``Q diag(λ^(−1/p)) Qᵀ``.

    Exact up to rounding and the default: choose it unless the eigendecomposition is
    too slow.  ``retry_double_precision`` repeats a failed decomposition in float64.
    ``pseudo_inverse=True`` treats eigenvalues ``≤ rank_rtol · λ_max`` (default
    ``n · machine epsilon``) as zero and gives them a zero inverse root instead of
    adding ``epsilon``: for factors that are rank deficient by construction (fewer
    samples than the dimension); it requires ``epsilon=0.0``.  For the
    eigenvalue-corrected preconditioner (SOAP), a coordinate whose second moment is
    ``E ≤ rank_rtol² · ΣE`` (the rounding level of the rotated gradient; ``ΣE`` over
    the block) counts as the factors' null space and gets a zero direction (default:
    the block's largest dimension times machine epsilon).
    """

    retry_double_precision: bool = True
    pseudo_inverse: bool = False
    rank_rtol: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.retry_double_precision, bool):
            raise TypeError(
                f"Invalid EigenConfig.retry_double_precision={self.retry_double_precision!r}: "
                "must be True or False."
            )
        if not isinstance(self.pseudo_inverse, bool):
            raise TypeError(
                f"Invalid EigenConfig.pseudo_inverse={self.pseudo_inverse!r}: "
                "must be True or False."
            )
        if self.rank_rtol is not None:
            check_range("EigenConfig.rank_rtol", self.rank_rtol, 0.0, 1.0)


@dataclass(frozen=True)
class CoupledNewtonConfig(RootInvConfig):
    """Coupled inverse Newton iteration: only matrix products, no eigendecomposition.

    ``X ← X·M'``, ``M ← M'^p·M`` with ``M' = (1 − α)I + αM``, ``α = −1/p``, started
    from a scaling that guarantees convergence; it stops when ``‖M − I‖_∞ ≤ tolerance``
    or after ``max_iterations``.  Cheaper than eigh on accelerators for small roots;
    less accurate for ill-conditioned factors.
    """

    max_iterations: int = 100
    tolerance: float = 1e-6

    def __post_init__(self) -> None:
        check_int("CoupledNewtonConfig.max_iterations", self.max_iterations, 1)
        check_range("CoupledNewtonConfig.tolerance", self.tolerance, 0.0, low_open=True)


_CONFIG_CLASSES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (
        SGDGraftingConfig,
        AdaGradGraftingConfig,
        RMSpropGraftingConfig,
        AdamGraftingConfig,
        EigenConfig,
        CoupledNewtonConfig,
        SGDPreconditionerConfig,
        AdaGradPreconditionerConfig,
        RMSpropPreconditionerConfig,
        AdamPreconditionerConfig,
    )
}

#: What ``grafting_config`` takes besides ``None`` (DistributedShampoo's names too).
GRAFTING_CONFIGS = (GraftingConfig, SGDPreconditionerConfig, AdaGradPreconditionerConfig)


def config_to_dict(config: Any) -> dict[str, Any] | None:
    """A plain dictionary (loadable with ``weights_only=True``) describing ``config``."""
    if config is None:
        return None
    return {"type": type(config).__name__, **asdict(config)}


def config_from_dict(data: Any) -> Any:
    """Inverse of :func:`config_to_dict`; anything but a dictionary passes through unchanged."""
    if not isinstance(data, dict):
        return data  # a configuration object, or a bad value that validation will name
    if data.get("type") not in _CONFIG_CLASSES:
        raise ValueError(
            f"cannot rebuild a Shampoo configuration from {data!r}: expected a dictionary "
            f"whose 'type' is one of {sorted(_CONFIG_CLASSES)}"
        )
    cls = _CONFIG_CLASSES[data["type"]]
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


FACTOR_DTYPES = (None, torch.float32, torch.float64)
COMMUNICATION_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a block's step is computed and its state kept in: float32 for half.

    A float16 or bfloat16 factor holds ``GGᵀ`` to 3 or 2 significant digits and its
    inverse root amplifies that error, a half-precision filtered gradient leaves
    rounding noise in the factors' null space for the root to amplify, and float16
    squares underflow below ``|g| ≈ 2.4e-4``: training diverges.  So half-precision
    parameters get float32 state, and only the final direction is rounded to the
    parameter's dtype.
    """
    if param_dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return param_dtype


def factor_dtype(configured: torch.dtype | None, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a block's factors and roots: ``factor_dtype``, else :func:`state_dtype`."""
    return state_dtype(param_dtype) if configured is None else configured


def resolved_start(group: dict[str, Any]) -> int:
    """The group's first preconditioned step: ``None`` or ``-1`` mean its frequency.

    Resolved each time it is read, not stored, so that changing a group's
    ``precondition_frequency`` later moves an unset start along with it.
    """
    start = group["start_preconditioning_step"]
    return group["precondition_frequency"] if start is None or start == -1 else start


def validate_group(group: dict[str, Any]) -> None:
    """Check one parameter group's hyperparameters; raise naming the first bad one."""
    check_range("lr", group["lr"], 0.0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas={betas!r}: must be a pair (beta1, beta2).")
    check_range("betas[0]", betas[0], 0.0, 1.0, high_open=True)
    check_range("betas[1]", betas[1], 0.0, 1.0)
    check_range("momentum", group["momentum"], 0.0, 1.0, high_open=True)
    check_range("dampening", group["dampening"], 0.0, 1.0, high_open=True)
    if not isinstance(group["use_nesterov"], bool):
        raise TypeError(f"Invalid use_nesterov={group['use_nesterov']!r}: must be True or False.")
    if group["use_nesterov"] and (group["momentum"] == 0.0 or group["dampening"] != 0.0):
        raise ValueError(
            f"use_nesterov=True needs momentum > 0 and dampening = 0 (got "
            f"momentum={group['momentum']!r}, dampening={group['dampening']!r}): set "
            "momentum > 0 and dampening=0.0 (torch.optim.SGD requires the same)."
        )
    check_range("weight_decay", group["weight_decay"], 0.0)
    for flag in ("use_decoupled_weight_decay", "use_bias_correction"):
        if not isinstance(group[flag], bool):
            raise TypeError(f"Invalid {flag}={group[flag]!r}: must be True or False.")
    mpd = group["max_preconditioner_dim"]
    if not (mpd == math.inf or (isinstance(mpd, int) and not isinstance(mpd, bool) and mpd >= 1)):
        raise ValueError(
            f"Invalid max_preconditioner_dim={mpd!r}: must be an integer >= 1 or math.inf."
        )
    check_int("precondition_frequency", group["precondition_frequency"], 1)
    start = group["start_preconditioning_step"]
    if start is not None and start != -1:  # None and -1 follow precondition_frequency
        check_int("start_preconditioning_step", start, 1)
    if resolved_start(group) < group["precondition_frequency"]:
        raise ValueError(
            f"Invalid start_preconditioning_step={start!r}: must be >= "
            f"precondition_frequency={group['precondition_frequency']!r} (pass None to start "
            "at the first root computation)."
        )
    check_int(
        "num_tolerated_failed_amortized_computations",
        group["num_tolerated_failed_amortized_computations"],
        0,
    )
    grafting = group["grafting_config"]
    if grafting is not None and not isinstance(grafting, GRAFTING_CONFIGS):
        raise TypeError(
            f"Invalid grafting_config={grafting!r}: must be None or one of SGDGraftingConfig, "
            "AdaGradGraftingConfig, RMSpropGraftingConfig, AdamGraftingConfig, or "
            "DistributedShampoo's SGDPreconditionerConfig, AdaGradPreconditionerConfig, "
            "RMSpropPreconditionerConfig, AdamPreconditionerConfig."
        )
    if group["preconditioner"] not in PRECONDITIONERS:
        raise ValueError(
            f"Invalid preconditioner={group['preconditioner']!r}: must be one of {PRECONDITIONERS}."
        )
    root_inv = group["root_inv_config"]
    if not isinstance(root_inv, RootInvConfig):
        raise TypeError(
            f"Invalid root_inv_config={root_inv!r}: must be EigenConfig(...) or "
            "CoupledNewtonConfig(...)."
        )
    pseudo = isinstance(root_inv, EigenConfig) and root_inv.pseudo_inverse
    if pseudo:
        if group["epsilon"] != 0.0:
            raise ValueError(
                f"Invalid epsilon={group['epsilon']!r}: must be 0.0 with "
                "EigenConfig(pseudo_inverse=True), which drops small eigenvalues instead."
            )
    else:
        check_range("epsilon", group["epsilon"], 0.0, low_open=True)
    if group["factor_dtype"] not in FACTOR_DTYPES:
        raise ValueError(
            f"Invalid factor_dtype={group['factor_dtype']!r}: must be None (the parameter's "
            "dtype, float32 for float16 and bfloat16 parameters), torch.float32 or "
            "torch.float64."
        )
