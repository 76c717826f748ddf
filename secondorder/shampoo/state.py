"""State-dict conversion and validation for :class:`~secondorder.shampoo.Shampoo`.

Configs are saved as plain dicts (so ``weights_only=True`` loads them), each rank
saves the blocks it owns, and floating state is restored without dtype casts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from ..distributed import Reducer
from .config import config_from_dict, config_to_dict, validate_group
from .groups import normalize_group

__all__ = [
    "check_saved_rank",
    "configs_to_dicts",
    "ensure_int64_steps",
    "restored_state",
    "validated_groups",
]


def configs_to_dicts(sd: dict[str, Any], reducer: Reducer) -> dict[str, Any]:
    """Turn ``sd``'s configs into plain dicts and record the saving rank, in place."""
    for g in sd["param_groups"]:
        g["grafting_config"] = config_to_dict(g["grafting_config"])
        g["root_inv_config"] = config_to_dict(g["root_inv_config"])
    sd["shampoo"] = {
        "rank": reducer.rank,
        "world_size": reducer.world_size,
    }
    return sd


def check_saved_rank(state_dict: dict[str, Any], reducer: Reducer) -> None:
    """Refuse a state dict saved by another rank or world size (pre-metadata: rank 0 of 1)."""
    meta = state_dict.get("shampoo", {"rank": 0, "world_size": 1})
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
        p = id_to_param[pid]
        state[p] = {k: v.detach().clone().to(p.device) for k, v in pstate.items()}
    return state


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
                state[p]["step"] = torch.tensor(count, dtype=torch.int64)
