"""Interleaved time per step: secondorder LM against torch-levenberg-marquardt.

    python -m benchmarks.experiments.lm_side_by_side [--problems sinc wide_dual digits_cnn]
        [--rounds 15] [--threads 2] [--base DIR] [--options '{"gram_dtype": "float32"}']

For each problem every stepper is warmed up for ``--warm`` steps, then timed one step
per round over ``--rounds`` rounds, each step from the same point (parameters and λ
restored after it, outside the clock), so a burst of load on a shared machine hits
every stepper alike; the order rotates from round to round, since a step's time depends
on the step run before it.  sinc is full-batch; the classifiers warm up on
successive mini-batches of the training set, as training does, and the timed step takes
the next one (steps repeated on one batch would fit it to a loss near zero, where no
training step is taken).  Prints the median and minimum
ms per step and ``peer / ours`` of the medians, with the thread count, the load
average before and after and the date.  With ``--base DIR``, ``DIR/secondorder_base``
is an older copy of the package (``git archive <commit> secondorder | tar -x -C DIR``,
then renamed) timed in the same rounds: before and after, side by side.
``--low-thresholds`` keeps glibc's allocator thresholds where a fresh process has
them (the optimizer otherwise raises them, for every stepper in the process).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import secondorder
import secondorder._host_memory as host_memory

from ..workloads import cnn, digits, mlp, sinc_data

Batches = list[tuple[Tensor, Tensor]]

#: problem -> (batches, model maker, kind)
PROBLEMS: dict[str, tuple[Callable[[], Batches], Callable[[], nn.Module], str]] = {
    "sinc": (lambda: [sinc_data(20_000)], mlp([1, 64, 1]), "regression"),
    "wide_dual": (lambda: _batches(128), mlp([64, 256, 10]), "classification"),
    "digits_cnn": (lambda: _batches(256), cnn(8), "classification"),
}


def _batches(size: int) -> Batches:
    """The digits training set in successive batches of ``size`` (the last, short one dropped)."""
    x, y = digits()[0]
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0] - size + 1, size)]


Step = Callable[[], float]


def ours(pkg: Any, key: str, warm: int, options: dict[str, Any]) -> Step:
    """A warmed-up secondorder optimizer timing one step from one fixed point."""
    data, make, kind = PROBLEMS[key]
    batches = data()
    model = make()
    res = pkg.residuals.cross_entropy if kind == "classification" else pkg.residuals.mse
    opt = pkg.LevenbergMarquardt(model, res, **options)
    for i in range(warm):
        opt.step(*batches[i % len(batches)])
    x, y = batches[warm % len(batches)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    damping = opt.internals().damping_state
    saved = (damping.damping, damping.nu)

    def step() -> float:
        t0 = time.perf_counter()
        opt.step(x, y)
        dt = time.perf_counter() - t0
        model.load_state_dict(state)
        current = opt.internals().damping_state
        current.damping, current.nu = saved
        return dt

    return step


def peer(key: str, warm: int) -> Step | None:
    """torch-levenberg-marquardt's training step, from one fixed point (None: missing)."""
    try:
        from torch_levenberg_marquardt import loss as tlm_loss
        from torch_levenberg_marquardt.training import LevenbergMarquardtModule
    except ImportError:
        return None
    data, make, kind = PROBLEMS[key]
    batches = data()
    model = make()
    loss = tlm_loss.CrossEntropyLoss() if kind == "classification" else tlm_loss.MSELoss()
    module = LevenbergMarquardtModule(model, loss_fn=loss)
    for i in range(warm):
        module.training_step(*batches[i % len(batches)])
    x, y = batches[warm % len(batches)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    damping = module.damping_strategy.damping_factor  # type: ignore[attr-defined]

    def step() -> float:
        t0 = time.perf_counter()
        module.training_step(x, y)
        dt = time.perf_counter() - t0
        model.load_state_dict(state)
        module.backup_parameters()
        module.damping_strategy.damping_factor = damping  # type: ignore[attr-defined]
        return dt

    return step


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", default=None, help="folder holding secondorder_base")
    ap.add_argument("--options", default="{}", help="JSON options for both packages")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument(
        "--low-thresholds",
        action="store_true",
        help="leave glibc's mmap and trim thresholds where they start "
        "(secondorder._host_memory), to measure what raising them gains",
    )
    args = ap.parse_args(argv)
    if args.low_thresholds:
        host_memory._done = True  # as though raised before: the optimizers leave them
    torch.set_num_threads(args.threads)
    options = json.loads(args.options)
    for k, v in options.items():
        if isinstance(v, str) and v.startswith("float"):
            options[k] = getattr(torch, v)
    packages: dict[str, Any] = {"new": secondorder}
    if args.base:
        sys.path.insert(0, args.base)
        packages["base"] = importlib.import_module("secondorder_base")
    load0 = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"{started:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"load {load0[0]:.2f}, options {args.options}"
    )
    for key in args.problems:
        fns: dict[str, Step] = {}
        for tag, pkg in packages.items():
            fns[tag] = ours(pkg, key, args.warm, options)
        if not args.no_peer:
            p = peer(key, args.warm)
            if p is not None:
                fns["peer"] = p
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():
            f()
        # Each round starts one stepper later: a stepper's time depends on which ran
        # before it (a copy of the same package timed 11% slower on wide_dual when
        # it always ran right after the peer), so every stepper takes every place.
        order = list(fns.items())
        for i in range(args.rounds):
            shift = i % len(order)
            for k, f in order[shift:] + order[:shift]:
                times[k].append(f())
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [f"{k} {med[k] * 1e3:7.2f} ms (min {min(times[k]) * 1e3:6.2f})" for k in fns]
        print(f"{key:11s} " + "; ".join(cells))
        if "peer" in med:
            ratios = [f"peer/{k} {med['peer'] / med[k]:.2f}" for k in packages]
            print(f"{'':11s} " + ", ".join(ratios))
        if "base" in med:
            print(f"{'':11s} base/new {med['base'] / med['new']:.2f}")
    load1 = os.getloadavg()
    print(f"load average after: {load1[0]:.2f} (1 min), {load1[1]:.2f} (5 min)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
