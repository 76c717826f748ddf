"""LM on a classifier: torch-levenberg-marquardt's MNIST CNN example, on digits at 28x28.

``python -m benchmarks.lm_classifier [--quick] [--threads 1] [--trace]``

The network is the one of torch-levenberg-marquardt's ``examples/mnist_classification.py``
(five ELU convolutions, 4x4 stride 2, 4x4 stride 2, then three 2x2, and a
``Linear(16, 10)``: 1,026 parameters).  MNIST cannot be downloaded here, so the data are
scikit-learn's digits (:func:`benchmarks.workloads.digits`: 1,437 train and 360 test
images) upsampled from 8x8 to 28x28 bilinearly.  Every step sees the whole training
set (1,437 residuals > 1,026 parameters: the primal form for both optimizers).

Methods, all on the same data and from the same initial weights (one seed per run):

* ``peer example``: torch-levenberg-marquardt 1.2.3 as its MNIST example configures
  it (``learning_rate=0.05``, ``attempts_per_step=10``, ``solve_method="cholesky"``,
  its ``StandardDampingStrategy``: λ from 1e-3, x0.1 / x10, ``D = I``);
* ``peer module defaults``: ``LevenbergMarquardtModule`` with nothing set
  (``learning_rate=1``, ``solve_method="qr"``);
* ``LM nielsen (old default)``: ``LevenbergMarquardt(model, cross_entropy,
  damping_rule="nielsen")``, the default before the classifier rule;
* ``LM classifier defaults``: the options :meth:`secondorder.lm.config.LMConfig.for_residual`
  gives ``cross_entropy`` (:mod:`secondorder.lm.classifier_defaults`);
* full run only: ``LM classifier defaults, float32 Gram`` (``gram_dtype=torch.float32``,
  the peer's precision) and ``LM nielsen lr=0.05``, the old default with the
  example's step scale.

Runs are interleaved (seed by seed, every method in turn) in one process, so a burst
of load on this shared machine hits every method alike; wall time is the training
loop only (the final evaluation is outside the clock).  ``--trace`` prints λ, ρ and
the attempts of every step.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secondorder import LevenbergMarquardt
from secondorder.lm.classifier_defaults import residual_defaults
from secondorder.lm.residuals import cross_entropy

from .workloads import digits

__all__ = ["Run", "mnist_cnn", "run_lm", "run_peer", "upsampled_digits"]


def upsampled_digits() -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """scikit-learn's digits, 8x8 in [0, 1], bilinearly upsampled to 1x28x28 images."""
    (xtr, ytr), (xte, yte) = digits()

    def up(x: Tensor) -> Tensor:
        img = x.reshape(-1, 1, 8, 8)
        return F.interpolate(img, size=(28, 28), mode="bilinear", align_corners=False)

    return (up(xtr), ytr), (up(xte), yte)


def mnist_cnn(seed: int) -> nn.Module:
    """The peer's MNIST CNN (1,026 parameters), initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, kernel_size=4, stride=2),  # 8 x 13 x 13
        nn.ELU(),
        nn.Conv2d(8, 4, kernel_size=4, stride=2),  # 4 x 5 x 5
        nn.ELU(),
        nn.Conv2d(4, 4, kernel_size=2),  # 4 x 4 x 4
        nn.ELU(),
        nn.Conv2d(4, 4, kernel_size=2),  # 4 x 3 x 3
        nn.ELU(),
        nn.Conv2d(4, 4, kernel_size=2),  # 4 x 2 x 2
        nn.ELU(),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


@dataclass
class Run:
    """One method on one seed: what it reached and what its damping did."""

    method: str
    seed: int
    train_ce: float = float("nan")
    test_acc: float = float("nan")
    steps: int = 0
    attempts: int = 0
    seconds: float = 0.0
    stopped: str = ""
    #: (loss, λ after the step, ρ or nan, attempts) per step.
    trace: list[tuple[float, float, float, int]] = field(default_factory=list)
    #: seconds since the start at the end of each step.
    clock: list[float] = field(default_factory=list)

    def time_to(self, target: float) -> tuple[int, float] | None:
        """(steps, seconds) until the step's train loss first fell to ``target``."""
        for k, (loss, _, _, _) in enumerate(self.trace):
            if loss <= target:
                return k + 1, self.clock[k]
        return None


Data = tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]


def _evaluate(model: nn.Module, data: Data, run: Run) -> None:
    (xtr, ytr), (xte, yte) = data
    with torch.no_grad():
        run.train_ce = float(F.cross_entropy(model(xtr), ytr))
        run.test_acc = float((model(xte).argmax(1) == yte).double().mean())


def run_lm(name: str, options: dict[str, Any], data: Data, seed: int, steps: int) -> Run:
    """secondorder's LM with ``options`` for ``steps`` full-batch steps (or until it ends)."""
    model = mnist_cnn(seed)
    opt = LevenbergMarquardt(model, cross_entropy, **options)
    (xtr, ytr), _ = data
    run = Run(name, seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        info = opt.step(xtr, ytr)
        run.steps += 1
        run.attempts += info.attempts
        run.trace.append((info.loss, info.damping, info.gain_ratio, info.attempts))
        run.clock.append(time.perf_counter() - t0)
        if info.terminated:
            run.stopped = info.reason
            break
    run.seconds = time.perf_counter() - t0
    _evaluate(model, data, run)
    return run


def run_peer(name: str, options: dict[str, Any], data: Data, seed: int, steps: int) -> Run:
    """torch-levenberg-marquardt's training step with ``options``, as :func:`run_lm`."""
    from torch_levenberg_marquardt import loss as tlm_loss
    from torch_levenberg_marquardt.training import LevenbergMarquardtModule

    # Its failed Cholesky factorisations are logged as warnings; they are counted as
    # attempts here instead.
    logging.getLogger("torch_levenberg_marquardt.training").setLevel(logging.ERROR)
    model = mnist_cnn(seed)
    module = LevenbergMarquardtModule(model, loss_fn=tlm_loss.CrossEntropyLoss(), **options)
    (xtr, ytr), _ = data
    run = Run(name, seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, loss, stop, logs = module.training_step(xtr, ytr)
        run.steps += 1
        run.attempts += int(logs["attempts"])
        run.trace.append((float(loss), float(logs["damping"]), float("nan"), int(logs["attempts"])))
        run.clock.append(time.perf_counter() - t0)
        if stop:
            run.stopped = "damping reached its maximum"
            break
    run.seconds = time.perf_counter() - t0
    _evaluate(model, data, run)
    return run


Method = tuple[str, Callable[[str, dict[str, Any], Data, int, int], Run], dict[str, Any]]


def methods(quick: bool) -> list[Method]:
    """The methods compared, in the report's order."""
    out: list[Method] = [
        (
            "peer example (lr 0.05, cholesky)",
            run_peer,
            {"learning_rate": 0.05, "attempts_per_step": 10, "solve_method": "cholesky"},
        ),
        ("peer module defaults (lr 1, qr)", run_peer, {}),
        ("LM nielsen (old default)", run_lm, {"damping_rule": "nielsen"}),
        ("LM classifier defaults", run_lm, residual_defaults(cross_entropy)),
    ]
    if not quick:
        f32 = {**residual_defaults(cross_entropy), "gram_dtype": torch.float32}
        out.append(("LM classifier defaults, float32 Gram", run_lm, f32))
        out.append(("LM nielsen lr=0.05", run_lm, {"damping_rule": "nielsen", "lr": 0.05}))
    return out


def _fmt_ce(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 or x == 0 else f"{x:.2e}"


def report(runs: list[Run], order: list[str], target: float) -> list[str]:
    """One row per method: medians over seeds (and the range of CE and accuracy).

    ``to target``: the median steps and seconds until the step's train cross-entropy
    first fell to ``target`` (over the seeds that reached it: ``k/n``).
    """
    lines = [
        "| method | train CE (median; min-max) | test acc (median; min-max) | steps | "
        f"attempts | wall s (median) | s/step | to CE <= {target:.3g}: steps, s |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for name in order:
        rs = [r for r in runs if r.method == name]
        ce = [r.train_ce for r in rs]
        acc = [r.test_acc for r in rs]
        steps = statistics.median(r.steps for r in rs)
        sec = statistics.median(r.seconds for r in rs)
        per = statistics.median(r.seconds / max(r.steps, 1) for r in rs)
        lines.append(
            f"| {name} | {_fmt_ce(statistics.median(ce))}; {_fmt_ce(min(ce))}-{_fmt_ce(max(ce))}"
            f" | {statistics.median(acc):.3f}; {min(acc):.3f}-{max(acc):.3f} | {steps:g} | "
            f"{statistics.median(r.attempts for r in rs):g} | {sec:.2f} | {per:.3f} | "
            f"{_reached(rs, target)} |"
        )
    return lines


def _reached(rs: list[Run], target: float) -> str:
    hits = [h for h in (r.time_to(target) for r in rs) if h is not None]
    if not hits:
        return f"not reached (0/{len(rs)})"
    steps = statistics.median(h[0] for h in hits)
    sec = statistics.median(h[1] for h in hits)
    return f"{steps:g}, {sec:.2f} ({len(hits)}/{len(rs)})"


def damping_lines(runs: list[Run], order: list[str]) -> list[str]:
    """λ after steps 1, 10, 20, ... and the mean attempts per step, first seed."""
    lines = ["", "λ after the step (first seed); attempts per step in brackets:", ""]
    for name in order:
        r = next(r for r in runs if r.method == name)
        marks = [0, 9, 19, 29, 39, 49, 59]
        cells = [f"{k + 1}: {r.trace[k][1]:.2g}" for k in marks if k < len(r.trace)]
        mean_att = r.attempts / max(r.steps, 1)
        tail = f" (stopped at step {r.steps}: {r.stopped})" if r.stopped else ""
        lines.append(f"- {name}: " + ", ".join(cells) + f" [{mean_att:.2f}]{tail}")
    return lines


def sinc_check(steps: int, target: float = 1e-6) -> list[str]:
    """The sinc fit of the LM suite under the defaults ``mse`` gets, and under the rule.

    sinc(10x) on 20,000 points, ``Linear(1,64)-Tanh-Linear(64,1)``, float32, full
    batch (:mod:`benchmarks.lm_problems`' "sinc").  ``LMConfig.for_residual(mse)`` is
    ``LMConfig()`` (tested), so "defaults" is the sinc run before and after this
    change; "multiplicative" shows what the classifier rule would do to it.
    """
    from secondorder.lm.residuals import mse

    from .workloads import mlp, sinc_data

    x, y = sinc_data(20_000)
    lines = [
        "| sinc config | final MSE | steps | to MSE <= 1e-6: steps, s | wall s |",
        "|---|---:|---:|---|---:|",
    ]
    for name, options in (
        ("defaults (mse: LMConfig.for_residual(mse) == LMConfig())", residual_defaults(mse)),
        ("damping_rule='multiplicative'", {"damping_rule": "multiplicative"}),
    ):
        model = mlp([1, 64, 1])()
        opt = LevenbergMarquardt(model, mse, **options)
        t0 = time.perf_counter()
        hit = None
        k = 0
        for k in range(steps):
            info = opt.step(x, y)
            if hit is None and info.loss <= target:
                hit = (k + 1, time.perf_counter() - t0)
            if info.terminated:
                break
        sec = time.perf_counter() - t0
        reached = "not reached" if hit is None else f"{hit[0]}, {hit[1]:.2f}"
        lines.append(f"| {name} | {info.loss:.3g} | {k + 1} | {reached} | {sec:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, the four main methods")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument("--seeds", type=int, default=None, help="seeds (default 3, --quick 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--trace", action="store_true", help="print λ, ρ, attempts of every step")
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="train CE for the time-to-target column (default: the peer example's median)",
    )
    p.add_argument(
        "--sinc",
        type=int,
        default=0,
        metavar="STEPS",
        help="only the sinc check: STEPS steps under the defaults and the classifier rule",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.sinc:
        load = os.getloadavg()
        print(
            f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
            f"{torch.get_num_threads()} thread(s), load average {load[0]:.1f}"
        )
        print("\n".join(sinc_check(args.sinc)))
        return 0
    seeds = range(args.seeds if args.seeds is not None else 1 if args.quick else 3)
    data = upsampled_digits()
    ms = methods(args.quick)
    load0 = os.getloadavg()
    print(
        f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), load average at start "
        f"{load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}, {args.steps} full-batch steps, "
        f"seeds {list(seeds)}"
    )
    runs: list[Run] = []
    for seed in seeds:
        for name, fn, options in ms:
            run = fn(name, options, data, seed, args.steps)
            runs.append(run)
            print(
                f"seed {seed} {name}: CE {_fmt_ce(run.train_ce)} acc {run.test_acc:.3f} "
                f"steps {run.steps} attempts {run.attempts} {run.seconds:.2f} s",
                flush=True,
            )
            if args.trace:
                for k, (loss, lam, rho, att) in enumerate(run.trace):
                    print(f"  step {k + 1}: loss {loss:.4g} λ {lam:.3g} ρ {rho:.3g} att {att}")
    load1 = os.getloadavg()
    print()
    target = args.target
    if target is None:
        target = statistics.median(r.train_ce for r in runs if r.method == ms[0][0])
    print("\n".join(report(runs, [m[0] for m in ms], target)))
    print("\n".join(damping_lines(runs, [m[0] for m in ms])))
    print(f"\nload average at the end {load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
