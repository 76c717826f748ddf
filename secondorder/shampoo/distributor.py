"""Which rank owns which block, and how the ranks' directions reach everyone.

Data-parallel Shampoo (DistributedShampoo's DDP distributor): every rank holds the
same averaged gradient, but each computes the factors, roots and direction of only
the blocks it owns; one all-gather per step then gives every rank every block's
direction, and every rank applies the same update.  Memory for optimizer state and
the root-inverse work are divided by the number of ranks.

:func:`assign_blocks` is a pure function so that the assignment can be tested (and
inspected) without a process group.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from torch import Tensor

from ..distributed import Reducer

__all__ = ["assign_blocks", "block_cost", "gather_directions"]


def block_cost(shape: Sequence[int]) -> float:
    """Work of one block per step: ``Σ d_k³`` (root inverses) plus ``numel · Σ d_k`` (products)."""
    numel = 1
    for d in shape:
        numel *= d
    return float(sum(d**3 for d in shape) + numel * sum(shape))


def assign_blocks(costs: Sequence[float], world_size: int) -> list[int]:
    """The owning rank of each block, by the greedy longest-processing-time rule.

    Blocks are taken in decreasing cost (ties: lower index first) and each goes to the
    rank with the least total so far (ties: lower rank).  The result depends only on
    ``costs`` and ``world_size``, so every rank computes the same assignment; LPT's
    makespan is at most ``4/3 − 1/(3·world_size)`` times the optimum.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}: must be an integer >= 1.")
    owner = [0] * len(costs)
    loads = [(0.0, r) for r in range(world_size)]
    heapq.heapify(loads)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        owner[i] = r
        heapq.heappush(loads, (load + costs[i], r))
    return owner


def gather_directions(
    reducer: Reducer,
    local: Sequence[Tensor],
    counts: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> list[Tensor]:
    """All-gather the ranks' flattened block directions; one flat vector per rank.

    ``local`` are this rank's block directions in global block order and ``counts`` the
    number of elements each rank sends.  They travel (and come back) in ``dtype``: one
    ``gather_rows`` call, whatever the number of blocks.
    """
    if local:
        flat = torch.cat([t.reshape(-1) for t in local]).to(dtype)
    else:
        flat = torch.zeros(0, dtype=dtype, device=device)
    gathered = reducer.gather_rows(flat.unsqueeze(1)).squeeze(1)
    return list(gathered.split(list(counts)))
