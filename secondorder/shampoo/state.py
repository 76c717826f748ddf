"""State-dict conversion and validation for :class:`~secondorder.shampoo.Shampoo`.

Configs are saved as plain dicts (so ``weights_only=True`` loads them), each rank
saves the blocks it owns, and floating state is restored without dtype casts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..distributed import Reducer
from .config import config_from_dict, config_to_dict, validate_group
from .groups import normalize_group

__all__ = [
    "check_entry",
    "check_saved_layout",
    "check_saved_rank",
    "check_saved_shapes",
    "configs_to_dicts",
    "ensure_int64_steps",
    "restored_state",
    "validated_groups",
]


def configs_to_dicts(
    sd: dict[str, Any], reducer: Reducer, param_groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """Turn ``sd``'s configs into plain dicts, record the saving rank and shapes, in place.

    The shapes are the parameters' (``param_groups``), by group: blocks of the same
    shape come from parameters of other shapes too (a ``(4, 3)`` and a ``(3, 4)``
    weight both become one ``(12,)`` block), so only they tell the models apart.
    """
    for g in sd["param_groups"]:
        g["grafting_config"] = config_to_dict(g["grafting_config"])
        g["root_inv_config"] = config_to_dict(g["root_inv_config"])
    sd["shampoo"] = {
        "rank": reducer.rank,
        "world_size": reducer.world_size,
        "shapes": _shapes(param_groups),
    }
    return sd


def _shapes(param_groups: list[dict[str, Any]]) -> list[list[list[int]]]:
    return [[list(p.shape) for p in g["params"]] for g in param_groups]


def check_saved_shapes(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Refuse a state dict saved for parameters of other shapes (if it records them).

    Group and parameter counts are left to torch's loader, which names them.
    """
    saved = state_dict.get("shampoo", {}).get("shapes")
    if saved is None:  # saved before the shapes were recorded, or by DCP
        return
    for gi, (was, now) in enumerate(zip(saved, _shapes(param_groups), strict=False)):
        for pi, (a, b) in enumerate(zip(was, now, strict=False)):
            if list(a) != b:
                raise ValueError(
                    f"the state dict was saved for a param_groups[{gi}]['params'][{pi}] of "
                    f"shape {tuple(a)}, but this optimizer's has shape {tuple(b)}: it belongs "
                    "to another model (or the parameters are in another order); nothing "
                    "was loaded."
                )


def check_saved_layout(state_dict: Any, defaults: Sequence[str]) -> None:
    """Refuse what is not a Shampoo state dict, naming what it lacks and holds instead."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        shown = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"Invalid state_dict (keys {shown}): must be a dict with 'state' and "
            "'param_groups', as Shampoo.state_dict() returns."
        )
    for gi, g in enumerate(state_dict["param_groups"]):
        missing = [k for k in defaults if k not in g]
        if missing:
            extra = sorted(k for k in g if k not in defaults and k != "params")
            raise ValueError(
                f"this is not a Shampoo state dict: its param_groups[{gi}] lacks {missing} "
                f"and holds {extra}; it was saved by another optimizer (torch.optim.Adam's "
                "looks like this). Load a state dict saved by Shampoo.state_dict(), or "
                "start this optimizer fresh; nothing was loaded."
            )


def check_saved_rank(state_dict: dict[str, Any], reducer: Reducer, sharded: bool = False) -> None:
    """Refuse a state dict saved by another rank or world size (pre-metadata: rank 0 of 1).

    ``sharded`` (DTensor parameters): a state dict without the record passes, as
    ``torch.distributed.checkpoint`` keeps only ``state`` and ``param_groups``; its block
    entries are named by rank (``rank{r}.block{i}``) and checked when bound.
    """
    if sharded and "shampoo" not in state_dict:
        return
    saved = state_dict.get("shampoo", {"rank": 0, "world_size": 1})
    meta = {"rank": saved.get("rank"), "world_size": saved.get("world_size")}
    here = {"rank": reducer.rank, "world_size": reducer.world_size}
    if meta != here:
        raise ValueError(
            f"this state dict was saved by rank {meta['rank']} of {meta['world_size']}, "
            f"but this optimizer is rank {here['rank']} of {here['world_size']}: load "
            "each rank's own file into a run with the same world size."
        )


def validated_groups(saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the saved groups with configs as objects, each validated."""
    groups = [dict(g) for g in saved_groups]
    for g in groups:
        g["grafting_config"] = config_from_dict(g.get("grafting_config"))
        g["root_inv_config"] = config_from_dict(g.get("root_inv_config"))
        normalize_group(g)
        validate_group(g)
    return groups


def restored_state(
    state_dict: dict[str, Any],
    saved_groups: list[dict[str, Any]],
    param_groups: list[dict[str, Any]],
) -> defaultdict[Tensor, dict[str, Any]]:
    """The saved per-parameter state keyed by this optimizer's parameters, uncast.

    Torch's loader would cast floating state to the parameter's dtype (a float64
    factor of a float32 parameter would lose bits), so the tensors are only cloned
    and moved to the parameter's device.
    """
    id_to_param = {
        pid: p
        for sg, g in zip(saved_groups, param_groups, strict=True)
        for pid, p in zip(sg["params"], g["params"], strict=True)
    }
    state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    for pid, pstate in state_dict["state"].items():
        if pid not in id_to_param:
            raise ValueError(
                f"the saved state holds parameter id {pid!r}, which no saved param_group "
                "lists; the state dict is corrupt; nothing was loaded."
            )
        p = id_to_param[pid]
        for k, v in pstate.items():
            if not isinstance(v, Tensor) or v.is_meta:
                got = "a meta tensor" if isinstance(v, Tensor) else type(v).__name__
                raise TypeError(
                    f"Invalid saved state {k!r} of parameter id {pid}: must be a tensor "
                    f"with data, got {got}; nothing was loaded."
                )
        # The step count stays on the CPU (as a step keeps it): reading it waits for no device.
        state[p] = {
            k: v.detach().clone().to("cpu" if k == "step" else p.device) for k, v in pstate.items()
        }
    _check_steps(state, param_groups)
    return state


def _check_steps(state: Any, param_groups: list[dict[str, Any]]) -> None:
    """Every saved step count is a whole number >= 0, one count per group."""
    for gi, group in enumerate(param_groups):
        counts = set()
        for p in group["params"]:
            step = state[p].get("step") if p in state else None
            if step is None:
                continue
            value = float(step.item()) if step.numel() == 1 else float("nan")
            if not (math.isfinite(value) and value >= 0 and value == int(value)):
                raise ValueError(
                    f"Invalid saved step={step.tolist()!r} in param_groups[{gi}]: must be a "
                    "whole number >= 0 (the count of steps taken); nothing was loaded."
                )
            counts.add(int(value))
        if len(counts) > 1:
            raise ValueError(
                f"the saved step counts of param_groups[{gi}] differ ({sorted(counts)}): a "
                "group's parameters step together, so the state dict is corrupt; nothing "
                "was loaded."
            )


# The entries that hold sums or averages of squares: negative values are impossible.
_NON_NEGATIVE = ("corrected_eigenvalues", "grafting_state", "failed_amortized_computations")


def check_entry(entry: str, name: str, saved: Tensor, buf: Tensor) -> None:
    """Refuse a saved block entry of the wrong shape, a lossy dtype or impossible values.

    ``buf`` is the (stacked) buffer row it will be copied into.  Floating entries must be
    finite; second moments and failure counts non-negative; a factor's diagonal
    non-negative and its off-diagonal within the diagonal's bound (it is a sum of
    ``GGᵀ``).  An upcast (a bfloat16 factor into float32) is exact and allowed.
    """
    where = f"the saved state {entry!r} of {name}"
    if saved.shape != buf.shape:
        raise ValueError(
            f"{where} has shape {tuple(saved.shape)}, expected {tuple(buf.shape)}: it was "
            "saved with other max_preconditioner_dim or parameters"
        )
    if saved.dtype != buf.dtype and (
        saved.is_floating_point() != buf.is_floating_point()
        or torch.promote_types(saved.dtype, buf.dtype) != buf.dtype
    ):
        raise ValueError(
            f"{where} has dtype {saved.dtype}, which {buf.dtype} cannot hold exactly: it was "
            "saved with another factor_dtype or parameter dtype; build the optimizer with the "
            "saved one (or load it into the same model); nothing was loaded."
        )
    if saved.is_floating_point() and saved.numel() and not bool(torch.isfinite(saved).all()):
        raise ValueError(
            f"{where} holds NaN or Inf: the checkpoint is corrupt; nothing was loaded."
        )
    key = entry.rsplit(".", 1)[1]
    if key.startswith("factor"):
        values, what = saved.diagonal(), "a diagonal entry below 0 (a factor is a sum of GGᵀ)"
    elif key in _NON_NEGATIVE:
        values, what = saved, "values below 0 (it is a sum of squares or a count)"
    else:
        return
    if values.numel() and bool((values < 0).any()):
        raise ValueError(f"{where} holds {what}: the checkpoint is corrupt; nothing was loaded.")
    if key.startswith("factor") and saved.numel():
        _check_two_by_two_minors(where, saved)


def _check_two_by_two_minors(where: str, F: Tensor) -> None:
    """Refuse ``F_ij² > F_ii·F_jj·(1 + n·eps)``: a 2x2 principal minor of a sum of ``GGᵀ``.

    A necessary condition for positive semidefiniteness, O(n²) (a full test would be an
    eigendecomposition per factor): it catches a flipped or scaled off-diagonal entry.
    ``n·eps`` allows the rounding of a factor at the bound (gradients along one
    direction).  Compared in float64 as ``|F_ij| ≤ √F_ii·√F_jj·(1 + (n + 4)·eps)``,
    which no square can overflow and the check's own rounding cannot tip.
    """
    n = F.shape[-1]
    slack = 1.0 + (n + 4) * torch.finfo(F.dtype).eps
    root = F.diagonal().double().sqrt()
    excess = F.double().abs() - root[:, None] * root[None, :] * slack
    excess.diagonal().fill_(-math.inf)
    if bool((excess > 0).any()):
        i, j = divmod(int(excess.argmax()), n)
        raise ValueError(
            f"{where} is not positive semidefinite: |F[{i}, {j}]| = {float(F[i, j].abs()):.6g} "
            f"exceeds √(F[{i}, {i}]·F[{j}, {j}]) = {float(root[i] * root[j]):.6g} (a factor is "
            "a sum of GGᵀ): the checkpoint is corrupt; nothing was loaded."
        )


def ensure_int64_steps(param_groups: list[dict[str, Any]], state: Any) -> None:
    """Give every parameter an int64 ``step`` count (0 if none, converted if float)."""
    for group in param_groups:
        for p in group["params"]:
            # An int64 count: a float32 one stops at 2²⁴ (2²⁴ + 1 rounds back), and the
            # roots would then never refresh again.  Older state dicts saved a float
            # counter, exact below 2²⁴: converted here.
            step = state[p].get("step")
            if step is None or step.dtype != torch.int64:
                count = 0 if step is None else int(step.item())
                state[p]["step"] = torch.tensor(count, dtype=torch.int64, device="cpu")
