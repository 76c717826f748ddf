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
"""

from __future__ import annotations

import argparse
import time

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
    for step in range(1, args.steps + 1):
        loss, terminated = lma.step(x, y, slice_size=4096)
        if step % max(1, args.steps // 6) == 0 or terminated:
            info = lma.last_info
            print(f"step {step:4d}  loss {loss:.3e}  λ {lma.damping:.1e}  attempts {info.attempts}")
        if terminated:
            print(f"terminated: {lma.last_info.reason}")
            break
    print(f"devices: {[str(d) for d in lma.optimizer.devices]}")
    print(f"{step} steps in {time.perf_counter() - t0:.2f} s, final MSE {loss:.2e}")


if __name__ == "__main__":
    main()
