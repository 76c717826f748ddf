"""CG iterations of LM with the Jacobi and the K-FAC preconditioner on wide MLPs.

Reports, never asserts: for each width and damping matrix, the CG iterations of
the first steps of ``LevenbergMarquardt(solver="cg", cg_preconditioner=...)`` from
the same initialisation, with ``cg_rtol=1e-8``.  Run with
``OMP_NUM_THREADS=2 python -m benchmarks.experiments.cg_kfac``.
"""

from __future__ import annotations

import torch
from torch import nn

import secondorder as so


def run(width: int, matrix: str, steps: int = 3) -> dict[str, list[int]]:
    """CG iterations per step for both preconditioners."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g, dtype=torch.float64)
    y = torch.sin(2.0 * x[:, :2])
    out: dict[str, list[int]] = {}
    for pc in ("jacobi", "kfac"):
        torch.manual_seed(1)
        model = nn.Sequential(
            nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2)
        ).to(torch.float64)
        opt = so.LevenbergMarquardt(
            model, solver="cg", cg_preconditioner=pc, cg_rtol=1e-8, damping_matrix=matrix
        )
        out[pc] = [opt.step(x, y).cg_iterations for _ in range(steps)]
    return out


def main() -> None:
    """Print one line per (width, damping matrix)."""
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for width in (32, 64):
        for matrix in ("identity", "marquardt"):
            n = 5 * width + width * width + width + 2 * width + 2
            res = run(width, matrix)
            print(
                f"width {width:3d} (n={n:5d}, m=128) damping_matrix={matrix:9s} "
                f"jacobi {res['jacobi']} (sum {sum(res['jacobi'])})  "
                f"kfac {res['kfac']} (sum {sum(res['kfac'])})"
            )


if __name__ == "__main__":
    main()
