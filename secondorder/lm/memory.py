"""How much memory a device has free, and how much a model's forward pass keeps.

The two measured inputs of the memory planner (:mod:`secondorder.lm.planner`):
:func:`available_memory` for what a step may use, :func:`activation_numel` for what a
sample's activations take.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["activation_numel", "available_memory", "cgroup_headroom", "meminfo_available"]


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
