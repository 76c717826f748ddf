"""Which rank decomposes which layer, and which ranks precondition it (a pure function).

KAISA's layout: the ``W`` ranks are split into ``W/k`` *worker groups* of ``k``
consecutive ranks, ``k = W · grad_worker_fraction`` (the gradient workers of a layer).
Each layer's factors are decomposed on one rank, its *inverse worker*, chosen by the
greedy longest-processing-time rule: layers in decreasing cost go to the least loaded
rank (cost ``n³`` per factor for ``"compute"``, ``n²`` for ``"memory"``).  The
decomposition is broadcast inside the inverse worker's group, whose ``k`` ranks then
precondition the layer's gradient; each of them broadcasts the result to its
*receiver group*, the ranks ``{j, j+k, j+2k, ...}`` that hold one member of every
worker group.

* COMM-OPT (``k = W``): one worker group; every rank holds every decomposition and
  preconditions every layer; nothing but decompositions travels.
* MEM-OPT (``k = 1``): each layer lives on one rank, which broadcasts its
  preconditioned gradient to everyone.
* HYBRID-OPT: in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["WorkAssignment", "assign_work", "factor_cost"]


def factor_cost(sizes: Sequence[int], strategy: str) -> float:
    """Cost of decomposing factors of the given orders: Σ n³ (compute) or Σ n² (memory)."""
    power = 3 if strategy == "compute" else 2
    return float(sum(n**power for n in sizes))


@dataclass(frozen=True)
class WorkAssignment:
    """The result of :func:`assign_work`.

    Attributes:
        world_size: number of ranks ``W``.
        grad_workers: ranks ``k`` that precondition each layer.
        inverse_worker: layer name → rank that decomposes its factors.
    """

    world_size: int
    grad_workers: int
    inverse_worker: dict[str, int]

    def worker_groups(self) -> list[list[int]]:
        """The ``W/k`` blocks of ``k`` consecutive ranks."""
        k = self.grad_workers
        return [list(range(b * k, (b + 1) * k)) for b in range(self.world_size // k)]

    def receiver_groups(self) -> list[list[int]]:
        """The ``k`` groups ``{j, j+k, ...}``: one member of every worker group each."""
        k = self.grad_workers
        return [list(range(j, self.world_size, k)) for j in range(k)]

    def block(self, layer: str) -> int:
        """Index of the worker group that preconditions ``layer``."""
        return self.inverse_worker[layer] // self.grad_workers

    def is_grad_worker(self, layer: str, rank: int) -> bool:
        """Whether ``rank`` preconditions ``layer``."""
        return rank // self.grad_workers == self.block(layer)

    def loads(self, costs: Mapping[str, float]) -> list[float]:
        """Decomposition cost per rank."""
        out = [0.0] * self.world_size
        for name, r in self.inverse_worker.items():
            out[r] += costs[name]
        return out


def assign_work(costs: Mapping[str, float], world_size: int, grad_workers: int) -> WorkAssignment:
    """Assign each layer's decomposition to a rank by longest processing time first.

    ``costs`` maps layer names to decomposition costs (see :func:`factor_cost`); ties
    go to the layer listed first and to the lowest rank, so every rank computes the
    same assignment.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}: must be an integer >= 1.")
    if (
        isinstance(grad_workers, bool)
        or not isinstance(grad_workers, int)
        or not 1 <= grad_workers <= world_size
        or world_size % grad_workers
    ):
        raise ValueError(
            f"Invalid grad_workers={grad_workers!r}: must be a divisor of world_size={world_size}."
        )
    order = sorted(enumerate(costs.items()), key=lambda t: (-t[1][1], t[0]))
    load = [0.0] * world_size
    worker: dict[str, int] = {}
    for _, (name, cost) in order:
        r = min(range(world_size), key=lambda i: (load[i], i))
        worker[name] = r
        load[r] += cost
    # keep the caller's layer order, which decides the order of collectives
    return WorkAssignment(world_size, grad_workers, {n: worker[n] for n in costs})
