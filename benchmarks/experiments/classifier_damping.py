"""Classifiers on mini-batches: the damping matrix D = I against Marquardt's diag(JᵀJ).

    python -m benchmarks.experiments.classifier_damping [--inits 4] [--threads 2]
        [--problems digits_mlp digits_cnn wide_dual]

For each of the bench's digits problems (its quick budget of steps, its batches) and
each initialisation, LM trains once with its classifier defaults (``D = I``), once
with ``damping_matrix="marquardt"`` and torch-levenberg-marquardt once, from the same
weights; initialisation 0 is the bench's own, the others re-draw every layer's
parameters from ``torch.manual_seed(k)``.  Prints the test accuracy and the training
cross-entropy of each run and the median seconds per step (inside the optimizer's
step only), with the date, the thread count and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch
from torch import nn

from ..core import Method, MethodResult, Problem, run_line, train
from ..lm_methods import lm_method, tlm_method
from ..lm_problems import build_problems

PROBLEMS = ("digits_mlp", "digits_cnn", "wide_dual")


def _model(problem: Problem, init: int) -> nn.Module:
    model = problem.make_model()
    if init:
        torch.manual_seed(init)
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if module is not model and callable(reset):
                reset()
    return model


def run(problem: Problem, method: Method, init: int) -> dict[str, Any]:
    """Train ``problem``'s model from initialisation ``init`` with ``method``.

    The bench's own loop (:func:`~benchmarks.core.train`): its batches and step budget,
    the training loss and test accuracy evaluated before and after, outside the clock.
    """
    assert method.make is not None
    model = _model(problem, init)
    steps = problem.max_steps
    step = method.make(problem, model)
    result = train(problem, model, MethodResult(method.name, method.settings), step, steps, steps)
    return {"acc": result.accuracies[-1], "ce": result.losses[-1], "step_s": result.median_step}


def main(argv: list[str] | None = None) -> int:
    """Run every problem, method and initialisation; print one line per method."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inits", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{run_line()}, initialisations 0-{args.inits - 1}")
    problems = build_problems(quick=True, keys=args.problems)
    for key, problem in problems.items():
        methods = {
            "LM defaults (D = I)": lm_method("LM defaults", {}),
            "LM, D = Marquardt": lm_method("LM marquardt", {"damping_matrix": "marquardt"}),
            "torch-levenberg-marquardt": tlm_method(problem),
        }
        for name, method in methods.items():
            if method.make is None:
                print(f"{key:10s} {name:26s} skipped: {method.skipped}")
                continue
            runs = [run(problem, method, init) for init in range(args.inits)]
            accs = " ".join(f"{r['acc']:.3f}" for r in runs)
            ces = " ".join(f"{r['ce']:.3g}" for r in runs)
            ms = statistics.median(r["step_s"] for r in runs) * 1e3
            print(
                f"{key:10s} {name:26s} test acc {accs} | train CE {ces} | "
                f"{ms:.1f} ms/step ({problem.max_steps} steps)",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
