"""Batched curve fits: fits per second on Gpufit's 2D Gaussian, against a scipy loop.

Gpufit's benchmark problem: a symmetric 2D Gaussian with a constant background, 5
parameters, on 5x5 pixels, float32, starts 10% off the truth.  Rounds alternate
(interleaved) between :func:`secondorder.curve_fit_batch` on all the fits (with
autodiff Jacobians, and with the model's analytic Jacobian as Gpufit uses) and a
``scipy.optimize.curve_fit`` loop over a subset, so a burst of load on a shared
machine hits both alike; medians are reported.  ``--solve`` also times the small
batched solves (unrolled Cholesky against ``torch.linalg.cholesky_ex``)::

    python -m benchmarks.batch_fits --threads 2
    python -m benchmarks.batch_fits --device cuda --fits 1000000
    python -m benchmarks.batch_fits --solve
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import secondorder as so
from secondorder.fitting.batch.small_linalg import solve_shifted


def grid(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    g = torch.arange(5, dtype=dtype, device=device)
    xx, yy = torch.meshgrid(g, g, indexing="xy")
    return torch.stack([xx.reshape(-1), yy.reshape(-1)])


def gauss2d(X: torch.Tensor, a: Any, x0: Any, y0: Any, s: Any, b: Any) -> torch.Tensor:
    return a * torch.exp(-0.5 * ((X[0] - x0) ** 2 + (X[1] - y0) ** 2) / s**2) + b


def gauss2d_jac(X: torch.Tensor, a: Any, x0: Any, y0: Any, s: Any, b: Any) -> torch.Tensor:
    dx, dy = X[0] - x0, X[1] - y0
    e = torch.exp(-0.5 * (dx * dx + dy * dy) / s**2)
    ae = a * e / s**2
    return torch.stack([e, ae * dx, ae * dy, ae * (dx * dx + dy * dy) / s, torch.ones_like(e)], -1)


def np_gauss2d(X: np.ndarray, a: float, x0: float, y0: float, s: float, b: float) -> np.ndarray:
    return a * np.exp(-0.5 * ((X[0] - x0) ** 2 + (X[1] - y0) ** 2) / s**2) + b


def problems(count: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Gpufit's set-up: amplitude 500, centre near the middle, width 1, background 10."""
    gen = torch.Generator().manual_seed(seed)
    X = grid(device, dtype)
    true = torch.stack(
        [
            500 + 100 * torch.rand(count, generator=gen),
            2 + 0.2 * torch.randn(count, generator=gen),
            2 + 0.2 * torch.randn(count, generator=gen),
            1 + 0.1 * torch.rand(count, generator=gen),
            10 + torch.rand(count, generator=gen),
        ],
        1,
    )
    clean = gauss2d(X.cpu().double(), *[true[:, j : j + 1].double() for j in range(5)])
    y = torch.poisson(clean, generator=gen)
    p0 = true * (1 + 0.1 * (2 * torch.rand(count, 5, generator=gen) - 1))
    return X, y.to(device, dtype), p0.to(device, dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def scipy_loop(X: torch.Tensor, y: torch.Tensor, p0: torch.Tensor) -> tuple[float, int]:
    """Seconds for scipy's curve_fit on each fit, and how many succeeded."""
    from scipy.optimize import curve_fit

    Xn, yn, pn = X.cpu().double().numpy(), y.cpu().double().numpy(), p0.cpu().double().numpy()
    ok = 0
    start = time.perf_counter()
    for b in range(yn.shape[0]):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                curve_fit(np_gauss2d, Xn, yn[b], p0=pn[b])
            ok += 1
        except RuntimeError:
            pass
    return time.perf_counter() - start, ok


def bench_fits(args: argparse.Namespace) -> list[str]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    X, y, p0 = problems(args.fits, device, dtype)
    ys, p0s = y[: args.scipy], p0[: args.scipy]
    times: dict[str, list[float]] = {"autodiff": [], "analytic": [], "scipy": []}
    info: dict[str, Any] = {}
    for _ in range(args.rounds):
        for name, jac in (("autodiff", None), ("analytic", gauss2d_jac)):
            seconds, out = timed(
                lambda jac=jac: so.curve_fit_batch(gauss2d, X, y, p0=p0, jac=jac), device
            )
            times[name].append(seconds / args.fits)
            info[name] = out[2]
        if args.scipy:
            seconds, ok = scipy_loop(X, ys, p0s)
            times["scipy"].append(seconds / args.scipy)
            info["scipy_ok"] = ok
    med = {k: statistics.median(v) for k, v in times.items() if v}
    lines = [
        f"- command: `python -m benchmarks.batch_fits {' '.join(args.argv)}`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {_device_name(device)}; torch "
        f"{torch.__version__}; torch threads {torch.get_num_threads()}",
        f"- {args.fits} fits of a 2D Gaussian (5 parameters, 5x5 pixels), {args.dtype}, "
        f"{args.rounds} interleaved rounds, medians",
        "",
        "| method | µs per fit | fits/s | success | mean nfev |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("autodiff", "analytic"):
        res = info[name]
        lines.append(
            f"| curve_fit_batch, {name} Jacobian | {1e6 * med[name]:.2f} | "
            f"{1 / med[name]:,.0f} | {float(res.success.double().mean()):.4f} | "
            f"{float(res.nfev.double().mean()):.2f} |"
        )
    if "scipy" in med:
        lines.append(
            f"| scipy curve_fit loop (float64, {args.scipy} fits) | {1e6 * med['scipy']:.1f} | "
            f"{1 / med['scipy']:,.0f} | {info['scipy_ok'] / args.scipy:.4f} | |"
        )
        lines.append("")
        for name in ("autodiff", "analytic"):
            lines.append(f"- ratio scipy / batch ({name}): {med['scipy'] / med[name]:.1f}x")
    return lines


def bench_solve(args: argparse.Namespace) -> list[str]:
    """Unrolled Cholesky against batched LAPACK for ``(A + λI) z = b``, n ≤ 8."""
    device = torch.device(args.device)
    lines = [
        f"- solves of {args.fits} systems, median of 7, torch threads {torch.get_num_threads()}",
        "",
        "| dtype | n | cholesky_ex + cholesky_solve (ms) | unrolled (ms) | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for dtype in (torch.float32, torch.float64):
        for n in (2, 3, 5, 8):
            J = torch.randn(args.fits, 25, n, dtype=dtype, device=device)
            M = J.mT @ J
            A = M.permute(1, 2, 0).contiguous()
            b = torch.randn(args.fits, n, dtype=dtype, device=device)
            lam = torch.full((args.fits,), 1e-3, dtype=dtype, device=device)
            eye = torch.eye(n, dtype=dtype, device=device)

            def lapack(
                M: torch.Tensor = M, eye: torch.Tensor = eye, b: torch.Tensor = b
            ) -> torch.Tensor:
                L, _ = torch.linalg.cholesky_ex(M + 1e-3 * eye)
                return torch.cholesky_solve(b.unsqueeze(-1), L)

            def unrolled(
                A: torch.Tensor = A, lam: torch.Tensor = lam, b: torch.Tensor = b
            ) -> torch.Tensor:
                return solve_shifted(A, lam, b)

            t_l = statistics.median(timed(lapack, device)[0] for _ in range(7))
            t_u = statistics.median(timed(unrolled, device)[0] for _ in range(7))
            lines.append(
                f"| {str(dtype).split('.')[-1]} | {n} | {1e3 * t_l:.2f} | {1e3 * t_u:.2f} | "
                f"{t_l / t_u:.1f}x |"
            )
    return lines


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{torch.get_num_threads()}-thread CPU"


def main(argv: list[str] | None = None) -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=20000)
    parser.add_argument("--scipy", type=int, default=300, help="fits in the scipy loop (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--solve", action="store_true", help="time the batched solves too")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(args.threads)
    lines = bench_fits(args)
    if args.solve:
        lines += ["", *bench_solve(args)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
