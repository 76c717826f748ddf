"""Cholesky at the sizes ``secondorder._lapack`` pads, against the unpadded call.

    python -m benchmarks.experiments.lapack_sizes [--threads 2] [--sizes 256 264 512 1024]

For each order and dtype, a random symmetric positive definite matrix is factored and
solved against one vector (``LevenbergMarquardt``'s dual and primal Cholesky step)
and factored and inverted (K-FAC's ``spd_inverse``), once at its own order and once
through the padding (:func:`secondorder._lapack.factor_size`), interleaved over
``--rounds`` rounds.  Prints the median µs of each and their ratio; sizes that are
not padded show the same call twice (a check of the noise).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from secondorder._lapack import (
    factor_size,
    pad_cpu_cholesky,
    pad_identity,
    shifted_cholesky_solve,
)

from ..core import run_line


def _plain_solve(k: Tensor, b: Tensor) -> Tensor:
    m = k.clone()
    m.diagonal().add_(1e-3)
    L, _ = torch.linalg.cholesky_ex(m)
    return torch.cholesky_solve(b.unsqueeze(-1), L).squeeze(-1)


def _plain_inverse(k: Tensor) -> Tensor:
    L, _ = torch.linalg.cholesky_ex(k)
    return torch.cholesky_inverse(L)


def _padded_inverse(k: Tensor) -> Tensor:
    n = k.shape[-1]
    L, _ = torch.linalg.cholesky_ex(pad_identity(k))
    return torch.cholesky_inverse(L)[:n, :n]


def _calls(k: Tensor, b: Tensor) -> dict[str, Callable[[], object]]:
    return {
        "solve": lambda: _plain_solve(k, b),
        "solve_padded": lambda: shifted_cholesky_solve(k, 1e-3, b),
        "inv": lambda: _plain_inverse(k),
        "inv_padded": lambda: _padded_inverse(k),
    }


def _median_us(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 264, 512, 768, 1024])
    ap.add_argument("--rounds", type=int, default=0, help="0: by size")
    args = ap.parse_args(argv)
    pad_cpu_cholesky(True)  # the padded side of the comparison (off by default)
    torch.set_num_threads(args.threads)
    print(run_line())
    print(
        "| dtype | n | factored at | solve µs: n / padded | ratio "
        "| inverse µs: n / padded | ratio |"
    )
    print("|---|---:|---:|---|---:|---|---:|")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        for n in args.sizes:
            a = torch.randn(n, 2 * n, generator=gen, dtype=dtype)
            k = a @ a.T + n * torch.eye(n, dtype=dtype)
            k = (k + k.T) / 2
            b = torch.randn(n, generator=gen, dtype=dtype)
            x_ref = torch.linalg.solve(k + 1e-3 * torch.eye(n, dtype=dtype), b)
            x = shifted_cholesky_solve(k, 1e-3, b)[0]
            tol = 1e-4 if dtype == torch.float32 else 1e-10
            if not torch.allclose(x, x_ref, rtol=tol, atol=tol * float(x_ref.abs().max())):
                raise SystemExit(f"padded solve differs from torch.linalg.solve at n = {n}")
            rounds = args.rounds or (200 if n <= 300 else 60 if n <= 600 else 20)
            t = _median_us(_calls(k, b), rounds)
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {name} | {n} | {factor_size(n, dtype, 'cpu')} "
                f"| {t['solve']:.0f} / {t['solve_padded']:.0f} "
                f"| {t['solve'] / t['solve_padded']:.2f} "
                f"| {t['inv']:.0f} / {t['inv_padded']:.0f} | {t['inv'] / t['inv_padded']:.2f} |"
            )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
