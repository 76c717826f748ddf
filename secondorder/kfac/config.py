"""Typed, validated, frozen configuration of :class:`~secondorder.kfac.KFAC`.

Every hyperparameter that KAISA lets vary with the step (``damping``, ``factor_decay``,
``kl_clip``, ``lr``, ``factor_update_steps``, ``inv_update_steps``) may be a number or a
callable of the step count; a constant is checked when the config is built, a callable
each time it is read (:meth:`KFACConfig.at`), with the same message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from .._validation import check_integer, check_number
from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, choice

__all__ = [
    "ASSIGNMENT_STRATEGIES",
    "COMPUTE_METHODS",
    "KAISA_OPTIONS",
    "LOSS_REDUCTIONS",
    "KFACConfig",
    "Schedule",
]

COMPUTE_METHODS = ("eigen", "inverse")
ASSIGNMENT_STRATEGIES = ("compute", "memory")
LOSS_REDUCTIONS = ("mean", "sum")
#: Named strategies accepted for ``grad_worker_fraction`` (HYBRID-OPT is a number).
STRATEGY_NAMES = ("comm-opt", "mem-opt")
#: kfac-pytorch's DistributedStrategy as ``grad_worker_fraction`` (HYBRID_OPT is its 1/2).
STRATEGY_VALUES: dict[str, float | str] = {
    "comm_opt": "comm-opt",
    "mem_opt": "mem-opt",
    "hybrid_opt": 0.5,
}

_NOTHING = "it changes nothing here ({why}); drop it, or keep it with secondorder.compat.kfac."
#: kfac-pytorch's options that :class:`~secondorder.kfac.KFAC` does not take, each with
#: what to do instead (the message of an unknown keyword quotes it).
KAISA_OPTIONS = {
    "allreduce_bucket_cap_mb": _NOTHING.format(why="all factors of a step travel in one call"),
    "colocate_factors": _NOTHING.format(why="one rank decomposes both factors of a layer"),
    "compute_eigenvalue_outer_product": _NOTHING.format(
        why="the damped outer product of the eigenvalues is always kept"
    ),
    "update_factors_in_hook": _NOTHING.format(why="the factors are updated in step()"),
    "loglevel": _NOTHING.format(why="nothing is logged; print(kfac) lists the layers"),
    "assignment": "pass assignment_strategy='compute' or 'memory' instead of a WorkAssignment.",
    "tdc": "communication goes through reducer= or process_group=; drop it.",
    "defaults": "it is bookkeeping of kfac-pytorch's base class; drop it.",
    "data_parallel_group": "pass process_group= (model parallelism is not supported).",
    "model_parallel_group": "model parallelism is not supported; use DDP or fully_shard.",
    "pipeline_parallel_group": "pipeline parallelism is not supported; use DDP or fully_shard.",
    "factor_checkpoint_dir": "save state_dict() with torch.save or torch.distributed.checkpoint.",
}
#: How messages name kfac-pytorch.
KAISA = "kfac-pytorch (KAISA)"

#: A number, or a function of the step count returning one.
Schedule = float | int | Callable[[int], Any]


#: What a scheduled hyperparameter accepts besides a number (the messages add it).
_SCHEDULED = ", or a callable of the step"


def check_damping(value: object) -> float:
    """``damping`` must be a finite number > 0 (λ is added to eigenvalues that may be 0)."""
    return check_number("damping", value, above=0, also=_SCHEDULED)


def check_factor_decay(value: object) -> float:
    """``factor_decay`` in [0, 1): 0 keeps only the newest factor, 1 would never update."""
    return check_number("factor_decay", value, at_least=0, below=1, also=_SCHEDULED)


def check_kl_clip(value: object) -> float | None:
    """``kl_clip`` is None (no clipping) or a finite number > 0."""
    if value is None:
        return None
    return check_number("kl_clip", value, above=0, also=", None (no clipping) or a callable")


def check_lr(value: object) -> float:
    """``lr`` (used only by the KL clip) is a finite number >= 0, as ``torch.optim``'s.

    A schedule may bring it to 0 (``CosineAnnealingLR(eta_min=0)``): the step is then
    0 and nothing is clipped.
    """
    return check_number("lr", value, at_least=0, also=_SCHEDULED)


def check_steps(name: str, value: object) -> int:
    """An update interval: an integer >= 1."""
    check_integer(name, value)
    assert isinstance(value, int)
    return value


_CHECKS: dict[str, Callable[[object], Any]] = {
    "damping": check_damping,
    "factor_decay": check_factor_decay,
    "kl_clip": check_kl_clip,
    "lr": check_lr,
    "factor_update_steps": lambda v: check_steps("factor_update_steps", v),
    "inv_update_steps": lambda v: check_steps("inv_update_steps", v),
}


def _float_dtype(name: str, value: object, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        what = "None or a floating torch.dtype" if allow_none else "a floating torch.dtype"
        raise ValueError(f"Invalid {name}={value!r}: must be {what} such as torch.float32.")


@dataclass(frozen=True)
class KFACConfig:
    """Every setting of :class:`~secondorder.kfac.KFAC`, checked at construction.

    Attributes:
        factor_update_steps: steps between updates of the factors A and G.
        inv_update_steps: steps between eigendecompositions (or inversions).
        damping: λ of ``(A ⊗ G + λI)⁻¹`` (eigen) or ``(A+λI)⁻¹ ⊗ (G+λI)⁻¹`` (inverse).
        factor_decay: weight of the old factor in ``F ← decay·F + (1-decay)·F_batch``.
        kl_clip: bound on ``lr²⟨P, ∇⟩`` (None: no clipping).
        lr: the learning rate the KL clip assumes (0: no clipping).
        accumulation_steps: micro-batches per optimizer step (each loss divided by it).
        compute_method: ``"eigen"`` or ``"inverse"`` (or kfac-pytorch's
            ``ComputeMethod``, see :mod:`secondorder.kfac.enums`).  Inverse is about half the cost
            per step and a small fraction per decomposition (Cholesky against eigh);
            with ``inv_update_steps`` small it keeps a factor as its Cholesky factor and
            solves instead of forming the inverse (same result up to rounding).
        factor_dtype: dtype of A and G (None: the parameter's, but float32 for float16
            and bfloat16 parameters, whose range the sums of squares would overflow).
        inv_dtype: dtype of the eigendecomposition or inverse.
        skip_layers: module names or class names (case-insensitive) left unpreconditioned.
        grad_worker_fraction: share of ranks that precondition each layer: 1 or
            ``"comm-opt"``, ``1/world`` or ``"mem-opt"``, anything between is HYBRID-OPT
            (``"hybrid-opt"`` is 1/2); a ``DistributedStrategy`` is read the same way.
        assignment_strategy: ``"compute"`` (balance n³) or ``"memory"`` (balance n²),
            or an ``AssignmentStrategy``.
        symmetry_aware: all-reduce only the upper triangles of A and G.
        loss_reduction: ``"mean"`` (loss averaged over the local micro-batch) or
            ``"sum"``; decides how per-sample gradients are recovered.
    """

    factor_update_steps: Any = 1
    inv_update_steps: Any = 1
    damping: Any = 1e-3
    factor_decay: Any = 0.95
    kl_clip: Any = 1e-3
    lr: Any = 0.1
    accumulation_steps: int = 1
    compute_method: str = "eigen"
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype = torch.float32
    skip_layers: tuple[str, ...] = field(default_factory=tuple)
    grad_worker_fraction: float | str = 1.0
    assignment_strategy: str = "compute"
    symmetry_aware: bool = False
    loss_reduction: str = "mean"

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            value = getattr(self, name)
            if not callable(value):
                check(value)
        check_steps("accumulation_steps", self.accumulation_steps)
        # kfac-pytorch's enums and spellings, stored as the lower-case names
        set_ = object.__setattr__
        set_(self, "compute_method", choice("compute_method", ComputeMethod, self.compute_method))
        set_(
            self,
            "assignment_strategy",
            choice("assignment_strategy", AssignmentStrategy, self.assignment_strategy),
        )
        if isinstance(self.grad_worker_fraction, (str, Enum)):
            try:
                name = choice(
                    "grad_worker_fraction", DistributedStrategy, self.grad_worker_fraction
                )
            except ValueError as exc:
                raise ValueError(f"{exc} A number in (0, 1] is a HYBRID-OPT fraction.") from None
            set_(self, "grad_worker_fraction", STRATEGY_VALUES[name])
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"Unknown loss_reduction={self.loss_reduction!r}; valid choices are "
                f"{LOSS_REDUCTIONS}."
            )
        _float_dtype("factor_dtype", self.factor_dtype, allow_none=True)
        _float_dtype("inv_dtype", self.inv_dtype, allow_none=False)
        if self.inv_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"Invalid inv_dtype={self.inv_dtype!r}: the eigendecomposition and Cholesky "
                "factorisation need torch.float32 or torch.float64 (half precision has "
                "no eigh or Cholesky); the gradients may stay in half precision."
            )
        if isinstance(self.skip_layers, str) or not all(
            isinstance(s, str) for s in self.skip_layers
        ):
            raise TypeError(
                f"Invalid skip_layers={self.skip_layers!r}: must be a list of module names or "
                "class names, e.g. ['fc3', 'Embedding']."
            )
        f = self.grad_worker_fraction
        if isinstance(f, str):
            assert f in STRATEGY_NAMES
        elif isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(
                f"Invalid grad_worker_fraction={f!r}: must be a number in (0, 1] "
                "(1 = COMM-OPT, 1/world = MEM-OPT) or one of " + repr(STRATEGY_NAMES) + "."
            )
        if not isinstance(self.symmetry_aware, bool):
            raise TypeError(f"Invalid symmetry_aware={self.symmetry_aware!r}: must be a bool.")

    def at(self, name: str, step: int) -> Any:
        """The value of hyperparameter ``name`` at ``step``, checked if it is a callable's."""
        value = getattr(self, name)
        if callable(value):
            try:
                return _CHECKS[name](value(step))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc} (returned by the callable {name} at step {step})") from exc
        return _CHECKS[name](value)

    def grad_workers(self, world_size: int) -> int:
        """Ranks that precondition each layer: ``round(world · grad_worker_fraction)``."""
        f = self.grad_worker_fraction
        if f == "comm-opt":
            return world_size
        if f == "mem-opt":
            return 1
        assert isinstance(f, (int, float))
        k = max(1, round(world_size * f))
        if world_size % k:
            raise ValueError(
                f"Invalid grad_worker_fraction={f!r} for {world_size} ranks: it gives {k} "
                f"gradient workers per layer, which must divide the world size; choose "
                f"k/{world_size} with k a divisor of {world_size}."
            )
        return k
