"""The family-agnostic benchmark: problems, methods, a timed runner, a report and plots.

A :class:`Problem` is data, a model factory (same weights every call), a loss and a
target; a :class:`Method` builds a stepper for a fresh model of a problem, and
:func:`run_problem` runs each method from the same weights on the same batches, timing
only the steps (the curve is evaluated outside the clock), then lets each
:class:`Section` measure what its family wants to add.  :func:`markdown` and
:func:`plot` report time per step, time to the target and the curves.  Nothing here
knows any optimizer family.

How a family plugs in (see ``benchmarks/lm_methods.py`` for the LM suite):

1. Write ``benchmarks/<family>_methods.py`` with its problems (``Problem(key=..., ...)``,
   per-method knobs such as a learning rate in ``settings``) and its methods: for each
   CLI key a function ``Problem -> list[Method]`` (empty when the key does not apply).
2. A ``Method`` has a ``name`` (row label), a ``family`` and a ``make(problem, model)``
   returning a stepper ``step(x, y) -> StepReport(loss, stop, stages)``; a
   ``torch.optim`` optimizer needs only :func:`torch_optimizer`.  A method that drives
   its own loop (scipy) gives ``run(problem, result)`` instead.
3. Optional: ``Column`` (one cell per method row), ``Section`` (a measurement per
   problem, its JSON keys and markdown, e.g. LM's floor), ``Closing`` (a table across
   problems).  Bundle all in a ``Family`` and add it to ``FAMILIES`` in ``bench.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = [
    "KINDS",
    "Closing",
    "Column",
    "Family",
    "Method",
    "MethodResult",
    "Problem",
    "ProblemResult",
    "StepReport",
    "Stepper",
    "batches",
    "evaluate",
    "finite_or_none",
    "fmt_s",
    "machine",
    "markdown",
    "only_on",
    "plot",
    "resolve_device",
    "run_method",
    "run_problem",
    "sync",
    "torch_optimizer",
    "train",
    "where",
]

#: ``"regression"``: the target is a training loss to go below; ``"classification"``:
#: a test accuracy to reach.
KINDS = ("regression", "classification")


# ---------------------------------------------------------------------------------------
# Problems and methods


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One benchmark problem: data, a model factory, a loss, a target and the budgets.

    Attributes:
        key: short name used by ``--problems`` and in the JSON.
        title: one line for tables and plots.
        kind: one of :data:`KINDS`.
        train, test: ``(inputs, targets)``; ``test`` is needed for classification.
        make_model: builds the model from a fixed seed (same weights every call).
        loss: the differentiable mean loss ``loss(outputs, targets)`` that first-order
            methods minimise (e.g. ``nn.functional.mse_loss``).
        curve_loss: the loss drawn on the curve, evaluated on the whole training set
            outside the clock; ``None`` means ``loss``.
        batch_size: samples per step; ``None`` is full batch.
        target: training loss to go below (regression) or test accuracy to reach.
        max_steps: steps per method unless the method sets its own.
        budget_s: wall-clock cap per method (optimizer time only).
        eval_every: steps between two points of the curve.
        note: appended to the problem's description line in the report.
        settings: knobs of particular methods, by name (a learning rate, LM options);
            a method reads the keys it knows and falls back to its own defaults.
        device: where the data and every model of the problem live (:meth:`on`).
    """

    key: str
    title: str
    kind: str
    train: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor] | None = None
    make_model: Callable[[], nn.Module]
    loss: Callable[[Tensor, Tensor], Tensor]
    curve_loss: Callable[[Tensor, Tensor], Tensor] | None = None
    batch_size: int | None = None
    target: float
    max_steps: int
    budget_s: float
    eval_every: int = 1
    note: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"Problem {self.key!r}: kind={self.kind!r} is not one of {KINDS}; "
                "pick 'regression' for a loss target or 'classification' for an accuracy one."
            )
        if self.kind == "classification" and self.test is None:
            raise ValueError(
                f"Problem {self.key!r}: a classification problem needs test=(inputs, "
                "targets), the set its target accuracy is measured on."
            )

    @property
    def num_parameters(self) -> int:
        """Trainable scalars of the model."""
        return sum(p.numel() for p in self.make_model().parameters() if p.requires_grad)

    def setting(self, name: str, default: Any = None) -> Any:
        """``settings[name]``, or ``default`` when the problem does not set it."""
        return self.settings.get(name, default)

    def on(self, device: str) -> Problem:
        """The same problem with its data and models on ``device`` (``"cuda"``, ...).

        The data are generated on the CPU and moved, and each model is built on the CPU
        from the same seed and moved, so every device starts from the same weights.
        """
        if torch.device(device) == torch.device(self.device):
            return self
        make = self.make_model

        def make_on_device() -> nn.Module:
            return make().to(device)

        def move(pair: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor] | None:
            return None if pair is None else (pair[0].to(device), pair[1].to(device))

        train = move(self.train)
        assert train is not None
        return replace(
            self, train=train, test=move(self.test), make_model=make_on_device, device=device
        )


def sync(device: str | torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA GPU runs asynchronously).

    A clock read without it on a GPU times the queueing of the kernels, not their work.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class StepReport(NamedTuple):
    """What a stepper says about one step.

    ``loss`` is the loss the method reports (its own, on the batch), ``stop`` that it
    considers itself converged (honoured on full batches only), ``stages`` seconds (or
    counts) by stage for the report's columns, ``resolved`` a description of what the
    method chose on its first step, appended once to its settings.
    """

    loss: float
    stop: bool = False
    stages: Mapping[str, float] = {}
    resolved: str = ""


Stepper = Callable[[Tensor, Tensor], StepReport]


@dataclass(frozen=True, kw_only=True)
class Method:
    """One row of the report: a way of training a problem's model.

    Attributes:
        name: the row label (also the plot legend).
        family: who it belongs to (``"secondorder LM"``, ``"peer"``, ...).
        settings: one line describing its options.
        make: ``make(problem, model) -> stepper``; the runner times every call of the
            stepper and nothing else.
        run: instead of ``make``, for a method that drives its own loop:
            ``run(problem, result)`` fills ``result`` (curve, step seconds, status).
        max_steps: steps for this method (default the problem's).
        eval_every: steps between two curve points (default the problem's).
        skipped: a reason not to run (a missing package); the row says it.
        options: the raw options ``make`` used, for sections that rebuild the optimizer.
    """

    name: str
    family: str
    settings: str = "defaults"
    make: Callable[[Problem, nn.Module], Stepper] | None = None
    run: Callable[[Problem, MethodResult], None] | None = None
    max_steps: int | None = None
    eval_every: int | None = None
    skipped: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.skipped and (self.make is None) == (self.run is None):
            raise ValueError(
                f"Method {self.name!r}: give exactly one of make= (a stepper factory) and "
                "run= (a method that drives its own loop), or skipped= with the reason."
            )


def torch_optimizer(
    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> Callable[[Problem, nn.Module], Stepper]:
    """A ``Method.make`` for a ``torch.optim`` optimizer on the problem's ``loss``.

    ``factory(params)`` builds the optimizer, e.g.
    ``lambda ps: torch.optim.SGD(ps, lr=0.1)``; each step is zero_grad, forward,
    backward, ``step()``.
    """

    def make(problem: Problem, model: nn.Module) -> Stepper:
        opt = factory(list(model.parameters()))

        def step(x: Tensor, y: Tensor) -> StepReport:
            opt.zero_grad(set_to_none=True)
            loss = problem.loss(model(x), y)
            loss.backward()
            opt.step()
            return StepReport(float(loss.detach()))

        return step

    return make


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
    family: str = ""
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

    def steps_to(self, target: float, kind: str) -> int | None:
        """Steps until the curve first meets ``target`` (None: never)."""
        i = self._first_meeting(target, kind)
        return None if i is None else self.steps[i]

    def time_to(self, target: float, kind: str) -> float:
        """Optimizer seconds until the curve first meets ``target`` (NaN: never)."""
        i = self._first_meeting(target, kind)
        return math.nan if i is None else self.seconds[i]

    def _first_meeting(self, target: float, kind: str) -> int | None:
        curve = self.accuracies if kind == "classification" else self.losses
        for i, v in enumerate(curve[: len(self.seconds)]):
            if (v >= target) if kind == "classification" else (v <= target):
                return i
        return None

    def summary(self, target: float, kind: str) -> dict[str, Any]:
        """The JSON record (the curve included, the final weights not)."""
        out = {k: v for k, v in asdict(self).items() if k != "final_state"}
        out["median_step_s"] = self.median_step
        out["stage_medians_s"] = {k: statistics.median(v) for k, v in self.stages.items() if v}
        tt = self.time_to(target, kind)
        out["time_to_target_s"] = tt if math.isfinite(tt) else None
        out["steps_to_target"] = self.steps_to(target, kind)
        out["reached_target"] = math.isfinite(tt)
        out["final_loss"] = self.losses[-1] if self.losses else None
        out["final_accuracy"] = self.accuracies[-1] if self.accuracies else None
        return out


@dataclass
class ProblemResult:
    """Every method's result on one problem, and what each section measured on it."""

    problem: Problem
    methods: list[MethodResult]
    sections: dict[str, Any] = field(default_factory=dict)

    def summary(self, sections: Sequence[Section] = ()) -> dict[str, Any]:
        """The JSON record of the problem; each section adds its own keys."""
        p = self.problem
        out: dict[str, Any] = {
            "title": p.title,
            "kind": p.kind,
            "train_size": int(p.train[0].shape[0]),
            "parameters": p.num_parameters,
            "batch_size": p.batch_size,
            "target": p.target,
            "target_metric": "test accuracy" if p.kind == "classification" else "MSE",
            "methods": [m.summary(p.target, p.kind) for m in self.methods],
        }
        for s in sections:
            out.update(s.summary(self))
        return out


@dataclass(frozen=True)
class Column:
    """A column of the methods table, before ``status``: ``cell(result)`` per row."""

    header: str
    cell: Callable[[MethodResult], str]


@dataclass(frozen=True)
class Section:
    """A family's addition to each problem's report.

    ``measure(problem, methods, results)`` runs after the methods and its value is
    stored as ``ProblemResult.sections[key]``; ``summary(pr)`` returns JSON keys merged
    into the problem's record; ``markdown(pr)`` returns lines after the methods table.
    """

    key: str
    measure: Callable[[Problem, Sequence[Method], Sequence[MethodResult]], Any] | None
    summary: Callable[[ProblemResult], dict[str, Any]]
    markdown: Callable[[ProblemResult], list[str]]


@dataclass(frozen=True)
class Closing:
    """A table across problems at the end of the report, and its top-level JSON key."""

    key: str
    data: Callable[[Sequence[ProblemResult]], Any]
    markdown: Callable[[Sequence[ProblemResult]], list[str]]


@dataclass(frozen=True)
class Family:
    """Everything one family adds to the suite (see the module docstring).

    ``problems`` maps a ``--problems`` key to ``build(mode)`` (mode ``"full"``,
    ``"quick"`` or ``"tiny"``); ``methods`` maps a ``--methods`` key to the methods it
    stands for on a problem; ``versions`` names the peer packages installed.
    """

    name: str
    problems: Mapping[str, Callable[[str], Problem]]
    methods: Mapping[str, Callable[[Problem], list[Method]]]
    columns: Sequence[Column] = ()
    sections: Sequence[Section] = ()
    closings: Sequence[Closing] = ()
    versions: Callable[[], dict[str, str | None]] = dict


# ---------------------------------------------------------------------------------------
# The runner


@torch.no_grad()
def evaluate(problem: Problem, model: nn.Module) -> tuple[float, float | None]:
    """Training loss (``curve_loss`` on the whole set) and test accuracy of ``model``."""
    x, y = problem.train
    fn = problem.curve_loss or problem.loss
    loss = float(fn(model(x), y))
    if problem.kind != "classification" or problem.test is None:
        return loss, None
    xt, yt = problem.test
    acc = float((model(xt).argmax(1) == yt).double().mean())
    return loss, acc


def batches(problem: Problem, epoch: int) -> list[tuple[Tensor, Tensor]]:
    """The batches of one epoch: the same permutation for every method (seeded by epoch)."""
    x, y = problem.train
    if problem.batch_size is None:
        return [(x, y)]
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1000 + epoch))
    perm = perm.to(x.device)
    bs = problem.batch_size
    return [
        (x[perm[i : i + bs]], y[perm[i : i + bs]])
        for i in range(0, x.shape[0] - bs + 1, bs)  # whole batches only
    ]


def train(
    problem: Problem,
    model: nn.Module,
    result: MethodResult,
    step: Stepper,
    max_steps: int,
    eval_every: int,
) -> MethodResult:
    """Drive ``step`` over the problem's batches; time only ``step``.

    A full-batch run stops when the method says so; a mini-batch run ignores that (one
    batch converged says little about the next).
    """
    loss, acc = evaluate(problem, model)
    result.add(0, 0.0, loss, acc)
    elapsed, k, epoch, stop = 0.0, 0, 0, False
    while k < max_steps and not stop and elapsed < problem.budget_s:
        for xb, yb in batches(problem, epoch):
            sync(problem.device)
            t0 = time.perf_counter()
            report = step(xb, yb)
            sync(problem.device)
            dt = time.perf_counter() - t0
            elapsed += dt
            k += 1
            result.step_seconds.append(dt)
            result.reported_loss = report.loss
            if report.resolved and k == 1:
                result.settings += f" ({report.resolved})"
            for name, secs in report.stages.items():
                result.stages.setdefault(name, []).append(secs)
            stop = report.stop and problem.batch_size is None
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


@contextlib.contextmanager
def settled_heap() -> Iterator[None]:
    """Collect the harness's garbage and freeze what survives while a method runs.

    The suite's own objects (modules, datasets, earlier methods' results and curves)
    are not a method's, but a full collection that one of its steps happens to
    trigger scans all of them: 15-146 ms per full collection in a quick run's
    process, 0.21 s inside one LM step of sinc.  After a collection and
    ``gc.freeze()`` the collections during the method scan only what was allocated
    since; the method's own garbage is still collected in its steps.  The frozen
    objects go back to the collector afterwards (``gc.unfreeze()``).
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_method(problem: Problem, method: Method) -> MethodResult:
    """Run ``method`` on a fresh model of ``problem`` (or record why it was skipped)."""
    result = MethodResult(method.name, method.settings, family=method.family)
    if method.skipped:
        result.status, result.note = "skipped", method.skipped
        return result
    with settled_heap():
        if method.run is not None:
            method.run(problem, result)
            return result
        assert method.make is not None  # checked by Method
        model = problem.make_model()
        stepper = method.make(problem, model)
        steps = method.max_steps if method.max_steps is not None else problem.max_steps
        every = method.eval_every if method.eval_every is not None else problem.eval_every
        return train(problem, model, result, stepper, steps, every)


def run_problem(
    problem: Problem,
    methods: Sequence[Method],
    sections: Sequence[Section] = (),
    log: Callable[[str], None] = print,
) -> ProblemResult:
    """Run every method on ``problem`` from the same initial weights, then the sections."""
    results = []
    for method in methods:
        results.append(run_method(problem, method))
        log(line(results[-1]))
    out = ProblemResult(problem, results)
    for s in sections:
        if s.measure is not None:
            out.sections[s.key] = s.measure(problem, methods, results)
    return out


# ---------------------------------------------------------------------------------------
# The report


def fmt_s(t: float | None) -> str:
    """Seconds as ``12.3 ms`` below one second, ``1.23 s`` above; ``-`` for none."""
    if t is None or not math.isfinite(t):
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1.0 else f"{t:.2f} s"


def line(r: MethodResult) -> str:
    """One log line about a finished method."""
    if r.status == "skipped":
        return f"  {r.name}: skipped ({r.note})"
    metric = f"test acc {r.accuracies[-1]:.3f}" if r.accuracies else f"loss {r.losses[-1]:.3e}"
    return (
        f"  {r.name}: {r.steps[-1]} steps, {r.seconds[-1]:.2f} s, "
        f"{fmt_s(r.median_step)}/step, {metric} [{r.status}]"
    )


def methods_table(pr: ProblemResult, columns: Sequence[Column] = (), note: str = "") -> list[str]:
    """The problem's heading, description and one row per method."""
    p = pr.problem
    cls = p.kind == "classification"
    description = (
        f"{p.num_parameters} parameters, {p.train[0].shape[0]} training samples, "
        f"target: {'test accuracy' if cls else 'MSE'} {'≥' if cls else '≤'} {p.target:g}."
    )
    lines = [f"## {p.key}: {p.title}", "", description + (f" {p.note}" if p.note else ""), ""]
    lines.append(
        "| method | settings | steps | s/step (median) | time to target | final loss "
        + ("| final test acc " if cls else "")
        + "".join(f"| {c.header} " for c in columns)
        + "| status |"
    )
    lines.append(
        "|---|---|---:|---:|---:|---:|" + ("---:|" if cls else "") + "---|" * len(columns) + "---|"
    )
    for r in pr.methods:
        if r.status == "skipped":
            lines.append(
                f"| {r.name} | {r.settings} | - | - | - | - |"
                + (" - |" if cls else "")
                + " - |" * len(columns)
                + f" skipped: {r.note} |"
            )
            continue
        tt = r.time_to(p.target, p.kind)
        reached = f"{tt:.2f} s" if math.isfinite(tt) else "not reached"
        acc = f" {r.accuracies[-1]:.3f} |" if cls and r.accuracies else (" - |" if cls else "")
        cells = "".join(f" {c.cell(r)} |" for c in columns)
        status = r.status + (f": {r.note}" if r.note else "")
        lines.append(
            f"| {r.name} | {r.settings} | {r.steps[-1]} | {fmt_s(r.median_step)} | "
            f"{reached} | {r.losses[-1]:.3e} |{acc}{cells} {status} |"
        )
    return [*lines, ""]


def markdown(results: Sequence[ProblemResult], header: str, families: Sequence[Family]) -> str:
    """The report: per problem a methods table and the sections, then the closings."""
    columns = [c for f in families for c in f.columns]
    sections = [s for f in families for s in f.sections]
    lines = [header, ""]
    for pr in results:
        lines += methods_table(pr, columns)
        for s in sections:
            lines += s.markdown(pr)
    for f in families:
        for c in f.closings:
            lines += c.markdown(results)
    return "\n".join(lines)


def plot(pr: ProblemResult, path: Path, x: str = "time") -> bool:
    """Loss (and test accuracy) against optimizer wall time or, with ``x="steps"``, steps.

    Returns False without matplotlib.
    """
    if x not in ("time", "steps"):
        raise ValueError(f"Unknown x={x!r}; valid choices are ('time', 'steps').")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the dev extra
        return False
    cls = pr.problem.kind == "classification"
    fig, axes = plt.subplots(1, 2 if cls else 1, figsize=(12 if cls else 7, 4.5), squeeze=False)
    for r in pr.methods:
        xs = r.seconds if x == "time" else r.steps
        if r.status == "skipped" or not xs:
            continue
        axes[0][0].semilogy(xs, r.losses, label=r.name)
        if cls and r.accuracies:
            axes[0][1].plot(xs, r.accuracies, label=r.name)
    axes[0][0].set_ylabel("training loss" + (" (cross-entropy)" if cls else " (MSE)"))
    if not cls:
        axes[0][0].axhline(pr.problem.target, color="grey", ls=":", lw=1)
    if cls:
        axes[0][1].set_ylabel("test accuracy")
        axes[0][1].axhline(pr.problem.target, color="grey", ls=":", lw=1)
    for ax in axes[0]:
        ax.set_xlabel("optimizer wall time (s)" if x == "time" else "steps")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(pr.problem.title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine(families: Sequence[Family] = ()) -> dict[str, Any]:
    """What the numbers were measured on, and the peer packages' versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                cpu = text.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cores_visible": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    for f in families:
        info.update(f.versions())
    return info


def resolve_device(name: str) -> str | None:
    """A ``--device`` as torch spells it, or None (the reason printed) if unusable."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        print(
            f"--device {name!r} is not a device torch knows ({e}); try cpu or cuda", file=sys.stderr
        )
        return None
    if dev.type not in ("cpu", "cuda"):
        print(f"--device {name!r}: the benchmark runs on cpu or cuda", file=sys.stderr)
        return None
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {name!r}: this torch sees no CUDA GPU; use --device cpu", file=sys.stderr)
        return None
    return str(dev)


def run_line() -> str:
    """When and how a script's numbers were taken: UTC time, threads, torch, load."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        f"{now:%Y-%m-%d %H:%M} UTC, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, load {os.getloadavg()[0]:.2f}"
    )


def where(info: Mapping[str, Any], device: str) -> str:
    """The machine a run's numbers come from: the CPU, or the GPU and its host."""
    return info["cpu"] if device == "cpu" else f"{info['gpu']} ({device}), host {info['cpu']}"


def finite_or_none(obj: Any) -> Any:
    """NaN and infinities become ``None`` (JSON ``null``): JSON has no spelling for them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def only_on(
    problems: Sequence[str], fn: Callable[[Problem], list[Method]]
) -> Callable[[Problem], list[Method]]:
    """``fn`` on the problems whose key is in ``problems`` (a family's own); none elsewhere."""

    def make(problem: Problem) -> list[Method]:
        return fn(problem) if problem.key in problems else []

    return make
