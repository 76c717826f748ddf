"""Batched curve fits: fits per second on Gpufit's 2D Gaussian, against a scipy loop.

Gpufit's benchmark problem: a symmetric 2D Gaussian with a constant background, 5
parameters, on 5x5 pixels, float32, starts 10% off the truth.  Each round times
:func:`secondorder.curve_fit_batch` on all the fits at every torch thread count asked
for (with autodiff Jacobians, and with the model's analytic Jacobian as Gpufit uses),
then a ``scipy.optimize.curve_fit`` loop over a subset, so a burst of load on a shared
machine hits all alike; medians are reported, with the ratio to the scipy loop.
``--solve`` also times the small batched solves (unrolled Cholesky against
``torch.linalg.cholesky_ex``)::

    python -m benchmarks.batch_fits                 # 1 and 2 torch threads
    python -m benchmarks.batch_fits --device cuda --fits 1000000 --threads 1
    python -m benchmarks.batch_fits --solve
    python -m benchmarks.batch_fits --compile        # also compile=True (compiles first)
    python -m benchmarks.batch_fits --attempt        # one attempt: operations, CPU time
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

import secondorder as so
from secondorder.fitting.batch.small_linalg import solve_columns


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


LABELS = {
    "autodiff": "autodiff Jacobian",
    "analytic": "analytic Jacobian",
    "compiled": "autodiff, compile=True",
}


def bench_fits(args: argparse.Namespace) -> list[str]:
    """Each round: the batch at every thread count (both Jacobians), then the scipy loop."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    X, y, p0 = problems(args.fits, device, dtype)
    ys, p0s = y[: args.scipy], p0[: args.scipy]
    threads = sorted(set(args.threads))
    names = ("autodiff", "analytic", *(("compiled",) if args.compile else ()))
    methods = [(name, t) for t in threads for name in names]
    times: dict[Any, list[float]] = {key: [] for key in methods}
    times["scipy"] = []
    info: dict[Any, Any] = {}
    before = torch.get_num_threads()
    # A first call pays one-off costs (functorch sets up its forward-mode rules).
    so.curve_fit_batch(gauss2d, X, y[:64], p0=p0[:64])
    compile_seconds = {}
    if args.compile:
        # The compiled step is specialised to its slots (4096 on a CPU), model, dtype
        # and thread count: the first call at each thread count compiles.
        first = min(args.fits, 4096)
        for t in threads:
            torch.set_num_threads(t)
            compile_seconds[t], _ = timed(
                lambda: so.curve_fit_batch(gauss2d, X, y[:first], p0=p0[:first], compile=True),
                device,
            )
        torch.set_num_threads(before)

    def fit_all(name: str) -> Any:
        jac = gauss2d_jac if name == "analytic" else None
        return so.curve_fit_batch(gauss2d, X, y, p0=p0, jac=jac, compile=name == "compiled")

    try:
        for _ in range(args.rounds):
            for name, t in methods:
                torch.set_num_threads(t)
                seconds, out = timed(partial(fit_all, name), device)
                times[name, t].append(seconds / args.fits)
                info[name, t] = out[2]
            if args.scipy:
                seconds, ok = scipy_loop(X, ys, p0s)
                times["scipy"].append(seconds / args.scipy)
                info["scipy_ok"] = ok
    finally:
        torch.set_num_threads(before)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    lines = [
        f"- command: `python -m benchmarks.batch_fits {' '.join(args.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{platform.processor() or platform.machine()}, {_device_name(device)}; torch "
        f"{torch.__version__}; load average {_load()}",
        f"- {args.fits} fits of a 2D Gaussian (5 parameters, 5x5 pixels), {args.dtype}, "
        f"{args.rounds} interleaved rounds (each: every thread count, then scipy), medians",
        "",
        "| method | torch threads | µs per fit | fits/s | scipy loop / this | success "
        "| mean nfev |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in methods:
        res, sec = info[name, t], med[name, t]
        ratio = f"{med['scipy'] / sec:.1f}x" if "scipy" in med else ""
        lines.append(
            f"| curve_fit_batch, {LABELS[name]} | {t} | {1e6 * sec:.2f} | {1 / sec:,.0f} | "
            f"{ratio} | {float(res.success.double().mean()):.4f} | "
            f"{float(res.nfev.double().mean()):.2f} |"
        )
    if "scipy" in med:
        lines.append(
            f"| scipy curve_fit loop (float64, {args.scipy} fits) | | {1e6 * med['scipy']:.1f} | "
            f"{1 / med['scipy']:,.0f} | 1.0x | {info['scipy_ok'] / args.scipy:.4f} | |"
        )
    for t, seconds in compile_seconds.items():
        lines.append(
            f"- compile=True, first call at {t} thread(s) (compiles the step): {seconds:.1f} s"
        )
    lines.append(f"- load average after the run: {_load()}")
    return lines


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


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
            b_cols = b.T.contiguous()
            lam = torch.full((args.fits,), 1e-3, dtype=dtype, device=device)
            eye = torch.eye(n, dtype=dtype, device=device)

            def lapack(
                M: torch.Tensor = M, eye: torch.Tensor = eye, b: torch.Tensor = b
            ) -> torch.Tensor:
                L, _ = torch.linalg.cholesky_ex(M + 1e-3 * eye)
                return torch.cholesky_solve(b.unsqueeze(-1), L)

            def unrolled(
                A: torch.Tensor = A, lam: torch.Tensor = lam, b: torch.Tensor = b_cols
            ) -> torch.Tensor:
                return solve_columns(A, lam, b)

            t_l = statistics.median(timed(lapack, device)[0] for _ in range(7))
            t_u = statistics.median(timed(unrolled, device)[0] for _ in range(7))
            lines.append(
                f"| {str(dtype).split('.')[-1]} | {n} | {1e3 * t_l:.2f} | {1e3 * t_u:.2f} | "
                f"{t_l / t_u:.1f}x |"
            )
    return lines


def bench_attempt(args: argparse.Namespace) -> list[str]:
    """Operations dispatched by one attempt, where they come from, and its CPU time."""
    import collections
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from secondorder.fitting.batch import api, driver, engine

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    X, y, p0 = problems(args.fits, device, dtype)
    captured: dict[str, Any] = {}

    def capture(problem: Any, y0: Any, rule: Any, opts: Any) -> Any:
        captured.update(problem=problem, y0=y0, rule=rule, opts=opts)
        return driver.run(problem, y0, rule, opts)

    original = api.run
    api.run = capture
    try:
        so.curve_fit_batch(gauss2d, X, y, p0=p0)
    finally:
        api.run = original
    problem, rule, opts = captured["problem"], captured["rule"], captured["opts"]
    problem = problem.take(torch.arange(args.fits, device=device))

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sites: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            frames = [f for f in traceback.extract_stack()[:-1] if "secondorder" in f.filename]
            site = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].name}" if frames else "?"
            self.sites[site] += 1
            return func(*args, **(kwargs or {}))

    def third_attempt(step: Any) -> tuple[Any, float]:
        state = engine.start(problem, captured["y0"], opts.damping)
        for _ in range(2):
            step(state, problem, rule, budget=opts.budget)
        sync(device)
        start = time.process_time()
        step(state, problem, rule, budget=opts.budget)
        sync(device)
        return state, time.process_time() - start

    state = engine.start(problem, captured["y0"], opts.damping)
    for _ in range(2):
        engine.step(state, problem, rule, budget=opts.budget)
    counter = Count()
    with counter:
        engine.step(state, problem, rule, budget=opts.budget)
    steps: list[tuple[str, Any]] = [("eager", engine.step)]
    if args.compile:
        from secondorder.fitting.batch.compiled import compiled_step

        third_attempt(compiled_step())  # compiles
        steps.append(("compile=True", compiled_step()))
    cpu: dict[str, list[float]] = {name: [] for name, _ in steps}
    for _ in range(5):
        for name, step in steps:
            cpu[name].append(third_attempt(step)[1])
    lines = [
        f"- one attempt (the third) for {args.fits} fits, {args.dtype}, torch threads "
        f"{torch.get_num_threads()}, load average {_load()}",
        f"- operations dispatched (eager): {sum(counter.sites.values())}",
        "",
        "| where (eager) | operations |",
        "|---|---:|",
        *(f"| {site} | {count} |" for site, count in counter.sites.most_common(12)),
        "",
        "| step | CPU ms per attempt (median of 5) |",
        "|---|---:|",
        *(f"| {name} | {1e3 * statistics.median(v):.1f} |" for name, v in cpu.items()),
    ]
    return lines


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


def main(argv: list[str] | None = None) -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=20000)
    parser.add_argument("--scipy", type=int, default=300, help="fits in the scipy loop (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to time"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--solve", action="store_true", help="time the batched solves too")
    parser.add_argument(
        "--compile", action="store_true", help="time compile=True too (compiles first)"
    )
    parser.add_argument(
        "--attempt",
        action="store_true",
        help="only count and time one attempt (operations by site, CPU time)",
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.attempt:
        torch.set_num_threads(min(args.threads))
        print("\n".join(bench_attempt(args)))
        return
    lines = bench_fits(args)
    if args.solve:
        before = torch.get_num_threads()
        torch.set_num_threads(min(args.threads))
        try:
            lines += ["", *bench_solve(args)]
        finally:
            torch.set_num_threads(before)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
