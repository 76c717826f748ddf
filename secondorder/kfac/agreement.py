"""Ranks that fail together: one small all-reduce decides whether a step goes on.

A K-FAC step mixes local work (hook checks, folding the factors, the decompositions a
rank owns, preconditioning, the KL clip, writing ``.grad``) with collectives (the
factor all-reduce, the broadcasts of decompositions and preconditioned gradients).  If
one rank raised in its local work and the others went on, they would wait in the next
collective for a rank that never comes, pair it with a different one, or commit a step
that rank refused.  So a step agrees twice: before its first collective (the checks and
the step's settings), and after every rank has committed or failed (a rank that
failed makes the others put their old state back).  In between, a rank whose local
work failed still makes every collective, with placeholders.  Each agreement is one
row per rank of a ``world × (1 + settings)`` table that an all-reduce of the ranks'
rows (zeros elsewhere) assembles exactly; every rank reads the same table and takes
the same branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import RankFailedError, Reducer

if TYPE_CHECKING:
    from .config import KFACConfig
    from .layers import KFACLayer

__all__ = ["OtherRankError", "agree", "shared_settings"]


class OtherRankError(RankFailedError):
    """Another rank's part of a K-FAC step or load raised; this rank refused it too.

    A :class:`~secondorder.distributed.RankFailedError`, like the error LM and Shampoo
    raise on the ranks that did not fail, so one ``except`` serves every family.
    """


def agree(
    reducer: Reducer,
    error: BaseException | None,
    settings: Mapping[str, float],
    device: torch.device,
    what: str,
) -> None:
    """Raise on every rank if any rank's ``error`` is set or the ``settings`` differ.

    A rank that failed re-raises its own error (a ``KeyboardInterrupt`` too: its
    callers catch ``BaseException`` so that the others learn of it rather than wait);
    the others raise :class:`OtherRankError` naming the ranks that failed.  Settings are compared
    exactly (each rank's row is summed with zeros only); their names and number must
    be the same on every rank.  On one process this re-raises ``error`` and returns.
    """
    world, rank = reducer.world_size, reducer.rank
    if world == 1:
        if error is not None:
            raise error
        return
    names = list(settings)
    try:
        table = _row(world, rank, error, [float(settings[n]) for n in names], device)
    except BaseException as exc:
        # this rank still reports, as failed: a peer must not wait for it in the sum
        error = error or exc
        table = _row(world, rank, error, [0.0] * len(names), device)
    reducer.sum_([table])
    rows = table.cpu().tolist()
    failed = [r for r in range(world) if rows[r][0] != 0.0]
    if failed:
        if error is not None:
            raise error
        raise OtherRankError(
            f"{what} failed on rank(s) {failed} of {world} (see the error there); every "
            "rank refused it, so the factors, decompositions, gradients and step count "
            "are as before it on every rank."
        )
    differ = []
    for j, name in enumerate(names, start=1):
        values = [rows[r][j] for r in range(world)]
        if any(v != values[0] for v in values[1:]):
            by_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            differ.append(f"{name} differs ({by_rank})")
    if differ:
        raise ValueError(
            f"{what}: the settings must be the same on all {world} ranks, but "
            f"{'; '.join(differ)}. Every rank refused the step; nothing changed."
        )


def _row(
    world: int, rank: int, error: BaseException | None, values: list[float], device: torch.device
) -> torch.Tensor:
    """The ``world × (1 + settings)`` table, zero but for this rank's row."""
    table = torch.zeros(world, 1 + len(values), dtype=torch.float64, device=device)
    table[rank, 0] = 0.0 if error is None else 1.0
    if error is None and values:
        table[rank, 1:] = torch.tensor(values, dtype=torch.float64)
    return table


def shared_settings(config: KFACConfig, layers: Mapping[str, KFACLayer], k: int) -> dict[str, Any]:
    """What the ranks must agree on when K-FAC is built (``Reducer.check_agree``).

    Everything that decides which collectives a step makes and what they carry (layer
    shapes, packing, the factor and inverse schedules) or what the ranks compute from
    the same sums (damping, decay, the clip): a difference would kill a rank (gloo
    aborts on a size mismatch), stall them all, or let their parameters drift apart.
    A callable is compared at every step, by value (:func:`agree`).
    """
    scheduled = ["damping", "factor_decay", "kl_clip", "lr"]
    scheduled += ["factor_update_steps", "inv_update_steps"]
    out: dict[str, Any] = {
        "layers": list(layers),
        "layer shapes": [[layer.kind, *layer.factor_shapes()] for layer in layers.values()],
        "grad_workers": k,
        "compute_method": config.compute_method,
        "symmetry_aware": config.symmetry_aware,
        "factor dtypes": [str(layer.factor_dtype) for layer in layers.values()],
        "inv_dtype": str(config.inv_dtype),
        "accumulation_steps": config.accumulation_steps,
        "loss_reduction": config.loss_reduction,
        "assignment_strategy": config.assignment_strategy,
    }
    for name in scheduled:
        value = getattr(config, name)
        out[name] = "<callable>" if callable(value) else value
    return out
