"""Clocks for the side-by-side benchmarks on the CPU or a CUDA device.

On the CPU the benchmarks read the calling thread's CPU time, which other processes on a
shared machine disturb far less than the wall clock.  On CUDA that clock sees only the
host's share of the work, so they read the wall clock between two
``torch.cuda.synchronize()`` calls instead: :class:`Clock` holds that choice.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

__all__ = ["Clock", "device_words", "to_device", "warm_up"]


class Clock:
    """Synchronises ``device`` before a clock is read: a no-op on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        #: What :meth:`now` reads, for the reports.
        self.name = "wall" if self.cuda else "CPU"

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        """The thread's CPU time on the CPU; the wall clock after a synchronisation on CUDA."""
        if self.cuda:
            self.sync()
            return time.perf_counter()
        return time.thread_time()


def to_device(
    batches: list[tuple[Tensor, Tensor]], device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """``batches`` on ``device``, each distinct batch moved once (a list may repeat one)."""
    moved: dict[int, tuple[Tensor, Tensor]] = {}
    for x, y in batches:
        if id(x) not in moved:
            moved[id(x)] = (x.to(device), y.to(device))
    return [moved[id(x)] for x, _ in batches]


def device_words(device: torch.device) -> str:
    """The device, for a report's header: its name and CUDA version, or "the CPU"."""
    if device.type != "cuda":
        return "the CPU"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name}, CUDA {torch.version.cuda}"


def warm_up(device: torch.device) -> None:
    """Load the device's linear-algebra libraries outside any clock (cuSOLVER's first call).

    On CUDA the first ``eigh``, ``cholesky`` or matrix product of a process loads and
    initialises its library, which would otherwise land in one side's first timed round.
    """
    if device.type != "cuda":
        return
    a = torch.eye(8, device=device) * 2.0
    torch.linalg.eigh(a)
    torch.linalg.cholesky(a)
    torch.linalg.inv(a @ a)
    torch.cuda.synchronize(device)
