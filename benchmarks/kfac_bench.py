"""K-FAC's benchmark, now a section of the shared suite: a thin entry point.

The problems, methods, phase timings and the iteration-time ratios against SGD live in
:mod:`benchmarks.kfac_methods`; the 2-process scaling report in
:mod:`benchmarks.kfac_scaling`.  This script runs the suite's K-FAC family::

    python -m benchmarks.kfac_bench --quick --threads 1

which is ``python -m benchmarks.bench --family kfac`` with the same flags (``--quick``,
``--tiny``, ``--threads``, ``--problems``, ``--methods``, ``--out``, ``--json``,
``--no-scaling``).  Numbers are reported, never asserted; see ``benchmarks/KFAC.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``benchmarks.bench --family kfac`` with ``argv``'s flags."""
    from benchmarks import bench

    args = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in args:
        args += ["--out", "out/kfac"]
    return bench.main(["--family", "kfac", *args])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
