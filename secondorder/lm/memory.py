"""How much memory a device has free, and how much a model's forward pass keeps.

The two measured inputs of the memory planner (:mod:`secondorder.lm.planner`):
:func:`available_memory` for what a step may use, :func:`activation_numel` for what a
sample's activations take; and :class:`BufferPool`, which hands a step the buffer of
J's rows that the previous step no longer uses.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "BufferPool",
    "activation_numel",
    "available_memory",
    "cgroup_headroom",
    "meminfo_available",
]


def meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; ``None`` where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom() -> int | None:
    """Limit minus usage of this container's memory cgroup (v2, then v1), if limited."""
    pairs = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    )
    for limit_path, usage_path in pairs:
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max":
                return None
            limit = int(raw)
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        # cgroup v1 reports "no limit" as a huge page-aligned number.
        if limit >= 1 << 60:
            return None
        return max(0, limit - usage)
    return None


def available_memory(device: torch.device | str) -> tuple[int | None, str]:
    """Bytes free on ``device`` now, and where the number came from.

    * CUDA: ``torch.cuda.mem_get_info`` (free memory on the device) plus what torch's
      caching allocator holds reserved but unused, which it will hand out first.
    * CPU: ``MemAvailable`` from ``/proc/meminfo`` (free memory plus caches the kernel
      can drop), capped by the container's cgroup limit when there is one; where
      ``/proc`` is missing (macOS, Windows), ``os.sysconf`` free pages, which leave
      out reclaimable caches and so err low.
    * Anything else: ``(None, "unknown")``; the plan is then not checked against
      free memory, only against ``memory_limit`` and ``memory_budget``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached), f"{device} free memory (torch.cuda.mem_get_info)"
    if device.type == "cpu":
        avail = meminfo_available()
        source = "MemAvailable in /proc/meminfo"
        if avail is None:
            try:
                avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                source = "free pages from os.sysconf"
            except (AttributeError, ValueError, OSError):
                return None, "unknown (no /proc/meminfo or os.sysconf)"
        cgroup = cgroup_headroom()
        if cgroup is not None and cgroup < avail:
            return cgroup, "cgroup memory limit minus usage"
        return avail, source
    return None, f"unknown for device type {device.type!r}"


def activation_numel(fn: Callable[[], Tensor], exclude: Sequence[Tensor] = ()) -> int:
    """Entries of the tensors autograd saves while ``fn()`` runs (its activations).

    Called on one or two samples, this measures how much a sample's forward pass
    keeps for the backward pass, the one property of the model's layers the planner
    needs.  Storages shared by several saved tensors (views of one activation) are
    counted once, and those of ``exclude`` (the parameters, which layers save to
    differentiate their inputs) not at all.  Returns 0 for a function that applies
    ``torch.func`` transforms itself, which saved-tensor hooks cannot observe.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[tuple[int, tuple[int, ...]], int] = {}

    def pack(t: Tensor) -> Tensor:
        # A saved slice of a larger tensor (the probe's inputs) keeps the whole
        # storage alive, but a slice of s samples saves s such rows: count the view.
        if t.untyped_storage().data_ptr() not in skip:
            seen[(t.data_ptr(), tuple(t.shape))] = t.numel()
        return t

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    except RuntimeError as exc:
        # A function that runs torch.func transforms inside (a residual with
        # derivatives in the inputs) cannot be observed this way: count nothing.
        if "saved tensor hooks" not in str(exc):
            raise
        return 0
    return sum(seen.values())


def _storage_users(t: Tensor) -> int | None:
    """References to ``t``'s storage (tensors, views, detached aliases); None if unknown."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    # The temporary ``untyped_storage()`` handle adds one reference of its own.
    return int(count(t.untyped_storage()._cdata)) - 1


class BufferPool:
    """Reuse a large scratch buffer (J's rows of a slice) from one step to the next.

    A fresh tensor of several MB pays its page faults on first touch, every step, which
    can cost several times the multiply that fills it
    (``python -m benchmarks.experiments.host_memory`` measures it).  :meth:`take` returns
    the pool's buffer of that shape, dtype and device only when nothing else references
    its storage (no tensor, view or detached alias from an earlier take is alive: a
    record that kept J's rows, an interrupted step's locals), and a new one otherwise;
    its contents are undefined, so the caller writes every entry.  Reuse therefore never
    changes a value anyone can see: an interrupted or rejected step leaves nothing
    behind that the next step reads.
    Where torch cannot count a storage's references the pool never reuses.

    The pool keeps one buffer per key between steps.  That memory belongs to the next
    step, which reuses the buffer or drops it before allocating another, so the planner
    adds :meth:`free_bytes` back to the free memory it reads.  With :attr:`keep` off
    (the memory plan has no room for it), :meth:`take` drops the pooled buffers and
    hands out a fresh one that the pool does not keep.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype, torch.device], Tensor] = {}
        #: How many :meth:`take` calls were served by an existing buffer.
        self.reused = 0
        #: Whether :meth:`take` keeps its buffer for the next call.
        self.keep = True
        # Optimizers in several threads may share a pool: check and hand out atomically.
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Tensor:
        """An uninitialised tensor of ``shape``, the pooled one whenever it is free."""
        with self._lock:
            return self._take((tuple(int(s) for s in shape), dtype, torch.device(device)))

    def _take(self, key: tuple[tuple[int, ...], torch.dtype, torch.device]) -> Tensor:
        if not self.keep:
            self._buffers.clear()
            return torch.empty(key[0], dtype=key[1], device=key[2])
        buf = self._buffers.get(key)
        if buf is not None and _storage_users(buf) == 1:
            self.reused += 1
            return buf.view(key[0])
        # One buffer per key, and only the latest: a shape seen once (the last, shorter
        # slice of an epoch) does not pin memory beside the usual one for long.  The
        # others go before the new one is allocated, so the two never add up.
        self._buffers = {k: v for k, v in self._buffers.items() if k[0] == key[0] and k != key}
        del buf
        buf = torch.empty(key[0], dtype=key[1], device=key[2])
        self._buffers[key] = buf
        # The caller gets an alias, so the storage counts its holders beside the pool's.
        return buf.view(key[0])

    def free_bytes(self, device: torch.device | str) -> int:
        """Bytes on ``device`` that only the pool holds (no tensor outside it uses them)."""
        device = torch.device(device)
        with self._lock:
            return sum(
                buf.untyped_storage().nbytes()
                for (_, _, dev), buf in self._buffers.items()
                if dev == device and _storage_users(buf) == 1
            )

    def clear(self) -> None:
        """Drop every pooled buffer (the next :meth:`take` allocates)."""
        with self._lock:
            self._buffers.clear()
