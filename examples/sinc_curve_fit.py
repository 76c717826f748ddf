"""Fit y = sinc(10x) with a small MLP: Levenberg-Marquardt against Adam, loss against time.

    python examples/sinc_curve_fit.py            # 20,000 points, about a minute on 2 cores
    python examples/sinc_curve_fit.py --quick    # a few seconds, for CI

Both optimizers start from the same initial weights and see the full batch every step.
LM is driven by ``so.fit``, which also records the wall time of every step; Adam by the
usual loop.  The plot of MSE against seconds is written to ``out/sinc_curve_fit.png``.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from torch import nn

import secondorder as so
from secondorder.training import fit


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def train_adam(model, x, y, steps, lr, budget):
    """Full-batch Adam; returns (seconds, mse) pairs, stopping at ``steps`` or ``budget`` s."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    curve = []
    t0 = time.perf_counter()
    for k in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if k % 10 == 0 or k == steps:
            with torch.no_grad():
                curve.append((time.perf_counter() - t0, float(nn.functional.mse_loss(model(x), y))))
            if curve[-1][0] > budget:
                break
    return curve


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small and fast, for CI")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the plot")
    parser.add_argument("--points", type=int, default=20_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400, help="LM steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.points, args.hidden, args.steps = 300, 32, 100

    x = torch.linspace(-1, 1, args.points).unsqueeze(1)
    y = torch.sinc(10 * x)
    model = make_model(args.hidden, args.seed)
    adam_model = copy.deepcopy(model)

    opt = so.LevenbergMarquardt(model, so.residuals.mse)
    history = fit(opt, (x, y), epochs=args.steps, progress=not args.quick)
    lm_time = history.time[-1]
    print(f"LM:   {len(history)} steps in {lm_time:.2f} s, MSE {history.loss[-1]:.2e}")
    print(f"      ({history.stop_reason})")

    # Give Adam the same wall-clock budget (and at least 2,000 steps' worth of chances).
    curve = train_adam(adam_model, x, y, steps=100_000, lr=1e-2, budget=max(lm_time, 1.0))
    print(f"Adam: {10 * len(curve)} steps in {curve[-1][0]:.2f} s, MSE {curve[-1][1]:.2e}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    history.plot(x="time", ax=ax, label="Levenberg-Marquardt (secondorder)")
    ax.semilogy([t for t, _ in curve], [m for _, m in curve], label="Adam (lr 1e-2)")
    ax.legend()
    ax.set_ylabel("MSE")
    ax.set_title(f"sinc(10x), {args.points} points, {opt.num_parameters} parameters")
    fig.tight_layout()  # after the title: history.plot laid the figure out without one
    path = args.out / "sinc_curve_fit.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
