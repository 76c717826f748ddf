"""How far sinc's time to MSE 1e-6 moves when the start moves by a rounding error.

    python -m benchmarks.experiments.sinc_spread [--device cuda] [--steps 600] [--threads 2]

The quick suite's sinc problem (20,000 points, 193 parameters, float32), trained by
secondorder LM with its defaults from the suite's initial weights, and from those
weights scaled by ``1 + ε`` for a few ε of float32 rounding size.  Printed per start:
the steps and the optimizer's seconds until the MSE first goes below 1e-6 (checked
after every step, outside the clock), and the MSE after ``--steps`` steps.  A float32
LM trajectory on a network is chaotic: a time to the target from one start is one
draw, and this spread says how wide the draws are.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

import secondorder as so

from ..core import resolve_device, sync
from ..lm_problems import make_problem

PERTURBATIONS = (0.0, 1e-7, -1e-7, 3e-7)


def run(device: str, eps: float, steps: int, target: float = 1e-6) -> str:
    """One start: steps and seconds to ``target``, and the MSE after ``steps`` steps."""
    problem = make_problem("sinc", "quick").on(device)
    x, y = problem.train
    model = problem.make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + eps)
    opt = so.LevenbergMarquardt(model, so.residuals.mse)
    hit, clock = None, 0.0
    for k in range(steps):
        sync(device)
        t0 = time.perf_counter()
        opt.step(x, y)
        sync(device)
        clock += time.perf_counter() - t0
        if hit is None:
            with torch.no_grad():
                if float(((model(x) - y) ** 2).mean()) <= target:
                    hit = f"{k + 1} steps, {clock:.2f} s"
    with torch.no_grad():
        mse = float(((model(x) - y) ** 2).mean())
    return (
        f"| {eps:+.0e} | {hit or f'not within {steps} steps'} | {mse:.2e} | "
        f"{1e3 * clock / steps:.1f} ms |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.experiments.sinc_spread``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.experiments.sinc_spread")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if device is None:
        return 2
    torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device != "cpu" else "the CPU"
    print(f"sinc from perturbed starts on {name}, {args.threads} torch threads\n")
    print("| start scaled by 1 + ε | to MSE 1e-6 | MSE at the end | mean step |")
    print("|---:|---|---:|---:|")
    for eps in PERTURBATIONS:
        print(run(device, eps, args.steps), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
