"""What the ranks of a data-parallel Shampoo agree on before any of them changes state.

Each rank owns some blocks, so a check that fails on one rank (a gradient that
would overflow its factors, a root that failed too often) is invisible to the
others.  Every step therefore sends a small float64 *tally* with the directions'
all-gather: a failure flag, which parameters have a gradient, and per group the
learning rate, the step count and a fingerprint of the other hyperparameters.
Every rank reads every tally and decides the same way: all commit, or all raise
(the rank that failed with its own error, the others with
:class:`~secondorder.RankFailedError`), and nothing changed anywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..distributed import RankFailedError, Reducer
from .groups import block_name

__all__ = [
    "agree_refusal",
    "agreed_settings",
    "check_tallies",
    "group_settings",
    "header_bytes",
    "step_tally",
]

_UNCHANGED = "no rank changed its parameters or optimizer state"


def group_settings(group: dict[str, Any]) -> dict[str, str]:
    """A group's hyperparameters other than its parameters and ``lr``, as reprs."""
    return {k: repr(v) for k, v in group.items() if k not in ("params", "lr")}


def agreed_settings(
    param_groups: list[dict[str, Any]], communication_dtype: torch.dtype | None
) -> dict[str, Any]:
    """What every rank's Shampoo must hold alike when it builds its state.

    The parameters' shapes, every group's :func:`group_settings` (``lr``, which a
    scheduler changes, is compared by each step's tally) and the communication dtype.
    """
    return {
        "params": [[tuple(p.shape) for p in g["params"]] for g in param_groups],
        "param_groups": [group_settings(g) for g in param_groups],
        "communication_dtype": repr(communication_dtype),
    }


def _fingerprint(group: dict[str, Any]) -> float:
    """48 bits of a hash of :func:`group_settings`: exact in float64."""
    text = repr(sorted(group_settings(group).items())).encode()
    return float(int.from_bytes(hashlib.sha256(text).digest()[:6], "big"))


def _real(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def step_tally(
    param_groups: list[dict[str, Any]], counts: Sequence[int], failed: bool, device: torch.device
) -> Tensor:
    """``[failed, has-gradient per parameter, (lr, step count, fingerprint) per group]``."""
    values = [1.0 if failed else 0.0]
    values += [float(p.grad is not None) for g in param_groups for p in g["params"]]
    for group, count in zip(param_groups, counts, strict=True):
        values += [_real(group["lr"]), float(count), _fingerprint(group)]
    return torch.tensor(values, dtype=torch.float64, device=device)


def header_bytes(n_params: int, n_groups: int) -> int:
    """Bytes each rank adds to a step's all-gather: the direction count and the tally."""
    return 8 * (1 + 1 + n_params + 3 * n_groups)


def _by_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


def check_tallies(
    tallies: Sequence[Tensor],
    param_groups: list[dict[str, Any]],
    error: BaseException | None,
    reducer: Reducer,
) -> None:
    """Raise on every rank alike unless no rank failed and the tallies agree."""
    rows = [t.tolist() for t in tallies]
    world = len(rows)
    failed = [r for r, row in enumerate(rows) if row[0] != 0.0]
    if error is not None:
        raise error
    if failed:
        raise RankFailedError(
            f"rank(s) {failed} of {world} refused this Shampoo step (see the error raised "
            f"there); every rank raises with it and {_UNCHANGED}, so the process group "
            "stays in step: a loop that catches the error may go on with the next batch."
        )
    pos = 1
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            has = [row[pos] for row in rows]
            if any(h != has[0] for h in has):
                yes = [r for r in range(world) if has[r]]
                no = [r for r in range(world) if not has[r]]
                raise ValueError(
                    f"{block_name(param_groups, gi, pi, p)} has a gradient on rank(s) {yes} "
                    f"but not on rank(s) {no}: every rank must hold the same (averaged) "
                    f"gradients, as DDP gives them; {_UNCHANGED}."
                )
            pos += 1
    for gi, group in enumerate(param_groups):
        lrs, steps, prints = ([row[pos + j] for row in rows] for j in range(3))
        pos += 3
        if any(v != lrs[0] for v in lrs):
            raise ValueError(
                f"param_groups[{gi}]['lr'] differs across ranks ({_by_rank(lrs)}); every "
                "rank applies the same update, so the ranks' parameters would diverge. Set "
                "the same lr on every rank (change it, or step a scheduler, in code that "
                f"runs on all ranks); {_UNCHANGED}."
            )
        if any(v != steps[0] for v in steps):
            raise ValueError(
                f"the step count of param_groups[{gi}] differs across ranks "
                f"({_by_rank([int(s) for s in steps])}): the ranks' optimizer states come "
                "from different checkpoints, or from a step interrupted on some ranks only "
                "(a Ctrl-C in the final writes puts back that rank's step alone); load every "
                f"rank's file of one checkpoint; {_UNCHANGED}."
            )
        if any(v != prints[0] for v in prints):
            # Every rank sees the same tallies and calls this collective alike; it
            # names the settings that differ.
            reducer.check_agree(group_settings(group), f"hyperparameters of param_groups[{gi}]")
            raise ValueError(f"the hyperparameters of param_groups[{gi}] differ across ranks")


def agree_refusal(reducer: Reducer, error: BaseException | None, what: str, device: Any) -> None:
    """Every rank raises if any refused ``what``: one all-reduce of per-rank flags."""
    if reducer.world_size == 1:
        if error is not None:
            raise error
        return
    flags = torch.zeros(reducer.world_size, dtype=torch.float64, device=device)
    flags[reducer.rank] = 0.0 if error is None else 1.0
    reducer.sum_([flags])
    if error is not None:
        raise error
    failed = [r for r, f in enumerate(flags.tolist()) if f != 0.0]
    if failed:
        raise RankFailedError(
            f"rank(s) {failed} of {reducer.world_size} refused {what} (see the error raised "
            f"there); every rank raises with it and {_UNCHANGED}."
        )
