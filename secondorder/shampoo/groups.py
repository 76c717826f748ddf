"""Parameter groups of :class:`~secondorder.shampoo.Shampoo`: normalizing, naming, layout.

A group's settings decide the preconditioner of its blocks and the layout of their
state (:data:`STRUCTURAL`); the functions here read a group and never change state.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from .._keywords import unknown_keyword_error
from .config import EigenConfig, config_from_dict
from .grafting import grafting_has_state
from .preconditioner import (
    EigenvalueCorrectedPreconditioner,
    Preconditioner,
    RootInversePreconditioner,
)

__all__ = [
    "REFERENCE_OPTIONS",
    "STRUCTURAL",
    "block_name",
    "check_float_params",
    "check_group_keys",
    "factored_layout",
    "make_preconditioner",
    "normalize_group",
    "structure",
]

STRUCTURAL = ("max_preconditioner_dim", "preconditioner", "factor_dtype")

_COMPAT = "secondorder.compat.distributed_shampoo.DistributedShampoo takes it unchanged"

#: DistributedShampoo's options that so.Shampoo does not take, each with what to do.
REFERENCE_OPTIONS = {
    "preconditioner_config": (
        "pass preconditioner='root_inverse' (Shampoo) or 'eigenvalue_corrected' (SOAP) with "
        f"root_inv_config=EigenConfig(...) and factor_dtype=...; {_COMPAT}."
    ),
    "iterate_averaging_config": (
        "pass ClassicMomentumConfig's fields as momentum=, dampening=, use_nesterov=; "
        "averaged iterates (Schedule-Free, primal averaging) are not implemented."
    ),
    "weight_decay_type": (
        "pass use_decoupled_weight_decay=True (WeightDecayType.DECOUPLED) or False (L2)."
    ),
    "beta3": "the gradient filter is betas[0]; a separate beta3 is not implemented.",
    "use_pin_memory": "drop it (no effect here).",
    "shampoo_pt2_compile_config": "drop it: the step runs eagerly.",
    "shampoo_runtime_config": "drop it: every gradient is checked for NaN and Inf anyway.",
    "concurrency_config": "drop it (no effect here).",
    "precision_config": "pass factor_dtype=...",
    "preconditioner_dtype": "pass factor_dtype=...",
    "use_protected_eigh": "pass root_inv_config=EigenConfig(retry_double_precision=...).",
    "track_root_inv_residuals": "it is not supported; drop it.",
}


def check_group_keys(group: dict[str, Any], valid: Iterable[str]) -> None:
    """Refuse a group key that is DistributedShampoo's unsupported option or a typo.

    Other keys pass, as ``torch.optim`` lets them (a group's ``"name"``, a scheduler's
    ``"initial_lr"``): only a near miss of a hyperparameter is taken for a typo.
    """
    valid = set(valid) | {"params", "param_names"}
    for key in group:
        if key in valid:
            continue
        if key in REFERENCE_OPTIONS or difflib.get_close_matches(key, valid, n=1, cutoff=0.8):
            raise unknown_keyword_error(
                "so.Shampoo parameter group", key, valid, REFERENCE_OPTIONS, "DistributedShampoo"
            )


def structure(group: dict[str, Any]) -> tuple[Any, ...]:
    """What fixes the layout of the state: changing it after the first step is an error."""
    return (
        *(group[k] for k in STRUCTURAL),
        group["betas"][0] != 0.0,
        group["momentum"] != 0.0,
        grafting_has_state(group["grafting_config"]),
    )


def normalize_group(group: dict[str, Any]) -> None:
    """Betas as a tuple and the configs as objects (a loaded state dict holds dicts)."""
    if isinstance(group["betas"], list):
        group["betas"] = tuple(group["betas"])
    group["grafting_config"] = config_from_dict(group["grafting_config"])
    group["root_inv_config"] = config_from_dict(group["root_inv_config"])


def check_float_params(params: Iterable[Any]) -> None:
    """Refuse a parameter that is not floating point (``(name, parameter)`` pairs too)."""
    for q in params:
        q = q[1] if isinstance(q, tuple) else q  # (name, parameter) pairs
        if isinstance(q, Tensor) and not q.is_floating_point():
            raise TypeError(
                f"Shampoo optimizes floating-point parameters; got one of dtype {q.dtype} "
                f"and shape {tuple(q.shape)}"
            )


def block_name(
    param_groups: list[dict[str, Any]], group_index: int, param_index: int, p: Tensor
) -> str:
    """How error messages name a parameter: by ``param_names`` if given, else by index."""
    names = param_groups[group_index].get("param_names")
    if names is not None:
        return f"parameter {names[param_index]!r} (shape {tuple(p.shape)})"
    return (
        f"parameter param_groups[{group_index}]['params'][{param_index}] (shape {tuple(p.shape)})"
    )


def make_preconditioner(
    group: dict[str, Any], shape: tuple[int, ...], factored: tuple[bool, ...] = ()
) -> Preconditioner:
    """The group's preconditioner (root-inverse or eigenvalue-corrected) for one shape."""
    cls = (
        RootInversePreconditioner
        if group["preconditioner"] == "root_inverse"
        else EigenvalueCorrectedPreconditioner
    )
    return cls(
        shape=shape,
        beta2=float(group["betas"][1]),
        epsilon=float(group["epsilon"]),
        use_bias_correction=group["use_bias_correction"],
        root_inv_config=group["root_inv_config"],
        factored=factored,
    )


def factored_layout(
    group: dict[str, Any], shape: tuple[int, ...], entry: str, saved: dict[str, Any]
) -> tuple[bool, ...]:
    """Which factors keep their root as ``D`` (root ``DᵀD``): see ``preconditioner``.

    Factored when ``precondition_frequency · m < d`` (``m`` = block size / ``d``) and
    the roots come from eigh.  A saved state's layout (``saved``, the state of the
    batch's first parameter; ``entry``, its first block's prefix) wins, so a state dict loads
    whatever the frequency is now; the layout never changes the math.
    """
    if group["preconditioner"] != "root_inverse":
        return tuple(False for _ in shape)
    out = []
    for k, d in enumerate(shape):
        if f"{entry}.root_factor{k}" in saved:
            out.append(True)
        elif f"{entry}.root{k}" in saved:
            out.append(False)
        else:
            m = math.prod(shape) // d
            out.append(
                isinstance(group["root_inv_config"], EigenConfig)
                and group["precondition_frequency"] * m < d
            )
    return tuple(out)
