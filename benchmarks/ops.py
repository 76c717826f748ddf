"""Counting the aten operations a step dispatches (each is a kernel launch on a GPU).

On a GPU a small model's step is bound by launches, not arithmetic: the count of
dispatched operations, measured on the CPU, tells how a step will fare there before a
GPU is at hand.  :func:`count_ops` runs the step a few times first, so that lazily
built state and caches are in place, and counts with a ``TorchDispatchMode``.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "count_ops"]


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(step: Callable[[], Any], warm: int = 5, steps: int = 3) -> int:
    """The median count of aten operations of ``step()`` after ``warm`` calls."""
    for _ in range(warm):
        step()
    counts = []
    for _ in range(steps):
        counter = OpCounter()
        with counter:
            step()
        counts.append(sum(counter.ops.values()))
    return int(statistics.median(counts))
