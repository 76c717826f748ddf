"""gram_dtype settings on the benchmark's problem 1, one after another in one process.

    python -m benchmarks.experiments.precision_problem1 [steps]

sinc(10x), 20,000 points, Linear(1,64)-Tanh-Linear(64,1), float32, full batch, the
same initial weights for every setting; ``steps`` (default 300) LM steps each with
torch's default thread count.  Prints the optimizer's total time, the median step,
how many steps used a float32 normal matrix (and their median), the final MSE and
the time at which the MSE first reached 1e-6.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

import secondorder as so
from secondorder.bench import _mlp, _sinc_data


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    x, y = _sinc_data(20_000)
    settings: list[tuple[str, dict[str, Any]]] = [
        ("float64", {"gram_dtype": torch.float64}),
        ("auto, tol 1e-2", {"gram_auto_tol": 1e-2}),
        ("auto (default)", {}),
        ("float32", {"gram_dtype": torch.float32}),
    ]
    for name, options in settings:
        model = _mlp([1, 64, 1])()
        opt = so.LevenbergMarquardt(model, so.residuals.mse, **options)
        times: list[float] = []
        f32: list[float] = []
        total = 0.0
        reached = None
        loss = float("nan")
        for _ in range(steps):
            t0 = time.perf_counter()
            info = opt.step(x, y)
            dt = time.perf_counter() - t0
            total += dt
            times.append(dt)
            if info.gram_dtype == "float32":
                f32.append(dt)
            loss = info.loss
            if reached is None and loss <= 1e-6:
                reached = total
        med32 = f"{statistics.median(f32) * 1e3:.1f} ms" if f32 else "-"
        hit = "not reached" if reached is None else f"{reached:.2f} s"
        median = statistics.median(times) * 1e3
        print(
            f"{name:15s} total {total:5.2f} s, median step {median:5.1f} ms,"
            f" float32 steps {len(f32):3d} (median {med32}), final MSE {loss:.2e},"
            f" MSE 1e-6 at {hit}"
        )


if __name__ == "__main__":
    main()
