"""The capturable LM step against the default one: ops per step, and steps and seconds to target.

    python -m benchmarks.lm_capturable [--device cpu] [--threads 1] [--rounds 2]
        [--problems sinc digits_mlp digits_cnn] [--candidates 1 2 4] [--ops-only] [--tiny]
    python -m benchmarks.lm_capturable --device cuda --step-times [--problems ...]

Two measurements.  **Ops per step**: the aten operations one steady-state sinc step
dispatches (a ``TorchDispatchMode`` counts them after five warm-up steps), for the
default step, the capturable step and torch-levenberg-marquardt when installed; on
CUDA the capturable step is then one graph launch.  **To target**: each method trains
the suite's problem (``benchmarks.lm_problems``, quick sizes) from the same weights
until the problem's target (sinc: MSE 1e-6; digits: test accuracy 0.95); the
methods run in turn, ``--rounds`` times, and the medians of the steps and seconds to
target are printed (``-``: not reached within the problem's steps).  With
``--step-times``, the median time of a step instead, the methods stepping in turn,
and the peer's time per step over ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from secondorder import LevenbergMarquardt

from .core import Problem, batches, resolve_device, run_method, sync
from .lm_methods import _residual_fn, lm_method, tlm_method
from .lm_problems import make_problem
from .ops import count_ops

__all__ = ["main"]


def _ops_table(problem: Problem) -> list[str]:
    x, y = problem.train
    rows = [
        "| method | ops per steady-state step |",
        "|---|---|",
    ]
    variants: list[tuple[str, dict[str, Any]]] = [
        ("secondorder LM (defaults)", {}),
        ("secondorder LM, capturable=True", {"capturable": True, "check_every": 0}),
    ]
    for name, options in variants:
        opt = LevenbergMarquardt(problem.make_model(), **options)
        rows.append(f"| {name} | {count_ops(lambda opt=opt: opt.step(x, y))} |")
    peer = tlm_method(problem)
    if peer.make is not None:
        stepper = peer.make(problem, problem.make_model())
        rows.append(f"| {peer.name} | {count_ops(lambda: stepper(x, y))} |")
    else:
        rows.append(f"| {peer.name} | skipped ({peer.skipped}) |")
    return rows


def _methods(candidates: Sequence[int]) -> list[Any]:
    out = [lm_method("default step", {})]
    for k in candidates:
        out.append(lm_method(f"capturable, candidates={k}", {"capturable": True, "candidates": k}))
    return out


def _to_target(problem: Problem, candidates: Sequence[int], rounds: int) -> list[str]:
    methods = _methods(candidates)
    steps: dict[str, list[float]] = {m.name: [] for m in methods}
    seconds: dict[str, list[float]] = {m.name: [] for m in methods}
    median_step: dict[str, list[float]] = {m.name: [] for m in methods}
    for _ in range(rounds):
        for method in methods:  # in turn, so a burst of load hits all of them alike
            result = run_method(problem, method)
            reached = result.steps_to(problem.target, problem.kind)
            steps[method.name].append(float("nan") if reached is None else reached)
            seconds[method.name].append(result.time_to(problem.target, problem.kind))
            median_step[method.name].append(result.median_step)
    what = "test accuracy" if problem.kind == "classification" else "MSE"
    rows = [
        f"### {problem.title}: to {what} {problem.target:g}",
        "",
        "| method | steps to target | seconds to target | median step |",
        "|---|---|---|---|",
    ]
    for m in methods:
        s, t = statistics.median(steps[m.name]), statistics.median(seconds[m.name])
        step_ms = statistics.median(median_step[m.name]) * 1e3
        shown_s = "-" if s != s else f"{s:.0f}"
        shown_t = "-" if t != t else f"{t:.2f} s"
        rows.append(f"| {m.name} | {shown_s} | {shown_t} | {step_ms:.1f} ms |")
    return [*rows, ""]


def _step_times(problem: Problem, steps: int, warm: int) -> list[str]:
    """Median wall time of a step per method, the methods stepping in turn on one stream.

    Each timed step starts and ends with a device synchronisation; nothing is read
    from the capturable step's report.
    """
    data = batches(problem, 0)
    slice_size = problem.setting("slice_size")
    steppers: list[tuple[str, Callable[[Any, Any], Any]]] = []
    for name, options in [
        ("default", {}),
        ("capturable", {"capturable": True, "check_every": 0}),
    ]:
        opt = LevenbergMarquardt(problem.make_model(), _residual_fn(problem), **options)
        steppers.append((name, lambda x, y, opt=opt: opt.step(x, y, slice_size=slice_size)))
    peer = tlm_method(problem)
    if peer.make is not None:
        steppers.append(("peer", peer.make(problem, problem.make_model())))
    times: dict[str, list[float]] = {name: [] for name, _ in steppers}
    graphs = ""
    for k in range(warm + steps):
        x, y = data[k % len(data)]
        for name, step in steppers:
            sync(problem.device)
            t0 = time.perf_counter()
            out = step(x, y)
            sync(problem.device)
            if k >= warm:
                times[name].append(time.perf_counter() - t0)
            if name == "capturable":
                graphs = out.graph
    ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    rows = []
    for name in ("default", "capturable"):
        ratio = f"{ms['peer'] / ms[name]:.2f}" if "peer" in ms else "-"
        rows.append(f"| {problem.key} | {name} | {ms[name]:.2f} ms | {ratio} |")
    if "peer" in ms:
        rows.append(f"| {problem.key} | torch-levenberg-marquardt | {ms['peer']:.2f} ms | 1 |")
    rows.append(f"| {problem.key} | (capturable's last step: {graphs}) | | |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Print the op counts and the to-target table as Markdown."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--problems", nargs="+", default=["sinc", "digits_mlp"])
    p.add_argument("--candidates", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--ops-only", action="store_true", help="only count the ops per sinc step")
    p.add_argument(
        "--step-times",
        action="store_true",
        help="median time per step of each method, and the peer's over ours (no to-target runs)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per method (--step-times)")
    p.add_argument("--tiny", action="store_true", help="tiny problems (for tests)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds per method and problem")
    p.add_argument("--max-steps", type=int, default=None, help="steps per method and problem")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if device is None:
        return 2
    torch.set_num_threads(args.threads)
    mode = "tiny" if args.tiny else "quick"
    threads = torch.get_num_threads()
    print(f"# Capturable LM step ({device}, {threads} threads, torch {torch.__version__})")
    print()
    sinc = make_problem("sinc", mode).on(device)
    print("## Ops dispatched per sinc step")
    print()
    print("\n".join(_ops_table(sinc)))
    print()
    if args.ops_only:
        return 0
    if args.step_times:
        print(f"## Time per step (median of {args.steps} steps, the methods in turn)")
        print()
        print("| problem | method | time per step | peer's time over ours |")
        print("|---|---|---|---|")
        for key in args.problems:
            problem = sinc if key == "sinc" else make_problem(key, mode).on(device)
            print("\n".join(_step_times(problem, args.steps, warm=5)))
            sys.stdout.flush()
        return 0
    print(f"## Steps and seconds to target (medians of {args.rounds} rounds)")
    print()
    for key in args.problems:
        problem = sinc if key == "sinc" else make_problem(key, mode).on(device)
        limits = {"budget_s": args.budget_s, "max_steps": args.max_steps}
        problem = dataclasses.replace(problem, **{k: v for k, v in limits.items() if v})
        print("\n".join(_to_target(problem, args.candidates, args.rounds)))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
