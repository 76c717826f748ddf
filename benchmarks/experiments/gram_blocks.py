"""Time ``linalg.gram_update`` with 1 to 4 column blocks, interleaved round-robin.

A 32 MB buffer is rewritten before each product, so J comes from memory as in a step.

python -m benchmarks.experiments.gram_blocks [rounds] [threads]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

import secondorder.lm.linalg.gram as linalg


def with_blocks(jac: torch.Tensor, k: int) -> torch.Tensor:
    chosen = linalg.gram_blocks
    linalg.gram_blocks = lambda n: k  # type: ignore[assignment]
    try:
        return linalg.gram_update(None, jac)
    finally:
        linalg.gram_blocks = chosen  # type: ignore[assignment]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    fns: dict[str, Callable[[], object]] = {}
    for m, n in [(20000, 64), (20000, 96), (20000, 130), (20000, 194), (25000, 769)]:
        ks = (1, 2, 3, 4)
        j32 = torch.randn(m, n)
        j64 = j32.double()
        for k in ks:
            fns[f"{m}x{n} k={k} f32"] = lambda j=j32, k=k: with_blocks(j, k)
            fns[f"{m}x{n} k={k} f64"] = lambda j=j64, k=k: with_blocks(j, k)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    flush = torch.zeros(8 * 2**20)
    for _ in range(rounds):
        for key, f in fns.items():
            flush.add_(1.0)
            t0 = time.perf_counter()
            f()
            times[key].append(time.perf_counter() - t0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds")
    for key, v in times.items():
        print(f"{key:24s} {statistics.median(v) * 1e3:9.2f} ms  (min {min(v) * 1e3:.2f})")


if __name__ == "__main__":
    main()
