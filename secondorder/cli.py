"""Command line: ``python -m secondorder demo``.

The demo fits ``y = sinc(10x)`` on 20,000 points with a Linear(1,64)-Tanh-Linear(64,1)
network (193 parameters, float32, full batch), once with Levenberg-Marquardt and once
with Adam, from the same initial weights, prints a table and writes a plot of loss
against wall time.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .lm import LevenbergMarquardt
from .lm.residuals import mse

__all__ = ["main", "sinc_data", "sinc_model"]


def sinc_data(points: int = 20_000, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """The demo's data: ``x`` evenly spaced on [-1, 1], ``y = sinc(10x)``."""
    x = torch.linspace(-1.0, 1.0, points, dtype=dtype).unsqueeze(1)
    return x, torch.sinc(10.0 * x)


def sinc_model(hidden: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Linear(1, hidden) - Tanh - Linear(hidden, 1), initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)


@dataclass
class Run:
    """One optimizer's trajectory: loss against step and wall time."""

    name: str
    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def add(self, step: int, seconds: float, loss: float) -> None:
        self.steps.append(step)
        self.seconds.append(seconds)
        self.losses.append(loss)


def _progress(name: str, step: int, total: int, loss: float, extra: str = "") -> None:
    if not sys.stdout.isatty():
        # Logs and CI: a plain line now and then instead of a redrawn bar.
        if step == 1 or step % max(1, total // 8) == 0:
            print(f"{name:<6} {step:>5}/{total}  mse {loss:.3e} {extra}")
        return
    width = 24
    done = int(width * step / max(total, 1))
    bar = "#" * done + "-" * (width - done)
    sys.stdout.write(f"\r{name:<6} [{bar}] {step:>5}/{total}  mse {loss:.3e} {extra:<28}")
    sys.stdout.flush()


def run_lm(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, quiet: bool) -> Run:
    """Train with Levenberg-Marquardt until ``steps`` or termination."""
    opt = LevenbergMarquardt(model, mse)
    run = Run("LM")
    with torch.no_grad():
        run.add(0, 0.0, float(nn.functional.mse_loss(model(x), y)))
    t0 = time.perf_counter()
    for k in range(1, steps + 1):
        info = opt.step(x, y)
        run.add(k, time.perf_counter() - t0, float(info.loss))
        if not quiet:
            _progress(
                "LM", k, steps, float(info.loss), f"λ {info.damping:.1e} tries {info.attempts}"
            )
        if info.terminated:
            if not quiet:
                print(f"\n       stopped: {info.reason}")
            break
    if not quiet and sys.stdout.isatty():
        sys.stdout.write("\n")
    return run


def run_adam(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, quiet: bool
) -> Run:
    """Train with torch.optim.Adam on the full batch for ``steps`` steps."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    run = Run(f"Adam (lr {lr:g})")
    with torch.no_grad():
        run.add(0, 0.0, float(nn.functional.mse_loss(model(x), y)))
    t0 = time.perf_counter()
    for k in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if k % 10 == 0 or k == steps:
            with torch.no_grad():
                current = float(nn.functional.mse_loss(model(x), y))
            run.add(k, time.perf_counter() - t0, current)
            if not quiet:
                _progress("Adam", k, steps, current)
    if not quiet and sys.stdout.isatty():
        sys.stdout.write("\n")
    return run


def _plot(runs: Sequence[Run], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ax.semilogy(run.seconds, run.losses, label=run.name)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("MSE")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _time_to(run: Run, target: float) -> float:
    for t, loss in zip(run.seconds, run.losses, strict=True):
        if loss <= target:
            return t
    return math.nan


def demo(args: argparse.Namespace) -> int:
    """Train the sinc problem with LM and Adam side by side; print a table, write a plot."""
    torch.set_num_threads(args.threads)
    x, y = sinc_data(args.points)
    base = sinc_model(seed=args.seed)
    n = sum(p.numel() for p in base.parameters())
    print(
        f"sinc(10x): {args.points} points, Linear(1,64)-Tanh-Linear(64,1) ({n} parameters), "
        f"float32, full batch, {torch.get_num_threads()} threads"
    )
    lm = run_lm(copy.deepcopy(base), x, y, args.lm_steps, args.quiet)
    adam = run_adam(copy.deepcopy(base), x, y, args.adam_steps, args.adam_lr, args.quiet)
    target = args.target
    print()
    print(f"| optimizer | steps | seconds | s/step | final MSE | time to MSE {target:g} |")
    print("|---|---:|---:|---:|---:|---:|")
    for run in (lm, adam):
        secs = run.seconds[-1]
        tt = _time_to(run, target)
        reached = f"{tt:.2f} s" if math.isfinite(tt) else "not reached"
        print(
            f"| {run.name} | {run.steps[-1]} | {secs:.2f} | {secs / max(run.steps[-1], 1):.4f} "
            f"| {run.losses[-1]:.3e} | {reached} |"
        )
    out = Path(args.out)
    if _plot([lm, adam], out / "demo_sinc.png", "sinc(10x), 193 parameters, float32"):
        print(f"\nplot: {out / 'demo_sinc.png'}")
    else:
        print("\n(matplotlib is not installed: no plot; pip install 'secondorder[plot]')")
    if args.json:
        payload = {
            r.name: {"steps": r.steps, "seconds": r.seconds, "losses": r.losses} for r in (lm, adam)
        }
        Path(args.json).write_text(json.dumps(payload))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m secondorder``."""
    parser = argparse.ArgumentParser(prog="python -m secondorder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="LM against Adam on sinc(10x), with a plot")
    d.add_argument("--points", type=int, default=20_000)
    d.add_argument("--lm-steps", type=int, default=800)
    d.add_argument("--adam-steps", type=int, default=2_000)
    d.add_argument("--adam-lr", type=float, default=1e-2)
    d.add_argument("--target", type=float, default=1e-6, help="MSE for the time-to-target column")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--out", default="out", help="folder for the plot")
    d.add_argument("--json", default=None, help="also write the trajectories to this file")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["bench"], ["scaling"]):
        # The benchmark harness lives outside the wheel, in the repository's benchmarks/.
        print(
            f"the {argv[0]} harness is not part of the installed package: from a checkout "
            f"of secondorder, run `python -m benchmarks.{argv[0]}` (or `make bench`)",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    if args.command == "demo":
        for name in ("points", "lm_steps", "adam_steps", "threads"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        return demo(args)
    return 2  # pragma: no cover - argparse rejects other commands
