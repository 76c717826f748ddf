"""How fast a sinc step could be: its stages against torch-levenberg-marquardt's step.

    python -m benchmarks.experiments.sinc_ceiling [--rounds 60] [--warm 20] [--threads 2]

The LM targets ask for a sinc step (20,000 points, 193 parameters, float32, full batch)
2.5 times as fast as torch-levenberg-marquardt's.  This script measures, in one
process, what bounds that ratio on this machine:

* both optimizers' median time per step, trained in alternation from the same model
  after ``--warm`` steps each (who goes first alternates), as the benchmark's
  side-by-side line does;
* inside secondorder's steps, the time of each stage: the per-sample rows
  (``jacobian._linear_rule``: the recorded forward pass where none is kept, one
  backward pass, writing J), the Gram (``gram_update``), the Cholesky solves and the
  trial evaluations (``ModelProblem.loss_sum``); the rest of the step is bookkeeping;
* after the rounds, the symmetric rank-k product (scipy's ``ssyrk``) and the general
  product of J's shape, and a 2,000² float32 product for the machine's GEMM rate.

It prints ceilings for ``peer / ours``: the step with its Gram at ``ssyrk``'s time,
and a step that is nothing but its stages (rows, the Gram, one solve, one trial: no
bookkeeping, no rejected attempt), with its own Gram and with ``ssyrk``'s; and the
time 2.5x would leave the Gram in that bare step.  ``ssyrk`` is timed alone: inside a
step scipy's OpenBLAS threads compete with torch's (``benchmarks/notes/NOTES.md``, section
3), so it is a bound, not an option.
The stage times are read by wrapping private functions of the package (exploration
only, as in ``benchmarks.experiments.sinc_steps``).  Results: ``benchmarks/notes/NOTES.md``, "The
ceiling of a sinc step".
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import secondorder.lm.jacobian.outer as jacobian
import secondorder.lm.linalg.cholesky as linalg
import secondorder.lm.problem as problem
from secondorder.lm import LevenbergMarquardt
from secondorder.lm.residuals import mse

from ..core import run_line, settled_heap
from ..lm_floor import median_time
from ..workloads import mlp, sinc_data

#: (module or class, attribute, stage) wrapped to time the stages inside a step.
STAGES: tuple[tuple[Any, str, str], ...] = (
    (jacobian, "_linear_rule", "rows"),
    (problem, "gram_update", "gram"),
    (linalg, "shifted_cholesky_solve", "solve"),
    (problem.ModelProblem, "loss_sum", "trial"),
)


def _timed(fn: Callable[..., Any], stage: str, spent: dict[str, float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[stage] += time.perf_counter() - t0
            spent[stage + " calls"] += 1

    return wrapper


def main(argv: list[str] | None = None) -> int:
    """Measure the steps, their stages and the products; print the ceilings."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30, help="calls per product timed")
    args = ap.parse_args(argv)
    try:
        from torch_levenberg_marquardt import loss as tlm_loss
        from torch_levenberg_marquardt.training import LevenbergMarquardtModule
    except ImportError:
        print("torch-levenberg-marquardt is not installed: pip install 'secondorder[bench]'")
        return 1
    torch.set_num_threads(args.threads)
    print(run_line())
    x, y = sinc_data(20_000)
    make = mlp([1, 64, 1])
    ours = LevenbergMarquardt(make(), mse)
    peer = LevenbergMarquardtModule(make(), loss_fn=tlm_loss.MSELoss())
    for _ in range(args.warm):
        ours.step(x, y)
        peer.training_step(x, y)

    spent: dict[str, float] = defaultdict(float)
    per_step: dict[str, list[float]] = defaultdict(list)
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in STAGES]
    for (owner, name, stage), (_, _, fn) in zip(STAGES, originals, strict=True):
        setattr(owner, name, _timed(fn, stage, spent))
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    try:
        with settled_heap():
            for k in range(args.rounds):
                for who in ("ours", "peer") if k % 2 == 0 else ("peer", "ours"):
                    spent.clear()
                    t0 = time.perf_counter()
                    if who == "ours":
                        ours.step(x, y)
                    else:
                        peer.training_step(x, y)
                    times[who].append(time.perf_counter() - t0)
                    if who == "ours":
                        for stage in ("rows", "gram", "solve", "trial"):
                            per_step[stage].append(spent[stage])
                            calls = max(spent[stage + " calls"], 1.0)
                            per_step[stage + " one"].append(spent[stage] / calls)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)

    n = sum(p.numel() for p in ours.param_groups[0]["params"])
    j = torch.randn(x.shape[0], n + 1)  # J with r as its last column, as the step forms it
    gemm = median_time(lambda: j.T @ j, args.reps)
    syrk: float | None = None
    try:
        from scipy.linalg.blas import ssyrk

        a = j.numpy()
        syrk = median_time(lambda: ssyrk(1.0, a.T, trans=0), args.reps)
    except ImportError:  # pragma: no cover - scipy is a dependency
        pass
    big = torch.randn(2000, 2000)
    peak = 2 * 2000**3 / median_time(lambda: big @ big, args.reps)

    med = {k: statistics.median(v) for k, v in per_step.items()}
    step, other = statistics.median(times["ours"]), statistics.median(times["peer"])
    stages = med["rows"] + med["gram"] + med["solve"] + med["trial"]
    print(
        f"per step, {args.rounds} rounds: secondorder {step * 1e3:.2f} ms, "
        f"torch-levenberg-marquardt {other * 1e3:.2f} ms: {other / step:.2f}x"
    )
    print(
        f"  inside secondorder's step (medians): rows {med['rows'] * 1e3:.2f} ms, "
        f"Gram {med['gram'] * 1e3:.2f} ms, solves {med['solve'] * 1e3:.2f} ms, "
        f"trials {med['trial'] * 1e3:.2f} ms, the rest {(step - stages) * 1e3:.2f} ms"
    )
    print(
        f"  products of J's shape {tuple(j.shape)}: GEMM {gemm * 1e3:.2f} ms, ssyrk "
        + ("-" if syrk is None else f"{syrk * 1e3:.2f} ms")
        + f"; a 2,000² float32 GEMM runs at {peak / 1e9:.0f} GFLOP/s"
    )
    floor = syrk if syrk is not None else 0.5 * gemm
    with_syrk = step - med["gram"] + floor
    stages_once = med["rows"] + med["solve one"] + med["trial one"]
    print(
        f"  ceiling, the step with its Gram at ssyrk's time: {with_syrk * 1e3:.2f} ms, "
        f"{other / with_syrk:.2f}x"
    )
    for label, gram in (("its own Gram", med["gram"]), ("ssyrk", floor)):
        bare = stages_once + gram
        print(
            f"  ceiling, nothing but rows + {label} + one solve + one trial: "
            f"{bare * 1e3:.2f} ms, {other / bare:.2f}x"
        )
    gram_left = other / 2.5 - stages_once
    flops = x.shape[0] * (n + 1) ** 2  # a symmetric product's multiply-adds, doubled
    rate = "" if gram_left <= 0 else f": {flops / gram_left / 1e9:.0f} GFLOP/s"
    print(
        f"  2.5x leaves the Gram {gram_left * 1e3:.2f} ms in that bare step{rate}, counting "
        f"a symmetric product's flops (the step's Gram: {flops / med['gram'] / 1e9:.0f}, "
        f"ssyrk: {flops / floor / 1e9:.0f})"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
