"""DistributedShampoo's constructor on top of :class:`secondorder.Shampoo`.

Every option is translated into :class:`~secondorder.shampoo.Shampoo`'s, for the
constructor's defaults and for each parameter group's overrides alike:

=====================================  ==================================================
DistributedShampoo                     secondorder.Shampoo
=====================================  ==================================================
``RootInvShampooPreconditionerConfig``  ``preconditioner="root_inverse"``,
``EigendecomposedShampoo...Config``     ``root_inv_config=EigenConfig(...)`` or
                                        ``CoupledNewtonConfig(...)``, ``factor_dtype``
``EigenvalueCorrectedShampoo...Config`` ``preconditioner="eigenvalue_corrected"`` (eigh)
``SGD/AdaGrad/RMSprop/Adam...Config``   ``grafting_config=`` the same config (taken
                                        natively); as ``preconditioner_config``: that
                                        method alone (elementwise: the group's start
                                        and block size, checked, are then replaced by
                                        never and 8, as they change nothing)
``ClassicMomentumConfig``               ``momentum``, ``dampening``, ``use_nesterov``
``WeightDecayType.L2 / DECOUPLED``      ``use_decoupled_weight_decay=False / True``
``start_preconditioning_step=-1``       ``None``
``SingleDeviceDistributedConfig``       one process's optimizer on every rank
``DDPDistributedConfig``                the blocks shared among the default group's
                                        ranks, ``communication_dtype``
``FullyShardDistributedConfig``,        the same config (taken natively): each rank
``HybridShardDistributedConfig``        steps the blocks of its ``fully_shard`` shards
=====================================  ==================================================

Options secondorder does not implement are refused when the optimizer is built, with
the option and the nearest supported choice named: KL-Shampoo, spectral and sign
descent, QR eigenbases, generalized primal averaging and Schedule-Free, the FSDP1
(``FullyShardedDataParallel``) distributors, ``beta3`` other than ``betas[0]``, the
CORRECTED and INDEPENDENT weight decays, trace scaling, per-order exponent overrides,
ignored basis dimensions, dropping the ``1 − β₂`` weight of the Kronecker factors, and
different dtypes for a factor and its root.  ``use_pin_memory``,
``use_symmetric_packing``, ``communicate_params``, ``num_trainers_per_group``,
``load_balancing_config`` and the run-time and concurrency configs are accepted and
change nothing numerical.  The parameter groups hold so.Shampoo's keys (translated
when a group is added), not ``weight_decay_type``, ``iterate_averaging_config``,
``beta3``, ``preconditioner_config`` or ``distributed_config``: one of those set on a
group later is refused at the next step, before it changes anything, with the native
key to set instead (a value that asks for what the group already does passes).  The
state dict is :class:`~secondorder.shampoo.Shampoo`'s
(torch.optim's layout), not DistributedShampoo's.

Its README examples give DistributedShampoo's parameters to 1e-10 in float64, with one
exception: SOAP whose basis is refreshed less often than every step, on a factor of
lower rank than its size (a bias block's in its first steps).  Any basis of the null
space is an exact eigenbasis, and eigh picks one by the factor's last bits, which the
two form in different orders; the later gradients' components there then meet other
second moments.  Both runs are SOAP; they differ by O(lr) from the first step after
such a refresh.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ..._keywords import unknown_keyword_error
from ...shampoo import CoupledNewtonConfig as NativeCoupledNewton
from ...shampoo import EigenConfig as NativeEigen
from ...shampoo import Shampoo
from ...shampoo.distributor import check_distributed_config
from .preconditioner.matrix_functions_types import (
    CoupledHigherOrderConfig,
    CoupledNewtonConfig,
    EigenConfig,
    EighEigendecompositionConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
)
from .refusals import check_later_keys
from .refusals import momentum_options as _momentum
from .refusals import refuse as _refuse
from .shampoo_types import (
    AdaGradPreconditionerConfig,
    ConcurrencyConfig,
    DefaultConcurrencyConfig,
    DefaultShampooConfig,
    DefaultShampooRuntimeConfig,
    DefaultSingleDeviceDistributedConfig,
    DistributedConfig,
    EigendecomposedKLShampooPreconditionerConfig,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    IterateAveragingConfig,
    PreconditionerConfig,
    RootInvKLShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    SGDPreconditionerConfig,
    ShampooPT2CompileConfig,
    ShampooRuntimeConfig,
    SignDescentPreconditionerConfig,
    SpectralDescentPreconditionerConfig,
    WeightDecayType,
)

__all__ = ["DistributedShampoo"]

#: The options a parameter group may override, with DistributedShampoo's defaults.
GROUP_OPTIONS: dict[str, Any] = {
    "lr": 1e-2,
    "betas": (0.9, 1.0),
    "beta3": -1.0,
    "epsilon": 1e-12,
    "weight_decay": 0.0,
    "weight_decay_type": WeightDecayType.DECOUPLED,
    "max_preconditioner_dim": 1024,
    "precondition_frequency": 1,
    "start_preconditioning_step": -1,
    "use_bias_correction": True,
    "iterate_averaging_config": None,
    "grafting_config": None,
    "use_pin_memory": False,
    "distributed_config": DefaultSingleDeviceDistributedConfig,
    "preconditioner_config": DefaultShampooConfig,
}

#: Names of older DistributedShampoo releases and of so.Shampoo, with what to pass here.
KNOWN = {
    "momentum": "pass iterate_averaging_config=ClassicMomentumConfig(momentum=...).",
    "dampening": "pass iterate_averaging_config=ClassicMomentumConfig(dampening=...).",
    "use_nesterov": "pass iterate_averaging_config=ClassicMomentumConfig(use_nesterov=True).",
    "use_decoupled_weight_decay": (
        "pass weight_decay_type=WeightDecayType.DECOUPLED (True) or WeightDecayType.L2 (False)."
    ),
    "precision_config": (
        "pass preconditioner_config=RootInvShampooPreconditionerConfig(factor_matrix_dtype=..., "
        "inv_factor_matrix_dtype=...)."
    ),
    "preconditioner_dtype": (
        "pass preconditioner_config=RootInvShampooPreconditionerConfig(factor_matrix_dtype=...)."
    ),
    "preconditioner_computation_config": (
        "pass preconditioner_config=RootInvShampooPreconditionerConfig("
        "amortized_computation_config=...)."
    ),
    "use_protected_eigh": "pass EigenConfig(retry_double_precision=...) in preconditioner_config.",
    "track_root_inv_residuals": "it is not supported; drop it.",
}
#: secondorder.Shampoo's own names, with what to pass here.
NATIVE = {
    "preconditioner": "pass preconditioner_config=... here.",
    "root_inv_config": "pass preconditioner_config=... here.",
    "factor_dtype": (
        "pass preconditioner_config=RootInvShampooPreconditionerConfig(factor_matrix_dtype=...) "
        "here."
    ),
}
_WHOSE = {
    **{
        k: ("an option of older DistributedShampoo releases that this one does not take", h)
        for k, h in KNOWN.items()
    },
    **{
        k: ("secondorder.Shampoo's option, which DistributedShampoo does not take", h)
        for k, h in NATIVE.items()
    },
}


def _check_options(owner: str, given: Mapping[str, Any], valid: Collection[str]) -> None:
    """Name a keyword that is not DistributedShampoo's: whose it is, or the nearest."""
    for keyword in given:
        if keyword in valid:
            continue
        guess, prefix = keyword, f"{owner} got {keyword!r}, "
        if keyword not in _WHOSE:
            near = difflib.get_close_matches(keyword, [*valid, *_WHOSE], n=1, cutoff=0.6)
            if not near or near[0] in valid:
                raise unknown_keyword_error(owner, keyword, valid)
            guess = near[0]
            prefix = (
                f"{owner} got an unexpected keyword argument {keyword!r} (a typo of {guess!r}?), "
            )
        whose, hint = _WHOSE[guess]
        raise TypeError(f"{prefix}{whose}: {hint}")


#: ``start_preconditioning_step`` of a group that never preconditions.
NEVER = 2**62
#: Block size of a group whose preconditioner_config is a diagonal method: its (unused)
#: factors then cost about twice the parameters' memory.
DIAGONAL_BLOCK = 8


def _grafting(option: str, cfg: Any) -> PreconditionerConfig | None:
    """A diagonal method's config: so.Shampoo takes DistributedShampoo's own."""
    if cfg is None or isinstance(cfg, (SGDPreconditionerConfig, AdaGradPreconditionerConfig)):
        return cfg
    raise _refuse(option, cfg, "AdamPreconditionerConfig(...) or SGDPreconditionerConfig()")


def _stability(option: str, cfg: Any) -> NativeEigen:
    """An eigh-based config's settings as so.Shampoo's EigenConfig."""
    if cfg.tolerance != 0.0:
        raise _refuse(
            f"{option}.tolerance",
            cfg.tolerance,
            "tolerance=0.0",
            "every refresh recomputes the eigendecomposition",
        )
    retry = bool(getattr(cfg, "retry_double_precision", True))
    rds = cfg.rank_deficient_stability_config
    if isinstance(rds, PseudoInverseConfig):
        if rds.rank_atol != 0.0:
            raise _refuse(
                f"{option}.rank_deficient_stability_config.rank_atol",
                rds.rank_atol,
                "rank_atol=0.0 with a relative rank_rtol",
            )
        return NativeEigen(
            retry_double_precision=retry, pseudo_inverse=True, rank_rtol=rds.rank_rtol
        )
    return NativeEigen(retry_double_precision=retry)


def _same_dtypes(option: str, cfg: Any, fields: tuple[str, ...]) -> None:
    for f in fields:
        if getattr(cfg, f) != cfg.factor_matrix_dtype:
            raise _refuse(
                f"{option}.{f}",
                getattr(cfg, f),
                f"{f}={cfg.factor_matrix_dtype} (the factor_matrix_dtype)",
                "secondorder keeps a factor and its root or eigenbasis in one dtype",
            )


def _preconditioner(cfg: Any) -> dict[str, Any]:
    """preconditioner_config as so.Shampoo's options (a diagonal method: grafting alone)."""
    option = "preconditioner_config"
    if isinstance(
        cfg, (RootInvKLShampooPreconditionerConfig, EigendecomposedKLShampooPreconditionerConfig)
    ):
        nearest = type(cfg).__mro__[1].__name__ + "(...)"
        raise _refuse(option, cfg, nearest, "KL-Shampoo is not implemented")
    if isinstance(cfg, SpectralDescentPreconditionerConfig):
        raise _refuse(
            option,
            cfg,
            "RootInvShampooPreconditionerConfig(...)",
            "spectral descent (Muon) is not implemented",
        )
    if isinstance(cfg, SignDescentPreconditionerConfig):
        raise _refuse(
            option, cfg, "AdamPreconditionerConfig(...)", "sign descent is not implemented"
        )
    if isinstance(cfg, (SGDPreconditionerConfig, AdaGradPreconditionerConfig)):
        return {"grafting_config": _grafting(option, cfg), "diagonal": True}
    if not isinstance(
        cfg,
        (
            RootInvShampooPreconditionerConfig,
            EigendecomposedShampooPreconditionerConfig,
            EigenvalueCorrectedShampooPreconditionerConfig,
        ),
    ):
        raise _refuse(option, cfg, "RootInvShampooPreconditionerConfig(...)")
    for f, ok in (("drop_weighting_factor_on_gsquare", False), ("use_trace_scaling", False)):
        if getattr(cfg, f) != ok:
            raise _refuse(f"{option}.{f}", getattr(cfg, f), f"{f}={ok}")
    if cfg.inverse_exponent_override:
        raise _refuse(
            f"{option}.inverse_exponent_override",
            cfg.inverse_exponent_override,
            "{} (the root 1/(2·order) on every dimension)",
        )
    amortized = cfg.amortized_computation_config
    out: dict[str, Any] = {
        "factor_dtype": cfg.factor_matrix_dtype,
        "num_tolerated_failed_amortized_computations": (
            cfg.num_tolerated_failed_amortized_computations
        ),
    }
    where = f"{option}.amortized_computation_config"
    if isinstance(cfg, RootInvShampooPreconditionerConfig):
        _same_dtypes(option, cfg, ("inv_factor_matrix_dtype",))
        if isinstance(amortized, CoupledHigherOrderConfig):
            raise _refuse(where, amortized, "CoupledNewtonConfig(...) or EigenConfig()")
        if isinstance(amortized, CoupledNewtonConfig):
            root: Any = NativeCoupledNewton(
                max_iterations=amortized.max_iterations, tolerance=amortized.tolerance
            )
        elif isinstance(amortized, EigenConfig):
            root = _stability(where, amortized)
        else:
            raise _refuse(where, amortized, "EigenConfig()")
        return {**out, "preconditioner": "root_inverse", "root_inv_config": root}
    if isinstance(amortized, QREigendecompositionConfig):
        nearest = (
            "DefaultEigenvalueCorrectedShampooConfig (eigh)"
            if isinstance(cfg, EigenvalueCorrectedShampooPreconditionerConfig)
            else "EighEigendecompositionConfig()"
        )
        raise _refuse(where, amortized, nearest, "QR eigenbases are not implemented")
    if not isinstance(amortized, EighEigendecompositionConfig):
        raise _refuse(where, amortized, "EighEigendecompositionConfig()")
    root = _stability(where, amortized)
    if isinstance(cfg, EigendecomposedShampooPreconditionerConfig):
        # the same root as RootInv's eigh: only what is cached differs
        _same_dtypes(
            option, cfg, ("factor_matrix_eigenvectors_dtype", "factor_matrix_eigenvalues_dtype")
        )
        return {**out, "preconditioner": "root_inverse", "root_inv_config": root}
    if cfg.ignored_basis_change_dims:
        raise _refuse(f"{option}.ignored_basis_change_dims", cfg.ignored_basis_change_dims, "{}")
    _same_dtypes(option, cfg, ("factor_matrix_eigenvectors_dtype", "corrected_eigenvalues_dtype"))
    return {**out, "preconditioner": "eigenvalue_corrected", "root_inv_config": root}


def check_distributed(cfg: Any) -> None:
    """Refuse a distributed_config secondorder cannot run (so.Shampoo's own check)."""
    check_distributed_config(cfg)


def _whole(x: Any, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _check_unused_blocking(max_dim: Any, start: Any) -> None:
    """The checks so.Shampoo makes, for the values a diagonal method then replaces."""
    if not (max_dim == math.inf or _whole(max_dim, 1)):
        raise ValueError(
            f"Invalid max_preconditioner_dim={max_dim!r}: must be an integer >= 1 or math.inf."
        )
    if not (start == -1 or start == math.inf or _whole(start, 1)):
        raise ValueError(
            f"Invalid start_preconditioning_step={start!r}: must be -1, an integer >= 1 or "
            "math.inf."
        )


def translate(options: dict[str, Any]) -> dict[str, Any]:
    """DistributedShampoo's group options (all of :data:`GROUP_OPTIONS`) as so.Shampoo's."""
    o = options
    betas = o["betas"]
    beta1 = betas[0] if isinstance(betas, (tuple, list)) and betas else None
    if o["beta3"] != -1.0 and o["beta3"] != beta1:
        raise _refuse(
            "beta3",
            o["beta3"],
            "beta3=-1.0 (equal to betas[0])",
            "a separate filter of the current gradient is not implemented",
        )
    wdt = o["weight_decay_type"]
    if wdt not in (WeightDecayType.L2, WeightDecayType.DECOUPLED):
        raise _refuse("weight_decay_type", wdt, "WeightDecayType.DECOUPLED")
    if not isinstance(o["use_pin_memory"], bool):
        raise TypeError(f"Invalid use_pin_memory={o['use_pin_memory']!r}: must be True or False.")
    check_distributed(o["distributed_config"])
    pre = _preconditioner(o["preconditioner_config"])
    diagonal = pre.pop("diagonal", False)
    grafting = _grafting("grafting_config", o["grafting_config"])
    start = o["start_preconditioning_step"]
    max_dim = o["max_preconditioner_dim"]
    if diagonal:
        if o["grafting_config"] is not None:
            raise _refuse(
                "grafting_config",
                o["grafting_config"],
                "grafting_config=None",
                "preconditioner_config is already a diagonal method",
            )
        grafting = pre.pop("grafting_config")
        # Elementwise: blocking and start change nothing, as in DistributedShampoo; a
        # bad value is still refused before both are replaced.
        _check_unused_blocking(max_dim, start)
        start, max_dim = NEVER, DIAGONAL_BLOCK
    elif start == -1:
        start = None
    elif start == math.inf:
        start = NEVER
    return {
        "lr": o["lr"],
        "betas": betas,
        "epsilon": o["epsilon"],
        **_momentum(o["iterate_averaging_config"]),
        "weight_decay": o["weight_decay"],
        "use_decoupled_weight_decay": wdt is WeightDecayType.DECOUPLED,
        "max_preconditioner_dim": max_dim,
        "precondition_frequency": o["precondition_frequency"],
        "start_preconditioning_step": start,
        "use_bias_correction": o["use_bias_correction"],
        "grafting_config": grafting,
        **pre,
    }


class DistributedShampoo(Shampoo):
    """DistributedShampoo (facebookresearch/optimizers) run by :class:`secondorder.Shampoo`.

    Takes DistributedShampoo's constructor and config dataclasses unchanged; see the
    module docstring for the mapping and for what is refused.  Parameter groups may
    override any of :data:`GROUP_OPTIONS` by DistributedShampoo's names.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        beta3: float = -1.0,
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        weight_decay_type: WeightDecayType = WeightDecayType.DECOUPLED,
        max_preconditioner_dim: int | float = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | float = -1,
        use_bias_correction: bool = True,
        iterate_averaging_config: IterateAveragingConfig | None = None,
        grafting_config: PreconditionerConfig | None = None,
        use_pin_memory: bool = False,
        shampoo_pt2_compile_config: ShampooPT2CompileConfig | None = None,
        distributed_config: DistributedConfig = DefaultSingleDeviceDistributedConfig,
        preconditioner_config: PreconditionerConfig = DefaultShampooConfig,
        shampoo_runtime_config: ShampooRuntimeConfig = DefaultShampooRuntimeConfig,
        concurrency_config: ConcurrencyConfig = DefaultConcurrencyConfig,
        **unknown: Any,
    ) -> None:
        _check_options("DistributedShampoo", unknown, _KEYWORDS)
        if shampoo_pt2_compile_config is not None:
            raise _refuse(
                "shampoo_pt2_compile_config",
                shampoo_pt2_compile_config,
                "None",
                "the step runs eagerly",
            )
        if not isinstance(shampoo_runtime_config, ShampooRuntimeConfig):
            raise TypeError(f"Invalid shampoo_runtime_config={shampoo_runtime_config!r}.")
        if not isinstance(concurrency_config, ConcurrencyConfig):
            raise TypeError(f"Invalid concurrency_config={concurrency_config!r}.")
        self._reference_defaults = {
            "lr": lr, "betas": betas, "beta3": beta3, "epsilon": epsilon,
            "weight_decay": weight_decay, "weight_decay_type": weight_decay_type,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "use_bias_correction": use_bias_correction,
            "iterate_averaging_config": iterate_averaging_config,
            "grafting_config": grafting_config, "use_pin_memory": use_pin_memory,
            "distributed_config": distributed_config,
            "preconditioner_config": preconditioner_config,
        }  # fmt: skip
        native = translate(self._reference_defaults)
        super().__init__(params, **native, distributed_config=distributed_config)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group given by DistributedShampoo's option names (checked before it is added)."""
        overrides = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
        _check_options("DistributedShampoo parameter group", overrides, GROUP_OPTIONS)
        if "distributed_config" in overrides and (
            overrides["distributed_config"] != self._reference_defaults["distributed_config"]
        ):
            raise ValueError(
                "DistributedShampoo: a parameter group's distributed_config must equal the "
                "constructor's (secondorder distributes every group the same way)"
            )
        native = translate({**self._reference_defaults, **overrides})
        group = {k: v for k, v in param_group.items() if k in ("params", "param_names")}
        super().add_param_group({**group, **native})

    def _normalize(self, group: dict[str, Any]) -> None:  # type: ignore[override]
        # Run on every group before each step changes anything (see refusals.py).
        super()._normalize(group)
        check_later_keys(group, self.param_groups)


_KEYWORDS = [
    name
    for name in inspect.signature(DistributedShampoo.__init__).parameters
    if name not in ("self", "params", "unknown")
]
