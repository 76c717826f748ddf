"""The Shampoo section of the benchmark suite: ``python -m benchmarks.shampoo_bench [--quick]``.

A thin entry point into :mod:`benchmarks.bench` with the Shampoo family's problems and
methods (:mod:`benchmarks.shampoo_methods`) and one torch thread by default: on a shared
2-core machine, OpenMP's spinning threads make a 2-thread ``eigh`` up to 100x slower
whenever another process holds a core.  Quick and full runs end with the 2-process
scaling report (:mod:`benchmarks.shampoo_scaling`); LM's scaling table is left out
(``--no-scaling``).  Any other option of ``python -m benchmarks.bench`` passes through,
e.g. ``--methods shampoo_f100 shampoo_adamw`` or ``--json out/shampoo/bench.json``.

The same section runs inside the whole suite with
``python -m benchmarks.bench --problems shampoo_mnist1d_cnn shampoo_digits_mlp
--methods shampoo shampoo_f100 soap shampoo_adamw shampoo_peers``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from . import bench, shampoo_methods


def argv_for(argv: Sequence[str]) -> list[str]:
    """``python -m benchmarks.bench`` arguments for this section; ``argv`` may override."""
    out = list(argv)
    if "--problems" not in out:
        out += ["--problems", *shampoo_methods.PROBLEMS]
    if "--methods" not in out:
        out += ["--methods", *shampoo_methods.METHODS]
    if "--threads" not in out:
        out += ["--threads", "1"]
    if "--out" not in out:
        out += ["--out", "out/shampoo"]
    if "--no-scaling" not in out:
        out.append("--no-scaling")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the Shampoo section as :func:`benchmarks.bench.main` would."""
    return bench.main(argv_for(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
