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

__all__ = ["assign_blocks", "block_cost", "exchange"]


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


def exchange(
    reducer: Reducer,
    tally: Tensor,
    local: Sequence[Tensor],
    dtype: torch.dtype,
) -> list[tuple[Tensor, Tensor]]:
    """All-gather every rank's ``tally`` and flattened block directions, in rank order.

    ``tally`` is a float64 vector of the same length on every rank (the step's failure
    flag and the settings the ranks must agree on: it rides in the directions'
    all-gather, so refusing together costs no extra collective); ``local`` are this
    rank's block directions in global block order, possibly none (a rank that failed
    sends its tally alone).  Both travel as raw bytes, the directions in ``dtype``,
    so the tally arrives bit for bit whatever ``dtype`` is.  Returns each rank's
    ``(tally, flat directions)``.
    """
    device = tally.device
    if local:
        dirs = torch.cat([t.reshape(-1) for t in local]).to(dtype)
    else:
        dirs = torch.zeros(0, dtype=dtype, device=device)
    head = torch.cat(
        [
            torch.full((1,), float(dirs.numel()), dtype=torch.float64, device=device),
            tally.to(torch.float64),
        ]
    )
    payload = torch.cat([head.view(torch.uint8), dirs.contiguous().view(torch.uint8)])
    gathered = reducer.gather_rows(payload.unsqueeze(1)).squeeze(1)
    head_bytes = head.numel() * 8
    out: list[tuple[Tensor, Tensor]] = []
    pos = 0
    for _ in range(reducer.world_size):
        got = gathered[pos : pos + head_bytes].clone().view(torch.float64)
        n_bytes = int(got[0].item()) * dtype.itemsize
        pos += head_bytes
        flat = gathered[pos : pos + n_bytes].clone().view(dtype)
        pos += n_bytes
        out.append((got[1:], flat))
    return out
