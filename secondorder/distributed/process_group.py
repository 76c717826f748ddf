"""The reducer over a ``torch.distributed`` process group (gloo, NCCL, ...).

Each rank holds its own shard of the global batch, as with DDP and a
``DistributedSampler``; :class:`ProcessGroupReducer` sums the ranks' partial normal
equations with ``all_reduce`` and gathers Jacobian rows with ``all_gather``.  It is
the only module of :mod:`secondorder` that calls ``torch.distributed``.

Why every rank ends a step with bitwise-identical parameters:

1. Every quantity a decision depends on (``Σr²`` before and at each trial point,
   ``Jᵀr``, ``diag(JᵀJ)``, the Gram, each CG product) is the output of an
   ``all_reduce``.  Gloo and NCCL compute each element of the sum once and copy it to
   every rank (ring and tree algorithms alike), so the ranks receive the same bits.
2. The step δ of every attempt is broadcast from rank 0 before the trial point is
   evaluated (:class:`~secondorder.lm.linalg.BroadcastSolver`), and so is
   the model curvature ``‖Jδ‖²`` of the predicted reduction.  A solver that is not
   bitwise reproducible across ranks (multi-threaded BLAS with different thread
   counts, cuSOLVER on different GPU models) therefore still yields one step.
3. What is left is elementwise or scalar arithmetic on identical inputs (``x + δ``,
   the gain ratio, the damping rule), which is deterministic.

The broadcast costs ``n + 1`` numbers per attempt, against the ``n²`` of the Gram's
``all_reduce`` or the ``n`` per CG iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .reducer import Reducer, check_partition

__all__ = ["CollectiveError", "ProcessGroupReducer"]


class CollectiveError(RuntimeError):
    """A collective failed: another rank died, raised, timed out or fell out of step."""


class ProcessGroupReducer(Reducer):
    """Sums, broadcasts and gathers over a ``torch.distributed`` process group.

    Small tensors of one dtype and device are packed into one flat buffer so that a
    call costs one collective (the loss, ``Jᵀr`` and ``diag(JᵀJ)`` of a step travel
    together); a contiguous tensor of at least ``bucket_bytes`` (the Gram) is reduced
    in place on its own, since copying it into a buffer would double its memory for
    no saving in latency.

    A rank that dies or stops calling collectives makes the others raise
    :class:`CollectiveError` when the backend notices: at once when the connection
    drops, at the latest after the ``timeout`` given to
    ``torch.distributed.init_process_group``.  Choose that timeout longer than the
    slowest step.

    Args:
        group: the process group; ``None`` is the default group, which must already
            be initialised with ``torch.distributed.init_process_group``.
        bucket_bytes: size from which a tensor is reduced on its own.

    With NCCL, tensors live on the GPU and ``torch.cuda.set_device`` must have been
    called on each rank (:meth:`check_agree` exchanges Python objects through it).
    """

    def __init__(self, group: Any = None, *, bucket_bytes: int = 1 << 22) -> None:
        if not dist.is_available():
            raise RuntimeError(
                "ProcessGroupReducer needs torch.distributed, which this build lacks"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupReducer needs an initialised process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the "
                "environment it reads)"
            )
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"Invalid bucket_bytes={bucket_bytes!r}: must be an integer >= 1.")
        self.group = group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of "
                f"process_group={group!r}"
            )
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.bucket_bytes = bucket_bytes
        world: Any = group if group is not None else dist.group.WORLD
        #: Global rank of the group's rank 0, the root of broadcasts.
        self.root = dist.get_global_rank(world, 0)

    def __repr__(self) -> str:
        return (
            f"ProcessGroupReducer(backend={self.backend!r}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )

    # -- plumbing ----------------------------------------------------------------------
    def _collective(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except RuntimeError as exc:
            raise CollectiveError(
                f"{what} over the {self.backend} process group failed on rank {self.rank} "
                f"of {self.world_size}: {exc}. Another rank has probably died, raised an "
                "exception, or called a different collective (every rank must call step() "
                "the same number of times); the process group's timeout bounds how long "
                "a rank waits."
            ) from exc

    def _buckets(self, tensors: Sequence[Tensor]) -> list[list[Tensor]]:
        """Group ``tensors`` into lists that each travel in one collective."""
        alone: list[list[Tensor]] = []
        packed: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for t in tensors:
            if t.is_contiguous() and t.numel() * t.element_size() >= self.bucket_bytes:
                alone.append([t])
            else:
                packed.setdefault((t.dtype, t.device), []).append(t)
        return alone + list(packed.values())

    def _each_bucket(self, tensors: Sequence[Tensor], op: Callable[[Tensor], None]) -> None:
        for bucket in self._buckets(tensors):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                op(bucket[0])
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            op(flat)
            for t, chunk in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                t.copy_(chunk.view_as(t))

    # -- the Reducer interface -----------------------------------------------------------
    def sum_(self, tensors: Sequence[Tensor]) -> None:  # noqa: D102
        if self.world_size == 1:
            return

        def op(t: Tensor) -> None:
            self._collective(
                f"all_reduce(SUM) of {t.numel()} {t.dtype} values",
                lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group),
            )

        self._each_bucket(tensors, op)

    def broadcast_(self, tensors: Sequence[Tensor]) -> None:  # noqa: D102
        if self.world_size == 1:
            return

        def op(t: Tensor) -> None:
            self._collective(
                f"broadcast of {t.numel()} {t.dtype} values from rank 0",
                lambda: dist.broadcast(t, src=self.root, group=self.group),
            )

        self._each_bucket(tensors, op)

    def gather_rows(self, tensor: Tensor) -> Tensor:  # noqa: D102
        if self.world_size == 1:
            return tensor
        if tensor.ndim == 0:
            raise ValueError("gather_rows needs a tensor with a row dimension, got a 0-d tensor")
        world, rank = self.world_size, self.rank
        # Row counts may differ between ranks (uneven shards); all_gather needs equal
        # sizes, so exchange the counts, pad to the largest and trim afterwards.
        shape = torch.zeros(2 * world, dtype=torch.int64, device=tensor.device)
        shape[rank] = tensor.shape[0]
        shape[world + rank] = tensor[0].numel() if tensor.shape[0] else -1
        self._collective(
            "all_reduce of the row counts", lambda: dist.all_reduce(shape, group=self.group)
        )
        counts = [int(c) for c in shape[:world].tolist()]
        widths = {int(c) for c in shape[world:].tolist() if int(c) >= 0}
        if len(widths) > 1:
            raise ValueError(
                f"gather_rows: ranks hold rows of different sizes {sorted(widths)}; the "
                "parameter counts or residuals per sample differ between ranks"
            )
        padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(world)]
        self._collective(
            f"all_gather of {padded.numel()} {padded.dtype} values per rank",
            lambda: dist.all_gather(parts, padded.contiguous(), group=self.group),
        )
        return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])

    def check_agree(self, settings: Mapping[str, Any], what: str) -> None:  # noqa: D102
        if self.world_size == 1:
            return
        gathered: list[Any] = [None] * self.world_size
        self._collective(
            f"all_gather_object of the {what}",
            lambda: dist.all_gather_object(gathered, dict(settings), group=self.group),
        )
        keys = list(dict.fromkeys(k for g in gathered for k in g))
        missing = "<missing>"
        problems = []
        for key in keys:
            values = [g.get(key, missing) for g in gathered]
            if any(v != values[0] for v in values[1:]):
                by_rank = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values))
                problems.append(f"{key} differs ({by_rank})")
        if problems:
            raise ValueError(
                f"the {what} must be the same on all {self.world_size} ranks of the process "
                f"group, but {'; '.join(problems)}"
            )

    def broadcast_from_(self, tensors: Sequence[Tensor], src: int) -> None:  # noqa: D102
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(
                f"Invalid src={src!r}: must be a rank of this group, in range({self.world_size})."
            )
        if self.world_size == 1:
            return
        world: Any = self.group if self.group is not None else dist.group.WORLD
        source = dist.get_global_rank(world, src)

        def op(t: Tensor) -> None:
            self._collective(
                f"broadcast of {t.numel()} {t.dtype} values from rank {src}",
                lambda: dist.broadcast(t, src=source, group=self.group),
            )

        self._each_bucket(tensors, op)

    def split(self, groups: Sequence[Sequence[int]]) -> Reducer:  # noqa: D102
        check_partition(groups, self.world_size)
        if len(groups) == 1:
            return self
        world: Any = self.group if self.group is not None else dist.group.WORLD
        mine: Reducer | None = None
        for g in groups:
            # new_group is collective over the parent group: every rank creates every
            # group, in the same order, even the groups it is not a member of.
            members = sorted(dist.get_global_rank(world, r) for r in g)
            handle = dist.new_group(members)
            if self.rank in g:
                mine = ProcessGroupReducer(handle, bucket_bytes=self.bucket_bytes)
        assert mine is not None  # the partition holds every rank
        return mine
