"""Benchmark suite: ``python -m secondorder bench``.

Runs secondorder's Levenberg-Marquardt against its peers in one process, on the same
data, from the same initial weights, with the same thread count:

* secondorder LM with its default settings, and with the fastest settings measured
  for the problem (stated in the output);
* torch-levenberg-marquardt (``pip install 'secondorder[bench]'``), through its own
  ``LevenbergMarquardtModule.training_step`` with its defaults; skipped with a note
  when it is not installed;
* ``torch.optim.Adam`` with a learning rate tuned per problem (stated in the output);
* ``scipy.optimize.least_squares`` (``"lm"`` and ``"trf"``) on the curve-fitting
  problems, in float64, with the Jacobian from torch autograd and a time cap.

Every method is timed on its own work only: the loss and accuracy curves are
evaluated outside the clock.  For each problem the suite also measures the floor of
an LM step on this machine, in the same process: a plain ``JᵀJ`` product of the
Jacobian's shape (and ``?syrk``, which computes it with half the flops) and one
forward plus backward pass of the model on the batch.  The ratios
``(Gram + solve) / GEMM`` and ``Jacobian / (forward + backward)`` are what to compare
across machines; absolute seconds on a shared machine are noisy.

The stages inside an LM step are measured by calling the optimizer's internals
(``opt._problem.strategy``, ``linearize``, ``solver.factor``, ``loss_sum``), because
:class:`~secondorder.lm.StepInfo` reports only ``linearize`` (Jacobian and Gram
together) and ``solve_and_trials``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from secondorder import LevenbergMarquardt
from secondorder.lm.linalg import gram_update
from secondorder.lm.residuals import cross_entropy, mse

from . import scaling as scaling_module

__all__ = [
    "METHODS",
    "PROBLEMS",
    "MethodResult",
    "Problem",
    "ProblemResult",
    "add_bench_parser",
    "build_problems",
    "run_bench",
    "run_problem",
]

PROBLEMS = ("sinc", "sinc_large", "digits_mlp", "digits_cnn", "wide_dual", "wide_cg")
METHODS = ("lm", "lm_fast", "tlm", "adam", "scipy")


# ---------------------------------------------------------------------------------------
# Problems


@dataclass
class Problem:
    """One benchmark problem: data, a model factory, a target and the budgets.

    Attributes:
        key: short name used by ``--problems`` and in the JSON.
        title: one line for tables and plots.
        kind: ``"regression"`` (MSE, target is a loss) or ``"classification"``
            (cross-entropy through the square-root trick, target is a test accuracy).
        train, test: ``(inputs, targets)``; ``test`` only for classification.
        make_model: builds the model from a fixed seed (same weights every call).
        batch_size: samples per step; ``None`` is full batch.
        slice_size: samples per Jacobian slice of the LM methods (``None``: theirs).
        target: MSE to reach (regression) or test accuracy to reach (classification).
        max_steps: steps per LM method; Adam gets ``adam_steps``.
        budget_s: wall-clock cap per method (optimizer time only).
        adam_lr: learning rate of Adam, chosen by the sweep recorded in ``adam_note``.
        lm_fast: options of "secondorder LM (fastest)".
        lm_extra: further LM variants to run, ``{label: options}``.
        scipy: whether scipy.optimize.least_squares runs on it (curve fitting only).
        eval_every: steps between two points of the loss curve (untimed evaluations).
    """

    key: str
    title: str
    kind: str
    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor] | None
    make_model: Callable[[], nn.Module]
    batch_size: int | None
    slice_size: int | None
    target: float
    max_steps: int
    adam_steps: int
    budget_s: float
    adam_lr: float
    adam_note: str
    lm_fast: dict[str, Any]
    lm_extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    scipy: bool = False
    eval_every: int = 1

    @property
    def num_parameters(self) -> int:
        """Trainable scalars of the model."""
        return sum(p.numel() for p in self.make_model().parameters() if p.requires_grad)


def _sinc_data(points: int) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1.0, 1.0, points).unsqueeze(1)
    return x, torch.sinc(10.0 * x)


def _mlp(sizes: Sequence[int], seed: int = 0) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.Tanh())
        return nn.Sequential(*layers)

    return make


def _cnn(channels: int, seed: int = 0) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, channels, 3, padding=1),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(channels * 16, 10),
        )

    return make


@functools.lru_cache(maxsize=2)
def _digits(limit: int | None = None) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """scikit-learn's digits (shipped with the package): 8x8 images scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(0.8 * x.shape[0])
    train, test = (x[:split], y[:split]), (x[split:], y[split:])
    if limit is not None:
        train = (train[0][:limit], train[1][:limit])
        test = (test[0][: limit // 2], test[1][: limit // 2])
    return train, test


_ADAM_SWEEP = "fixed per problem, not swept in this run"


def build_problems(
    quick: bool = False, tiny: bool = False, keys: Sequence[str] = PROBLEMS
) -> dict[str, Problem]:
    """The problems named in ``keys``, built (and their data loaded) on demand.

    ``quick`` shrinks the budgets to a few minutes in all on 2 cores; ``tiny`` shrinks
    everything to seconds (for tests).
    """
    unknown = [k for k in keys if k not in PROBLEMS]
    if unknown:
        raise ValueError(f"Unknown problems {unknown}; valid choices are {PROBLEMS}.")
    makers = _tiny_problems() if tiny else _problems(quick)
    return {k: makers[k]() for k in keys}


_F32 = {"gram_dtype": torch.float32}


def _tiny_problems() -> dict[str, Callable[[], Problem]]:
    f32 = _F32
    small: dict[str, Any] = dict(
        max_steps=4, adam_steps=8, budget_s=20.0, adam_lr=1e-2, adam_note="fixed"
    )
    return {
        "sinc": lambda: Problem(
            "sinc", "sinc(10x), 200 points, tiny", "regression", _sinc_data(200), None,
            _mlp([1, 6, 1]), None, None, 1e-6, lm_fast=f32, scipy=True, **small,
        ),
        "sinc_large": lambda: Problem(
            "sinc_large", "sinc(10x), 300 points, sliced, tiny", "regression",
            _sinc_data(300), None, _mlp([1, 8, 1]), None, 100, 1e-6, lm_fast=f32,
            **small,
        ),
        "digits_mlp": lambda: Problem(
            "digits_mlp", "digits MLP, tiny", "classification", *_digits(96),
            _mlp([64, 8, 10]), 32, None, 0.5, lm_fast=f32, **small,
        ),
        "digits_cnn": lambda: Problem(
            "digits_cnn", "digits CNN, tiny", "classification", *_digits(96), _cnn(2),
            32, None, 0.5, lm_fast=f32, **small,
        ),
        "wide_dual": lambda: Problem(
            "wide_dual", "wide MLP, dual form, tiny", "classification", *_digits(96),
            _mlp([64, 16, 10]), 16, None, 0.5, lm_fast={"form": "dual", **f32}, **small,
        ),
        "wide_cg": lambda: Problem(
            "wide_cg", "wide sinc, CG, tiny", "regression", _sinc_data(120), None,
            _mlp([1, 32, 1]), None, None, 1e-6,
            lm_fast={"solver": "cg", "cg_max_iter": 20}, **small,
        ),
    }  # fmt: skip


def _problems(quick: bool) -> dict[str, Callable[[], Problem]]:
    f32 = _F32
    q = quick
    return {
        "sinc": lambda: Problem(
            key="sinc",
            title="sinc(10x), 20,000 points, Linear(1,64)-Tanh-Linear(64,1), float32, full batch",
            kind="regression",
            train=_sinc_data(20_000),
            test=None,
            make_model=_mlp([1, 64, 1]),
            batch_size=None,
            slice_size=None,
            target=1e-6,
            max_steps=300 if q else 800,
            adam_steps=1_000 if q else 4_000,
            budget_s=40.0 if q else 120.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            scipy=True,
            eval_every=1,
        ),
        "sinc_large": lambda: Problem(
            key="sinc_large",
            title="cuPyLMA's example: sinc(10x), 100,000 points, Linear(1,256)-Tanh-"
            "Linear(256,1), Jacobian slices of 25,000",
            kind="regression",
            train=_sinc_data(100_000),
            test=None,
            make_model=_mlp([1, 256, 1]),
            batch_size=None,
            slice_size=25_000,
            target=1e-6,
            max_steps=15 if q else 100,
            adam_steps=150 if q else 1_000,
            budget_s=25.0 if q else 180.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            scipy=not q,
            eval_every=1,
        ),
        "digits_mlp": lambda: Problem(
            key="digits_mlp",
            title="digits (sklearn), MLP 64-32-10, cross-entropy (square-root residuals), "
            "batches of 256",
            kind="classification",
            train=_digits()[0],
            test=_digits()[1],
            make_model=_mlp([64, 32, 10]),
            batch_size=256,
            slice_size=None,
            target=0.95,
            max_steps=60 if q else 300,
            adam_steps=300 if q else 1_500,
            budget_s=15.0 if q else 60.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            eval_every=6,
        ),
        "digits_cnn": lambda: Problem(
            key="digits_cnn",
            title="digits (sklearn), CNN conv3x3(8)-Tanh-MaxPool-Linear(128,10), "
            "cross-entropy (square-root residuals), batches of 256",
            kind="classification",
            train=_digits()[0],
            test=_digits()[1],
            make_model=_cnn(8),
            batch_size=256,
            slice_size=None,
            target=0.95,
            max_steps=60 if q else 300,
            adam_steps=300 if q else 1_500,
            budget_s=15.0 if q else 60.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            eval_every=6,
        ),
        "wide_dual": lambda: Problem(
            key="wide_dual",
            title="digits, wide MLP 64-256-10 (19,210 parameters), batches of 128 residuals: "
            "dual form",
            kind="classification",
            train=_digits()[0],
            test=_digits()[1],
            make_model=_mlp([64, 256, 10]),
            batch_size=128,
            slice_size=None,
            target=0.95,
            max_steps=40 if q else 200,
            adam_steps=200 if q else 1_000,
            budget_s=15.0 if q else 60.0,
            adam_lr=3e-3,
            adam_note=_ADAM_SWEEP,
            lm_fast={"form": "dual", **f32},
            eval_every=4,
        ),
        "wide_cg": lambda: Problem(
            key="wide_cg",
            title=(
                "sinc(10x), 4,000 points, Linear(1,1024)-Tanh-Linear(1024,1) (3,073 parameters)"
                if q
                else "sinc(10x), 12,000 points, Linear(1,3072)-Tanh-Linear(3072,1) "
                "(9,217 parameters)"
            )
            + ", full batch: Gram against CG",
            kind="regression",
            train=_sinc_data(4_000 if q else 12_000),
            test=None,
            make_model=_mlp([1, 1024 if q else 3072, 1]),
            batch_size=None,
            slice_size=None,
            target=1e-5,
            max_steps=6 if q else 30,
            adam_steps=200 if q else 1_000,
            budget_s=25.0 if q else 120.0,
            adam_lr=1e-3,
            adam_note=_ADAM_SWEEP,
            lm_fast={"solver": "cg", "cg_max_iter": 100},
            lm_extra={} if q else {"secondorder LM (cholesky, float32 Gram)": f32},
            eval_every=1,
        ),
    }


# ---------------------------------------------------------------------------------------
# Results


@dataclass
class MethodResult:
    """One method on one problem: its curve and summary figures.

    ``seconds`` is the optimizer's own cumulative time at each point of the curve;
    ``losses`` (and ``accuracies`` for classification) are evaluated directly on the
    whole training (test) set outside the clock.
    """

    name: str
    settings: str
    status: str = "ok"
    note: str = ""
    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)
    reported_loss: float = math.nan
    final_state: dict[str, Tensor] | None = field(default=None, repr=False)

    def add(self, step: int, seconds: float, loss: float, accuracy: float | None) -> None:
        """Append one point of the curve."""
        self.steps.append(step)
        self.seconds.append(seconds)
        self.losses.append(loss)
        if accuracy is not None:
            self.accuracies.append(accuracy)

    @property
    def median_step(self) -> float:
        """Median seconds per step (NaN when nothing ran)."""
        return statistics.median(self.step_seconds) if self.step_seconds else math.nan

    def time_to(self, target: float, kind: str) -> float:
        """Optimizer seconds until the curve first meets ``target`` (NaN: never)."""
        curve = self.accuracies if kind == "classification" else self.losses
        for t, v in zip(self.seconds, curve, strict=False):
            if (v >= target) if kind == "classification" else (v <= target):
                return t
        return math.nan

    def summary(self, target: float, kind: str) -> dict[str, Any]:
        """The JSON record (the curve included, the final weights not)."""
        out = {k: v for k, v in asdict(self).items() if k != "final_state"}
        out["median_step_s"] = self.median_step
        out["stage_medians_s"] = {k: statistics.median(v) for k, v in self.stages.items() if v}
        tt = self.time_to(target, kind)
        out["time_to_target_s"] = tt if math.isfinite(tt) else None
        out["reached_target"] = math.isfinite(tt)
        out["final_loss"] = self.losses[-1] if self.losses else None
        out["final_accuracy"] = self.accuracies[-1] if self.accuracies else None
        return out


@dataclass
class ProblemResult:
    """Every method's result on one problem, and the floor measured on it."""

    problem: Problem
    methods: list[MethodResult]
    floor: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        """The JSON record of the problem."""
        p = self.problem
        return {
            "title": p.title,
            "kind": p.kind,
            "train_size": int(p.train[0].shape[0]),
            "parameters": p.num_parameters,
            "batch_size": p.batch_size,
            "slice_size": p.slice_size,
            "target": p.target,
            "target_metric": "test accuracy" if p.kind == "classification" else "MSE",
            "adam_lr": p.adam_lr,
            "adam_lr_choice": p.adam_note,
            "methods": [m.summary(p.target, p.kind) for m in self.methods],
            "floor": self.floor,
            "comparisons": self.comparisons(),
        }

    def comparisons(self) -> list[dict[str, Any]]:
        """Each secondorder LM config against the peers, measured in this run.

        ``step_speedup_vs_tlm``: torch-levenberg-marquardt's median seconds per step
        over this config's.  ``time_to_target_speedup``: the fastest peer's time to
        the target over this config's, among the peers that reached it (``None`` if
        this config or no peer reached it; ``peers_reaching_target`` says which did).
        """
        p = self.problem
        ran = [m for m in self.methods if m.status != "skipped" and m.step_seconds]
        ours = [m for m in ran if m.name.startswith("secondorder")]
        peers = [m for m in ran if not m.name.startswith("secondorder")]
        tlm = next((m for m in peers if m.name.startswith("torch-levenberg")), None)
        reached = {m.name: m.time_to(p.target, p.kind) for m in peers}
        reached = {k: v for k, v in reached.items() if math.isfinite(v)}
        best_peer = min(reached.values()) if reached else math.nan
        out = []
        for m in ours:
            mine = m.time_to(p.target, p.kind)
            out.append(
                {
                    "config": m.name,
                    "step_speedup_vs_tlm": (tlm.median_step / m.median_step) if tlm else None,
                    "time_to_target_s": mine if math.isfinite(mine) else None,
                    "peers_reaching_target": sorted(reached),
                    "time_to_target_speedup": (
                        best_peer / mine
                        if math.isfinite(mine) and math.isfinite(best_peer)
                        else None
                    ),
                }
            )
        return out


# ---------------------------------------------------------------------------------------
# Evaluation (outside the clock)


def _residual_fn(problem: Problem) -> Callable[[Tensor, Tensor], Tensor]:
    return cross_entropy if problem.kind == "classification" else mse


@torch.no_grad()
def evaluate(problem: Problem, model: nn.Module) -> tuple[float, float | None]:
    """Training loss (mean squared residual, in float64) and test accuracy of ``model``."""
    x, y = problem.train
    r = _residual_fn(problem)(model(x), y).double()
    loss = float((r * r).mean())
    if problem.test is None:
        return loss, None
    xt, yt = problem.test
    acc = float((model(xt).argmax(1) == yt).double().mean())
    return loss, acc


def _batches(problem: Problem, epoch: int) -> list[tuple[Tensor, Tensor]]:
    x, y = problem.train
    if problem.batch_size is None:
        return [(x, y)]
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1000 + epoch))
    bs = problem.batch_size
    return [
        (x[perm[i : i + bs]], y[perm[i : i + bs]])
        for i in range(0, x.shape[0] - bs + 1, bs)  # whole batches only
    ]


Stepper = Callable[[Tensor, Tensor], tuple[float, bool, dict[str, float]]]


def _train(
    problem: Problem,
    model: nn.Module,
    result: MethodResult,
    step: Stepper,
    max_steps: int,
    eval_every: int,
) -> MethodResult:
    """Drive ``step`` over the problem's batches; time only ``step``.

    ``step(x, y)`` returns ``(reported loss, stop, stage seconds)``.  A full-batch
    run stops when the method says so; a mini-batch run ignores that (one batch
    converged says little about the next).
    """
    loss, acc = evaluate(problem, model)
    result.add(0, 0.0, loss, acc)
    elapsed, k, epoch, stop = 0.0, 0, 0, False
    while k < max_steps and not stop and elapsed < problem.budget_s:
        for xb, yb in _batches(problem, epoch):
            t0 = time.perf_counter()
            reported, says_stop, stages = step(xb, yb)
            dt = time.perf_counter() - t0
            elapsed += dt
            k += 1
            result.step_seconds.append(dt)
            result.reported_loss = reported
            for name, secs in stages.items():
                result.stages.setdefault(name, []).append(secs)
            stop = says_stop and problem.batch_size is None
            last = k >= max_steps or stop or elapsed >= problem.budget_s
            if k % eval_every == 0 or last:
                loss, acc = evaluate(problem, model)
                result.add(k, elapsed, loss, acc)
            if last:
                break
        epoch += 1
    if elapsed >= problem.budget_s:
        result.status = "time cap"
    result.final_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


# ---------------------------------------------------------------------------------------
# Methods


def _describe(options: dict[str, Any]) -> str:
    if not options:
        return "defaults"
    return ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in options.items())


def run_lm(problem: Problem, label: str, options: dict[str, Any]) -> MethodResult:
    """Run secondorder's LevenbergMarquardt with ``options``."""
    model = problem.make_model()
    opt = LevenbergMarquardt(model, _residual_fn(problem), **options)
    first: dict[str, str] = {}

    def step(x: Tensor, y: Tensor) -> tuple[float, bool, dict[str, float]]:
        info = opt.step(x, y, slice_size=problem.slice_size)
        if not first:
            first.update(jacobian=info.jacobian, solver=info.solver, form=info.form)
        stages = {k: v for k, v in info.timings.items() if k != "total"}
        stages["attempts"] = float(info.attempts)
        return info.loss, info.terminated, stages

    result = MethodResult(label, _describe(options))
    _train(problem, model, result, step, problem.max_steps, problem.eval_every)
    result.settings += f" (resolved: jacobian={first.get('jacobian')}, solver="
    result.settings += f"{first.get('solver')}, form={first.get('form')})"
    return result


def run_tlm(problem: Problem) -> MethodResult:
    """torch-levenberg-marquardt 1.2.3 through its own training step, its defaults."""
    try:
        from torch_levenberg_marquardt import loss as tlm_loss
        from torch_levenberg_marquardt.training import LevenbergMarquardtModule
    except ImportError:
        return MethodResult(
            "torch-levenberg-marquardt",
            "defaults",
            status="skipped",
            note="not installed: pip install 'secondorder[bench]'",
        )
    model = problem.make_model()
    loss_fn = (
        tlm_loss.CrossEntropyLoss() if problem.kind == "classification" else tlm_loss.MSELoss()
    )
    module = LevenbergMarquardtModule(model, loss_fn=loss_fn, max_batch_size=problem.slice_size)

    def step(x: Tensor, y: Tensor) -> tuple[float, bool, dict[str, float]]:
        _, loss, stop, _ = module.training_step(x, y)
        return float(loss), bool(stop), {}

    settings = "defaults (solve_method='qr', StandardDampingStrategy)"
    if problem.slice_size is not None:
        settings += f", max_batch_size={problem.slice_size}"
    result = MethodResult("torch-levenberg-marquardt 1.2.3", settings)
    return _train(problem, model, result, step, problem.max_steps, problem.eval_every)


def run_adam(problem: Problem) -> MethodResult:
    """torch.optim.Adam on the same batches with the problem's tuned learning rate."""
    model = problem.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=problem.adam_lr)
    lossf: Callable[[Tensor, Tensor], Tensor] = (
        nn.functional.cross_entropy if problem.kind == "classification" else nn.functional.mse_loss
    )

    def step(x: Tensor, y: Tensor) -> tuple[float, bool, dict[str, float]]:
        opt.zero_grad(set_to_none=True)
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach()), False, {}

    result = MethodResult(f"torch.optim.Adam (lr {problem.adam_lr:g})", problem.adam_note)
    every = max(problem.eval_every, problem.adam_steps // 200)
    return _train(problem, model, result, step, problem.adam_steps, every)


class _TimeCapError(Exception):
    pass


def run_scipy(problem: Problem, method: str) -> MethodResult:
    """scipy.optimize.least_squares on the flat float64 parameter vector.

    Residuals and the Jacobian come from torch (``vmap`` of ``jacrev`` per sample) on
    a float64 copy of the model.  The clock covers scipy and every callback; a
    callback past the time cap raises, and the best point evaluated so far is kept.
    Steps are Jacobian evaluations; the curve is the best loss evaluated so far.
    """
    from scipy.optimize import least_squares as sp_least_squares

    model = problem.make_model().double()
    names = [k for k, p in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    numels = [p.numel() for p in model.parameters()]
    x_all = problem.train[0].double()
    y_all = problem.train[1].double()
    m = x_all.shape[0]

    def unflatten(p: Tensor) -> dict[str, Tensor]:
        return {k: c.view(s) for k, c, s in zip(names, torch.split(p, numels), shapes, strict=True)}

    def per_sample(p: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
        out: Tensor = functional_call(model, unflatten(p), (xi.unsqueeze(0),))
        return (out - yi.unsqueeze(0)).reshape(-1)

    jac_fn = vmap(jacrev(per_sample), in_dims=(None, 0, 0))
    result = MethodResult(
        f"scipy least_squares ({method})",
        "float64, torch autograd Jacobian, x_scale=1, default tolerances",
    )
    t_start = time.perf_counter()
    best: dict[str, Any] = {"loss": math.inf, "x": None}
    njev = [0]
    last_jac = [t_start]

    def check() -> None:
        if time.perf_counter() - t_start > problem.budget_s:
            raise _TimeCapError

    def fun(p: Any) -> Any:
        check()
        pt = torch.from_numpy(p)
        with torch.no_grad():
            r = (functional_call(model, unflatten(pt), (x_all,)) - y_all).reshape(-1)
        loss = float((r * r).mean())
        now = time.perf_counter() - t_start
        if loss < best["loss"]:
            best.update(loss=loss, x=p.copy())
        result.add(njev[0], now, best["loss"], None)
        return r.numpy()

    def jac(p: Any) -> Any:
        check()
        now = time.perf_counter()
        if njev[0] > 0:
            result.step_seconds.append(now - last_jac[0])
        last_jac[0] = now
        njev[0] += 1
        with torch.no_grad():
            jm = jac_fn(torch.from_numpy(p), x_all, y_all).reshape(m, -1)
        return jm.numpy()

    x0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    try:
        res = sp_least_squares(fun, x0, jac=jac, method=method, max_nfev=problem.max_steps * 5)
        result.note = f"{res.message} nfev={res.nfev} njev={res.njev}"
    except _TimeCapError:
        result.status = "time cap"
        result.note = f"stopped at the {problem.budget_s:g} s cap after {njev[0]} Jacobians"
    if best["x"] is not None:
        p = torch.from_numpy(best["x"])
        final = problem.make_model()
        with torch.no_grad():
            for q, c in zip(final.parameters(), torch.split(p, numels), strict=True):
                q.copy_(c.view_as(q).float())
        result.final_state = {k: v.clone() for k, v in final.state_dict().items()}
        result.reported_loss = best["loss"]
    if not result.step_seconds and njev[0]:
        result.step_seconds.append(time.perf_counter() - t_start)
    return result


# ---------------------------------------------------------------------------------------
# The floor


def _median_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _syrk_time(shape: tuple[int, int], reps: int) -> float | None:
    """``JᵀJ`` by BLAS ``ssyrk`` (half the flops of a general product), or None."""
    try:
        from scipy.linalg.blas import ssyrk
    except ImportError:  # pragma: no cover - scipy is a test dependency
        return None
    a = torch.randn(shape).numpy()  # C order (m, n) is Fortran order (n, m): no copy.
    return _median_time(lambda: ssyrk(1.0, a.T, trans=0), reps)


def measure_floor(
    problem: Problem, label: str, options: dict[str, Any], reps: int
) -> dict[str, Any]:
    """Time each stage of one LM step, and the hardware floor, on the first batch.

    Stages are measured by calling the optimizer's internals on the same point:
    the Jacobian strategy per slice, the Gram (with its dtype conversion), the whole
    ``linearize``, ``factor`` + one ``solve``, and one trial evaluation ``loss_sum``.
    """
    model = problem.make_model()
    x, y = _batches(problem, 0)[0]
    opt = LevenbergMarquardt(model, _residual_fn(problem), **options)
    info = opt.step(x, y, slice_size=problem.slice_size)  # configures strategy and solver
    prob = opt._problem
    with torch.no_grad():
        xv = torch.cat([p.detach().reshape(-1) for p in prob.params])
    params = prob.unflatten(xv)
    slices = list(prob.slices())
    # The dtype the step just taken formed its normal matrix in (under "auto" it
    # follows λ; CG forms none and reports "").
    gdt = getattr(torch, info.gram_dtype) if info.gram_dtype else (prob.gram_dtype or xv.dtype)

    def jac_all() -> list[Tensor]:
        return [prob.strategy(prob.program, params, a, b)[0].detach() for a, b in slices]

    jacs = jac_all()
    m, n = sum(j.shape[0] for j in jacs), jacs[0].shape[1]
    t_jac = _median_time(jac_all, reps)

    def gram() -> Tensor:
        if prob.form == "dual":
            j = torch.cat(jacs).to(gdt)
            return j @ j.T
        g: Tensor | None = None
        for j in jacs:
            g = gram_update(g, j, gdt)  # what linearize does, conversion included
        assert g is not None
        return g

    t_gram = _median_time(gram, reps)
    t_lin = _median_time(lambda: prob.linearize(xv), reps)
    system = prob.linearize(xv)
    d = opt._matrix.diagonal(
        system.col_sq if system.scale_sq is None else system.scale_sq, opt._damping
    )
    w = None if system.residuals is None else -system.residuals
    lam = opt.damping

    def factor_solve() -> None:
        prob.solver.factor(system, d).solve(lam, -system.grad, w)

    t_solve = _median_time(factor_solve, reps)
    t_trial = _median_time(lambda: prob.loss_sum(xv), reps)
    shape = (m, n) if prob.form != "dual" else (n, m)
    j32 = torch.randn(shape)
    t_gemm32 = _median_time(lambda: j32.T @ j32, reps)
    j64 = j32.double()
    t_gemm64 = _median_time(lambda: j64.T @ j64, reps)
    t_syrk = _syrk_time(shape, reps)
    lossf: Callable[[Tensor, Tensor], Tensor] = (
        nn.functional.cross_entropy if problem.kind == "classification" else nn.functional.mse_loss
    )
    fb_model = problem.make_model()

    def fwd_bwd() -> None:
        fb_model.zero_grad(set_to_none=True)
        lossf(fb_model(x), y).backward()

    t_fb = _median_time(fwd_bwd, reps)
    gemm_same = t_gemm64 if gdt == torch.float64 else t_gemm32
    # What the step itself spends on the normal matrix and its solution: the dual
    # Cholesky/eigh forms J D⁻¹Jᵀ inside ``factor``, and CG never forms a Gram.
    gram_in_step = prob.form == "primal" and not prob.solver.needs_jacobian
    numerator = t_solve + (t_gram if gram_in_step else 0.0)
    if prob.form == "dual":
        note = "dual form: J D⁻¹Jᵀ (m×m) is formed inside factor+solve; GEMM of shape (n, m)"
    elif not gram_in_step:
        note = f"{prob.solver.name}: no Gram is formed; the ratio is factor+solve over GEMM"
    else:
        note = ""
    return {
        "config": label,
        "settings": _describe(options),
        "jacobian": info.jacobian,
        "solver": info.solver,
        "form": info.form,
        "gram_dtype": str(gdt).replace("torch.", ""),
        "jacobian_shape": [m, n],
        "slices": len(slices),
        "jacobian_s": t_jac,
        "gram_s": t_gram,
        "linearize_s": t_lin,
        "linearize_other_s": t_lin - t_jac - t_gram,
        "factor_solve_s": t_solve,
        "trial_s": t_trial,
        "gemm_f32_s": t_gemm32,
        "gemm_f64_s": t_gemm64,
        "syrk_f32_s": t_syrk,
        "forward_backward_s": t_fb,
        "gram_in_step": gram_in_step,
        "gram_solve_over_gemm_f32": numerator / t_gemm32,
        "gram_solve_over_gemm_same_dtype": numerator / gemm_same,
        "jacobian_over_forward_backward": t_jac / t_fb,
        "notes": note,
    }


# ---------------------------------------------------------------------------------------
# The suite


def run_problem(
    problem: Problem,
    *,
    methods: Sequence[str] = METHODS,
    floor_reps: int = 5,
    log: Callable[[str], None] = print,
) -> ProblemResult:
    """Run every method on ``problem`` from the same initial weights, then its floor."""
    results: list[MethodResult] = []
    lm_configs: dict[str, dict[str, Any]] = {}
    if "lm" in methods:
        lm_configs["secondorder LM (defaults)"] = {}
    if "lm_fast" in methods:
        lm_configs["secondorder LM (fastest)"] = problem.lm_fast
        lm_configs.update(problem.lm_extra)
    for label, options in lm_configs.items():
        results.append(run_lm(problem, label, options))
        log(_line(problem, results[-1]))
    if "tlm" in methods:
        results.append(run_tlm(problem))
        log(_line(problem, results[-1]))
    if "adam" in methods:
        results.append(run_adam(problem))
        log(_line(problem, results[-1]))
    if "scipy" in methods and problem.scipy:
        for method in ("lm", "trf"):
            results.append(run_scipy(problem, method))
            log(_line(problem, results[-1]))
    floor = [measure_floor(problem, label, opts, floor_reps) for label, opts in lm_configs.items()]
    return ProblemResult(problem, results, floor)


def _fmt_s(t: float | None) -> str:
    if t is None or not math.isfinite(t):
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1.0 else f"{t:.2f} s"


def _line(problem: Problem, r: MethodResult) -> str:
    if r.status == "skipped":
        return f"  {r.name}: skipped ({r.note})"
    metric = f"test acc {r.accuracies[-1]:.3f}" if r.accuracies else f"loss {r.losses[-1]:.3e}"
    return (
        f"  {r.name}: {r.steps[-1]} steps, {r.seconds[-1]:.2f} s, "
        f"{_fmt_s(r.median_step)}/step, {metric} [{r.status}]"
    )


def markdown(results: Sequence[ProblemResult], header: str) -> str:
    """The report: one table of methods and one of the floor per problem."""
    lines = [header, ""]
    for pr in results:
        p = pr.problem
        cls = p.kind == "classification"
        lines += [f"## {p.key}: {p.title}", ""]
        lines.append(
            f"{p.num_parameters} parameters, {p.train[0].shape[0]} training samples, "
            f"target: {'test accuracy' if cls else 'MSE'} "
            f"{'≥' if cls else '≤'} {p.target:g}. Adam's lr {p.adam_lr:g} ({p.adam_note})."
        )
        lines.append("")
        lines.append(
            "| method | settings | steps | s/step (median) | time to target | final loss "
            + ("| final test acc " if cls else "")
            + "| LM linearize / solve+trials (median) | status |"
        )
        lines.append("|---|---|---:|---:|---:|---:|" + ("---:|" if cls else "") + "---|---|")
        for r in pr.methods:
            if r.status == "skipped":
                lines.append(
                    f"| {r.name} | {r.settings} | - | - | - | - |"
                    + (" - |" if cls else "")
                    + f" - | skipped: {r.note} |"
                )
                continue
            tt = r.time_to(p.target, p.kind)
            reached = f"{tt:.2f} s" if math.isfinite(tt) else "not reached"
            st = {k: statistics.median(v) for k, v in r.stages.items() if v}
            stage = (
                f"{_fmt_s(st.get('linearize'))} / {_fmt_s(st.get('solve_and_trials'))}"
                f" ({st.get('attempts', 0):.0f} attempts)"
                if "linearize" in st
                else "-"
            )
            acc = f" {r.accuracies[-1]:.3f} |" if cls and r.accuracies else (" - |" if cls else "")
            status = r.status + (f": {r.note}" if r.note else "")
            lines.append(
                f"| {r.name} | {r.settings} | {r.steps[-1]} | {_fmt_s(r.median_step)} | "
                f"{reached} | {r.losses[-1]:.3e} |{acc} {stage} | {status} |"
            )
        lines.append("")
        for c in pr.comparisons():
            speed, tt = c["step_speedup_vs_tlm"], c["time_to_target_speedup"]
            if speed is None:
                per_step = "torch-levenberg-marquardt did not run"
            else:
                per_step = f"torch-levenberg-marquardt's s/step over this config's: {speed:.2f}"
            if c["time_to_target_s"] is None:
                target = "target not reached by this config"
            elif tt is None:
                target = "reaches the target; no peer does"
            else:
                target = f"fastest peer's time to target over this config's: {tt:.2f}"
            lines.append(f"- {c['config']}: {per_step}; {target}.")
        lines.append("")
        if pr.floor:
            lines.append(
                "| LM config | J shape | Jacobian | Gram (dtype) | factor+solve | trial | "
                "GEMM f32 | GEMM f64 | ssyrk f32 | fwd+bwd | (Gram+solve)/GEMM f32 | "
                "(Gram+solve)/GEMM same dtype | Jacobian/(fwd+bwd) |"
            )
            lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for f in pr.floor:
                lines.append(
                    f"| {f['config']} ({f['jacobian']}, {f['solver']}, {f['form']}) | "
                    f"{f['jacobian_shape'][0]}×{f['jacobian_shape'][1]} | "
                    f"{_fmt_s(f['jacobian_s'])} | {_fmt_s(f['gram_s'])} ({f['gram_dtype']}) | "
                    f"{_fmt_s(f['factor_solve_s'])} | {_fmt_s(f['trial_s'])} | "
                    f"{_fmt_s(f['gemm_f32_s'])} | {_fmt_s(f['gemm_f64_s'])} | "
                    f"{_fmt_s(f['syrk_f32_s'])} | {_fmt_s(f['forward_backward_s'])} | "
                    f"{f['gram_solve_over_gemm_f32']:.2f} | "
                    f"{f['gram_solve_over_gemm_same_dtype']:.2f} | "
                    f"{f['jacobian_over_forward_backward']:.1f} |"
                )
            lines.append("")
    lines += scaling_lines(results)
    return "\n".join(lines)


def flop_scaling(results: Sequence[ProblemResult]) -> list[dict[str, Any]]:
    """Problem 2's seconds per step against problem 1's scaled by the Gram's flops.

    An LM step on a tall J (m x n) is dominated by ``JᵀJ``, ``m·n²`` multiply-adds, so
    problem 1's median step times ``(m₂n₂²)/(m₁n₁²)`` is what problem 2 should take;
    ``ratio`` above 1 means problem 2 is slower than that scaling predicts.
    """
    by_key = {pr.problem.key: pr for pr in results}
    small, large = by_key.get("sinc"), by_key.get("sinc_large")
    if small is None or large is None:
        return []

    def size(pr: ProblemResult) -> float:
        return float(pr.problem.train[0].shape[0]) * pr.problem.num_parameters**2

    factor = size(large) / size(small)
    steps = {m.name: m.median_step for m in small.methods if m.step_seconds}
    out = []
    for m in large.methods:
        if m.name in steps and m.step_seconds and m.name.startswith(("secondorder", "torch-lev")):
            expected = steps[m.name] * factor
            out.append(
                {
                    "method": m.name,
                    "flops_factor": factor,
                    "expected_s": expected,
                    "measured_s": m.median_step,
                    "ratio": m.median_step / expected,
                }
            )
    return out


def scaling_lines(results: Sequence[ProblemResult]) -> list[str]:
    """The markdown of :func:`flop_scaling` (nothing unless both sinc problems ran)."""
    rows = flop_scaling(results)
    if not rows:
        return []
    lines = [
        "## sinc_large against sinc, scaled by the Gram's flops",
        "",
        f"m·n² grows {rows[0]['flops_factor']:.1f}x from sinc to sinc_large.",
        "",
        "| method | sinc s/step x flops | sinc_large s/step | ratio |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {_fmt_s(r['expected_s'])} | {_fmt_s(r['measured_s'])} | "
            f"{r['ratio']:.2f} |"
        )
    return [*lines, ""]


def plot(pr: ProblemResult, path: Path) -> bool:
    """Loss (and test accuracy) against optimizer wall time; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the dev extra
        return False
    cls = pr.problem.kind == "classification"
    fig, axes = plt.subplots(1, 2 if cls else 1, figsize=(12 if cls else 7, 4.5), squeeze=False)
    for r in pr.methods:
        if r.status == "skipped" or not r.seconds:
            continue
        axes[0][0].semilogy(r.seconds, r.losses, label=r.name)
        if cls and r.accuracies:
            axes[0][1].plot(r.seconds, r.accuracies, label=r.name)
    axes[0][0].set_ylabel("training loss" + (" (cross-entropy)" if cls else " (MSE)"))
    if not cls:
        axes[0][0].axhline(pr.problem.target, color="grey", ls=":", lw=1)
    if cls:
        axes[0][1].set_ylabel("test accuracy")
        axes[0][1].axhline(pr.problem.target, color="grey", ls=":", lw=1)
    for ax in axes[0]:
        ax.set_xlabel("optimizer wall time (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(pr.problem.title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    try:
        import torch_levenberg_marquardt as tlm

        tlm_version = getattr(tlm, "__version__", "installed")
    except ImportError:
        tlm_version = None
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores_visible": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "torch_levenberg_marquardt": tlm_version,
    }


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on a ``parser.add_subparsers()`` object; return its parser."""
    b: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="LM against torch-levenberg-marquardt, Adam and scipy, with the floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--quick", action="store_true", help="small budgets: a few minutes on 2 cores")
    b.add_argument("--tiny", action="store_true", help="tiny sizes, seconds (for tests)")
    b.add_argument(
        "--problems",
        nargs="+",
        choices=PROBLEMS,
        default=list(PROBLEMS),
        metavar="NAME",
        help=f"problems to run (default all): {', '.join(PROBLEMS)}",
    )
    b.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        metavar="NAME",
        help="methods to run (default all): lm, lm_fast, tlm, adam, scipy",
    )
    b.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    b.add_argument("--out", default="out/bench", help="folder for bench.md and the plots")
    b.add_argument("--json", default=None, help="write the results as JSON to this file")
    b.add_argument("--floor-reps", type=int, default=5, help="repetitions per floor timing")
    b.add_argument(
        "--no-scaling",
        action="store_true",
        help="skip the scaling table (1, 2, 4 gloo processes) and the communication model",
    )
    return b


def run_bench(args: argparse.Namespace) -> int:
    """Run the suite as ``args`` says; print and write the report."""
    if args.threads < 1:
        print(f"--threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    if args.floor_reps < 1:
        print(f"--floor-reps must be >= 1, got {args.floor_reps}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    problems = build_problems(quick=args.quick, tiny=args.tiny, keys=args.problems)
    info = machine()
    started = datetime.datetime.now(datetime.timezone.utc)
    command = _command(args)
    print(f"bench on {info['cpu']}, {info['threads']} threads, torch {info['torch']}")
    results: list[ProblemResult] = []
    for key in args.problems:
        problem = problems[key]
        print(f"{key}: {problem.title} ({problem.num_parameters} parameters)")
        results.append(
            run_problem(problem, methods=args.methods, floor_reps=args.floor_reps, log=print)
        )
    header = (
        f"# secondorder bench ({'tiny' if args.tiny else 'quick' if args.quick else 'full'})\n\n"
        f"{started:%Y-%m-%d %H:%M} UTC; {info['cpu']}, {info['cores_visible']} cores visible, "
        f"{info['threads']} torch threads; torch {info['torch']}, Python {info['python']}; "
        f"torch-levenberg-marquardt {info['torch_levenberg_marquardt'] or 'not installed'}.\n"
        f"Command: `{command}`. Times are the optimizer's own (curve evaluations excluded)."
    )
    report = markdown(results, header)
    scaling: dict[str, Any] | None = None
    if not (args.tiny or args.no_scaling):
        scaling_problem = scaling_module.QUICK if args.quick else scaling_module.FULL
        text, scaling = scaling_module.report(
            scaling_problem, (1, 2, 4), scaling_module.ModelAssumptions()
        )
        report += "\n\n## Scaling: processes, forms and communication\n\n" + text
    print()
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(report + "\n")
    for pr in results:
        plot(pr, out / f"bench_{pr.problem.key}.png")
    print(f"wrote {out / 'bench.md'} and {len(results)} plots in {out}")
    if args.json:
        payload = {
            "date": started.isoformat(timespec="seconds"),
            "command": command,
            "mode": "tiny" if args.tiny else "quick" if args.quick else "full",
            "machine": info,
            "problems": {pr.problem.key: pr.summary() for pr in results},
            "flop_scaling": flop_scaling(results),
            "scaling": scaling,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_finite_or_none(payload), indent=1, allow_nan=False)
        Path(args.json).write_text(text)
        print(f"wrote {args.json}")
    return 0


def _finite_or_none(obj: Any) -> Any:
    """NaN and infinities become ``null``: JSON has no spelling for them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run."""
    parts = ["python -m benchmarks.bench"]
    if args.quick:
        parts.append("--quick")
    if args.tiny:
        parts.append("--tiny")
    if list(args.problems) != list(PROBLEMS):
        parts.append("--problems " + " ".join(args.problems))
    if list(args.methods) != list(METHODS):
        parts.append("--methods " + " ".join(args.methods))
    if args.threads != 2:
        parts.append(f"--threads {args.threads}")
    parts.append(f"--out {args.out}")
    if args.json:
        parts.append(f"--json {args.json}")
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.bench`` (from the repository's root)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run_bench(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
