"""float64, float32 and "auto" normal matrices over six initialisations.

    python -m benchmarks.experiments.precision_seeds [points] [steps]

sinc(10x) on ``points`` (default 2,000) random points in [-1, 1],
Linear(1,64)-Tanh-Linear(64,1) in float32, full batch, ``steps`` (default 400) LM
steps with the defaults except ``gram_dtype``; one torch thread.  Prints, per seed
and setting, the final MSE, the optimizer's wall time and how many steps used a
float32 normal matrix.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import secondorder as so


def main() -> None:
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    g = torch.Generator().manual_seed(123)
    x = torch.rand(n, 1, generator=g) * 2 - 1
    y = torch.sinc(10 * x)
    settings: list[tuple[str, torch.dtype | str]] = [
        ("float64", torch.float64),
        ("float32", torch.float32),
        ("auto", "auto"),
    ]
    for seed in range(6):
        row = []
        for name, gram_dtype in settings:
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))
            opt = so.LevenbergMarquardt(model, so.residuals.mse, gram_dtype=gram_dtype)
            t0 = time.perf_counter()
            f32 = taken = 0
            while taken < steps:
                info = opt.step(x, y)
                taken += 1
                f32 += info.gram_dtype == "float32"
                if info.terminated:
                    break
            seconds = time.perf_counter() - t0
            with torch.no_grad():
                mse = float(((model(x) - y) ** 2).mean())
            row.append(f"{name} {mse:.1e} {seconds:5.1f} s, float32 {f32}/{taken}")
        print(f"seed {seed}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
