"""How a parameter becomes blocks: squeeze, merge small dimensions, split large ones.

The rule is DistributedShampoo's: drop dimensions of size 1, then, walking from the
last dimension to the first, merge a dimension into its right neighbour while their
product stays ``<= max_preconditioner_dim``; finally cut every dimension into chunks
of at most ``max_preconditioner_dim``.  A block of order ``r`` gets ``r`` Kronecker
factors whose sizes are its dimensions, so no factor exceeds the limit.

Example: a Linear(1280, 256) weight with limit 1024 stays ``(1280, 256)`` (the
product exceeds the limit) and splits into blocks ``(1024, 256)`` and ``(256, 256)``;
a Conv1d(32, 32, 3) weight ``(32, 32, 3)`` merges into ``(32, 96)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockSpec", "block_slices", "merge_dims"]


def merge_dims(shape: Sequence[int], max_dim: float) -> tuple[int, ...]:
    """The merged shape of a tensor of ``shape``; a scalar becomes ``(1,)``."""
    if 0 in shape:
        return (0,)
    squeezed = [d for d in reversed(tuple(shape)) if d != 1] or [1]
    merged = [squeezed[0]]
    for d in squeezed[1:]:
        if merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(reversed(merged))


@dataclass(frozen=True)
class BlockSpec:
    """One block of a merged parameter: its index in the parameter and where it lies."""

    index: int
    starts: tuple[int, ...]
    shape: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        """Index that cuts this block out of the merged parameter view."""
        return tuple(slice(s, s + n) for s, n in zip(self.starts, self.shape, strict=True))


def block_slices(merged: Sequence[int], max_dim: float) -> list[BlockSpec]:
    """Cut ``merged`` into blocks of at most ``max_dim`` per dimension, row-major order."""
    per_dim: list[list[tuple[int, int]]] = []
    for d in merged:
        step = d if max_dim == math.inf else int(max_dim)
        per_dim.append([(s, min(step, d - s)) for s in range(0, d, step)] or [(0, 0)])
    specs: list[BlockSpec] = []

    def walk(k: int, starts: tuple[int, ...], shape: tuple[int, ...]) -> None:
        if k == len(per_dim):
            specs.append(BlockSpec(len(specs), starts, shape))
            return
        for s, n in per_dim[k]:
            walk(k + 1, (*starts, s), (*shape, n))

    walk(0, (), ())
    return specs
