"""Moving a cuPyLMA curve-fitting script to secondorder: change one import.

    python examples/cupylma_migration.py                        # 20,000 points, every GPU
    python examples/cupylma_migration.py --quick                # for CI
    python examples/cupylma_migration.py --devices cpu,cpu      # two replicas, no GPU needed

The script below is written the way a cuPyLMA user writes one: build a model, pick the
devices, construct ``LMA(model, devices, residual_fn, ...)`` and call
``loss, terminated = lma.step(x, y, slice_size)`` in a loop.  The only edit is the
import line::

    from cupylma import LMA, get_available_gpus                     # before
    from secondorder.compat.cupylma import LMA, get_available_gpus  # after

What changes without touching anything else:

* no CUDA is needed: with no GPU, ``get_available_gpus()`` is empty and the model
  stays on the CPU;
* with several GPUs, the model is replicated on each and the slices of every batch
  are dispatched to them in turn, as in cuPyLMA, but the normal equations are reduced
  and solved with PyTorch on the first GPU: no cuPyNumeric or Legate launcher;
* ``learning_rate`` is applied to each update, and float64 models work;
* the reported loss is ``mean(r²)`` of what ``residual_fn`` returns;
* a dead unit (a zero column of J) no longer stalls training;
* ``lma.last_info`` holds the full :class:`secondorder.StepInfo` (λ, attempts,
  timings) of the last step, and ``so.fit(lma, (x, y))`` drives the same object with a
  progress bar and a history.

The loss against steps and the fitted curve go to ``out/cupylma_migration.png``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from secondorder.compat.cupylma import LMA, get_available_gpus  # the one changed line


def residual_fn(outputs, targets):
    return outputs - targets


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small and fast, for CI")
    parser.add_argument("--points", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--devices", default=None, help="comma-separated devices (default: every GPU)"
    )
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the plot")
    args = parser.parse_args(argv)
    if args.quick:
        args.points, args.steps = 300, 40

    torch.manual_seed(0)
    x = torch.linspace(-1, 1, args.points).unsqueeze(1)
    y = torch.sinc(10 * x)
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))

    devices = get_available_gpus() if args.devices is None else args.devices.split(",")
    # x and y stay on the host: each slice is copied to the device that computes it.
    lma = LMA(
        model,
        devices,
        residual_fn,
        learning_rate=1.0,
        damping_start=1e-3,
        damping_up=10.0,
        damping_down=0.1,
    )

    t0 = time.perf_counter()
    losses = []
    for step in range(1, args.steps + 1):
        loss, terminated = lma.step(x, y, slice_size=4096)
        losses.append(loss)
        if step % max(1, args.steps // 6) == 0 or terminated:
            info = lma.last_info
            print(f"step {step:4d}  loss {loss:.3e}  λ {lma.damping:.1e}  attempts {info.attempts}")
        if terminated:
            print(f"terminated: {lma.last_info.reason}")
            break
    print(f"devices: {[str(d) for d in lma.optimizer.devices]}")
    print(f"{step} steps in {time.perf_counter() - t0:.2f} s, final MSE {loss:.2e}")
    plot(model, x, y, losses, args.out)


def plot(model, x, y, losses, out: Path) -> None:
    """The loss against steps, and the fitted curve against the data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return
    fig, (ax, fx) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.semilogy(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean r²)")
    ax.set_title("LMA from secondorder.compat.cupylma")
    ax.grid(True, which="both", alpha=0.3)
    device = next(model.parameters()).device
    with torch.no_grad():
        fitted = model(x.to(device)).cpu()
    fx.plot(x[:, 0], y[:, 0], "k--", linewidth=0.8, label="sinc(10x)")
    fx.plot(x[:, 0], fitted[:, 0], label="network")
    fx.set_xlabel("x")
    fx.legend()
    fig.tight_layout()
    path = out / "cupylma_migration.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
