"""Which rank steps which block, and what the ranks exchange: picked by configuration.

Two distributors, chosen from ``distributed_config`` and the parameters
(:func:`make_distributor`); the numerics see neither, only the blocks they are given:

* :class:`DataParallelDistributor` (DistributedShampoo's DDP distributor): every rank
  holds the same averaged gradient, but each computes the factors, roots and direction
  of only the blocks it owns (:func:`assign_blocks`); one all-gather per step then gives
  every rank every block's direction, and every rank applies the same update.  On one
  process it owns everything and exchanges nothing.
* :class:`ShardDistributor` (its FSDP2 distributor): the parameters are DTensors
  (``torch.distributed.fsdp.fully_shard``, with or without a replicate dimension), and
  each rank cuts the blocks of its own shard (``to_local()``) as if it were a parameter,
  so no block crosses a shard boundary.  It steps those blocks in place and exchanges
  only the small tally the ranks agree on (:mod:`.agreement`).

:func:`assign_blocks` is a pure function so that the assignment can be tested (and
inspected) without a process group.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..distributed import LocalReducer, Reducer
from .named_configs import (
    DDPDistributedConfig,
    DistributedConfig,
    FSDPDistributedConfig,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    SingleDeviceDistributedConfig,
)

__all__ = [
    "DataParallelDistributor",
    "Distributor",
    "ShardDistributor",
    "assign_blocks",
    "block_cost",
    "check_distributed_params",
    "exchange",
    "is_sharded",
    "local_tensor",
    "make_distributor",
    "resolve_distribution",
]


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a ``fully_shard`` parameter or its gradient)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """The part of ``t`` on this rank: a DTensor's local shard (sharing its storage), else ``t``."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def _is_fsdp1(p: Any) -> bool:
    return bool(getattr(p, "_fsdp_flattened", False)) or type(p).__name__ == "FlatParameter"


def check_distributed_params(
    params: Iterable[Any], config: DistributedConfig | None, existing: bool | None
) -> bool | None:
    """Refuse parameters ``config`` cannot step; return whether they are DTensors.

    ``existing`` is whether the optimizer's earlier parameters are DTensors (``None``:
    no parameter yet): the two kinds cannot be mixed, since plain parameters beside
    ``fully_shard`` ones get no averaged gradient.
    """
    kind = existing
    for p in params:
        p = p[1] if isinstance(p, tuple) else p  # (name, parameter) pairs
        if not isinstance(p, Tensor):
            continue
        if _is_fsdp1(p):
            raise ValueError(
                "Shampoo cannot step the flattened parameters of FullyShardedDataParallel "
                "(FSDP1): a flat shard mixes pieces of several parameters, so its blocks "
                "would not be the parameters' blocks. Shard the model with "
                "torch.distributed.fsdp.fully_shard (FSDP2) instead, or use "
                "DistributedDataParallel."
            )
        sharded = is_sharded(p)
        if kind is not None and sharded != kind:
            raise ValueError(
                "Shampoo got both DTensor (fully_shard) parameters and plain ones: shard "
                "every module that holds parameters (fully_shard(model) on the root covers "
                "the rest), or give the plain ones to another optimizer."
            )
        kind = sharded
        if sharded:
            for placement in p.placements:  # type: ignore[attr-defined]
                if placement.is_partial():
                    raise ValueError(
                        f"Invalid parameter placements {p.placements}: Shampoo steps each "  # type: ignore[attr-defined]
                        "rank's shard of a DTensor parameter, which must be sharded or "
                        "replicated, not partial."
                    )
    replicated = (SingleDeviceDistributedConfig, DDPDistributedConfig)
    # HybridShardDistributedConfig is a DDPDistributedConfig too
    if (
        kind
        and isinstance(config, replicated)
        and not isinstance(config, FullyShardDistributedConfig)
    ):
        raise ValueError(
            f"Invalid distributed_config={type(config).__name__}(...) for DTensor "
            "(fully_shard) parameters: pass FullyShardDistributedConfig() or None."
        )
    if kind is False and isinstance(config, FullyShardDistributedConfig):
        raise ValueError(
            f"Invalid distributed_config={type(config).__name__}(...): the parameters are "
            "not DTensors; shard the model with torch.distributed.fsdp.fully_shard first, "
            "or pass DDPDistributedConfig() (or None) for a replicated model."
        )
    return kind


def check_distributed_config(config: Any) -> None:
    """Refuse a ``distributed_config`` secondorder does not run, naming the nearest choice."""
    if config is None:
        return
    if isinstance(config, FSDPDistributedConfig):  # HSDPDistributedConfig too
        raise ValueError(
            f"Invalid distributed_config={type(config).__name__}(...): the "
            "FullyShardedDataParallel (FSDP1) distributors are not supported; shard the "
            "model with torch.distributed.fsdp.fully_shard and pass "
            "FullyShardDistributedConfig()."
        )
    if not isinstance(config, DistributedConfig):
        raise TypeError(
            f"Invalid distributed_config={config!r}: must be None, "
            "SingleDeviceDistributedConfig(), DDPDistributedConfig(...) or "
            "FullyShardDistributedConfig(...)."
        )
    name = type(config).__name__
    if config.target_parameter_dimensionality != 1:  # type: ignore[attr-defined]
        raise ValueError(
            f"Invalid {name}.target_parameter_dimensionality="
            f"{config.target_parameter_dimensionality!r}: must be 1 (dimensions are "  # type: ignore[attr-defined]
            "merged as far as max_preconditioner_dim allows)."
        )
    if isinstance(config, FullyShardDistributedConfig):
        if config.param_assignment_strategy is not FSDPParamAssignmentStrategy.DEFAULT:
            raise ValueError(
                f"Invalid {name}.param_assignment_strategy="
                f"{config.param_assignment_strategy}: must be "
                "FSDPParamAssignmentStrategy.DEFAULT (each rank steps its own shards)."
            )
        if config.num_sub_groups != 1:
            raise ValueError(f"Invalid {name}.num_sub_groups={config.num_sub_groups!r}: must be 1.")


def resolve_distribution(
    config: Any, reducer: Reducer | None, process_group: Any, communication_dtype: Any
) -> tuple[Reducer | None, Any]:
    """Check ``config``; the reducer and communication dtype it implies.

    ``SingleDeviceDistributedConfig()`` is a :class:`~secondorder.distributed.LocalReducer`
    (every rank steps every block); ``DDPDistributedConfig`` lends its
    ``communication_dtype`` unless one is given.
    """
    check_distributed_config(config)
    if isinstance(config, SingleDeviceDistributedConfig):
        if reducer is not None or process_group is not None:
            raise ValueError(
                "distributed_config=SingleDeviceDistributedConfig() steps every block on "
                "every rank: pass no reducer and no process_group with it."
            )
        reducer = LocalReducer()
    if communication_dtype is None and isinstance(config, DDPDistributedConfig):
        communication_dtype = config.communication_dtype
    return reducer, communication_dtype


class Distributor:
    """Which rank steps which block and what the ranks exchange (see the module)."""

    #: Whether the owners' directions are all-gathered (else each rank steps its own).
    exchanges_directions = True

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer

    @property
    def rank(self) -> int:
        """The index of this rank in the reducer's group."""
        return self.reducer.rank

    def local(self, t: Tensor) -> Tensor:
        """The tensor this rank steps for parameter (or gradient) ``t``."""
        return t

    def owners(self, costs: Sequence[float]) -> list[int]:
        """The rank that computes each block, given the blocks' costs."""
        raise NotImplementedError

    def entry(self, index: int) -> str:
        """The state-dict prefix of a parameter's block ``index`` on this rank."""
        return f"block{index}"

    def share(
        self, tally: Tensor, mine: Sequence[Tensor], dtype: torch.dtype
    ) -> list[tuple[Tensor, Tensor]]:
        """Every rank's tally and (if :attr:`exchanges_directions`) directions, in rank order."""
        return exchange(self.reducer, tally, mine if self.exchanges_directions else (), dtype)

    def received(
        self, parts: Sequence[tuple[Tensor, Tensor]], blocks: Sequence[Any]
    ) -> dict[int, Tensor]:
        """The directions of ``blocks`` (all ranks' blocks with a gradient) read from ``parts``.

        Each owner's flat directions are cut in block order; a block's own rank reads
        its direction back too, so every rank applies the same (communicated) bits.
        """
        if not self.exchanges_directions:
            return {}
        out: dict[int, Tensor] = {}
        offsets = [0] * len(parts)
        for b in blocks:
            n = math.prod(b.spec.shape)
            flat = parts[b.owner][1]
            chunk = flat[offsets[b.owner] : offsets[b.owner] + n]
            offsets[b.owner] += n
            out[b.gid] = chunk.view(b.spec.shape).to(b.param.dtype)
        return out


class DataParallelDistributor(Distributor):
    """Whole parameters on every rank; blocks divided by LPT, directions all-gathered."""

    def owners(self, costs: Sequence[float]) -> list[int]:  # noqa: D102
        return assign_blocks(costs, self.reducer.world_size)


class ShardDistributor(Distributor):
    """DTensor parameters: each rank steps the blocks of its own shards, in place."""

    exchanges_directions = False

    def local(self, t: Tensor) -> Tensor:  # noqa: D102
        return local_tensor(t)

    def owners(self, costs: Sequence[float]) -> list[int]:  # noqa: D102
        return [self.rank] * len(costs)

    def entry(self, index: int) -> str:
        """Named by rank, so that a ``torch.distributed.checkpoint`` keeps each rank's."""
        return f"rank{self.rank}.block{index}"


def make_distributor(sharded: bool | None, reducer: Reducer) -> Distributor:
    """The distributor for DTensor (``sharded``) or plain parameters over ``reducer``."""
    return ShardDistributor(reducer) if sharded else DataParallelDistributor(reducer)


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
