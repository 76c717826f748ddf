"""A training loop for Levenberg-Marquardt: progress, logging, validation, early stopping.

:func:`fit` is the loop users otherwise write by hand around
:meth:`LevenbergMarquardt.step <secondorder.lm.LevenbergMarquardt.step>`::

    opt = so.LevenbergMarquardt(model, so.residuals.mse)
    history = so.fit(opt, (x, y), epochs=200)
    history.plot(x="time")

One *epoch* is one pass over ``data``: a single step when ``data`` is one
``(inputs, targets)`` batch (full-batch training, the usual way to run LM on a small or
medium problem), or one step per mini-batch of a ``DataLoader``.  Training stops after
``epochs``, when the optimizer reports ``terminated`` (a convergence test fired, or λ
reached its maximum), when the validation metric has not improved for ``patience``
epochs, or when a callback asks.

Every step becomes a :class:`StepRecord` in the returned :class:`History`; callbacks see
each step's :class:`~secondorder.lm.StepInfo` as it happens (:class:`CSVLogger` writes
them to a file, :class:`TensorBoardLogger` to TensorBoard when it is installed).
"""

from __future__ import annotations

import copy
import csv
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn

from .._validation import check_integer
from ..lm.optimizer import LevenbergMarquardt, StepInfo
from ..lm.residuals import ModelResidual

__all__ = [
    "CSVLogger",
    "Callback",
    "EpochRecord",
    "History",
    "StepRecord",
    "TensorBoardLogger",
    "fit",
]

METRICS = ("loss", "accuracy")
MODES = ("auto", "min", "max")
TIMING_KEYS = ("linearize", "solve_and_trials", "total")


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as :func:`fit` saw it.

    Attributes:
        step: 1-based count of steps in this :func:`fit` call.
        epoch: 1-based epoch the step belongs to.
        batch: 1-based index of the batch within the epoch.
        time: seconds of training since :func:`fit` began, validation excluded.
        loss: the optimizer's ``mean(r²)`` after the step.
        loss_before: the same before the step.
        damping: λ after the step.
        attempts: λ values tried.
        accepted: whether the parameters changed.
        terminated: whether the optimizer considers training finished.
        reason: how the step ended.
        timings: seconds per stage of the step (see :class:`~secondorder.lm.StepInfo`).
        cg_iterations: conjugate-gradient iterations (CG solver only).
    """

    step: int
    epoch: int
    batch: int
    time: float
    loss: float
    loss_before: float
    damping: float
    attempts: int
    accepted: bool
    terminated: bool
    reason: str
    timings: dict[str, float] = field(default_factory=dict)
    cg_iterations: int = 0


@dataclass(frozen=True)
class EpochRecord:
    """One pass over the data.

    Attributes:
        epoch: 1-based epoch number.
        step: the last step of the epoch.
        time: seconds of training at the end of the epoch, validation excluded.
        loss: mean of the epoch's step losses (the loss after each step).
        validation: the validation metric after the epoch, or ``None``.
    """

    epoch: int
    step: int
    time: float
    loss: float
    validation: float | None = None


@dataclass
class History:
    """What :func:`fit` did: every step, every epoch, and why it stopped.

    Attributes:
        steps: one :class:`StepRecord` per optimizer step.
        epochs: one :class:`EpochRecord` per completed epoch.
        stop_reason: why training ended.
        metric: the name of the validation metric (``None`` without validation).
        best_validation, best_epoch: the best validation value and its epoch.
    """

    steps: list[StepRecord] = field(default_factory=list)
    epochs: list[EpochRecord] = field(default_factory=list)
    stop_reason: str = ""
    metric: str | None = None
    best_validation: float | None = None
    best_epoch: int | None = None

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def loss(self) -> list[float]:
        """Loss after each step."""
        return [s.loss for s in self.steps]

    @property
    def time(self) -> list[float]:
        """Training seconds at the end of each step."""
        return [s.time for s in self.steps]

    @property
    def validation(self) -> list[float | None]:
        """Validation metric after each epoch (``None`` where it was not measured)."""
        return [e.validation for e in self.epochs]

    def plot(
        self,
        x: str = "time",
        *,
        path: str | Path | None = None,
        ax: Any = None,
        label: str | None = None,
        logy: bool = True,
    ) -> Any:
        """Plot the loss, and the validation metric if there is one, against time or steps.

        Needs matplotlib (``pip install 'secondorder[plot]'``), imported only here.

        Args:
            x: ``"time"`` (training seconds) or ``"step"``.
            path: if given, save the figure there (PNG, PDF, SVG, ... by extension).
            ax: draw the loss on this matplotlib ``Axes`` instead of a new figure, for
                example to compare several runs on one plot.
            label: legend label of the loss curve.
            logy: logarithmic loss axis.

        Returns:
            The matplotlib ``Figure``.
        """
        if x not in ("time", "step"):
            raise ValueError(f"Unknown x={x!r}; valid choices are ('time', 'step').")
        if not self.steps:
            raise ValueError("history is empty: fit ran no steps, there is nothing to plot")
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "History.plot needs matplotlib; install it with "
                "`pip install matplotlib` or `pip install 'secondorder[plot]'`"
            ) from exc
        validation = [e for e in self.epochs if e.validation is not None]
        if ax is None:
            ncols = 2 if validation else 1
            fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
            ax, vax = axes[0][0], (axes[0][1] if validation else None)
        else:
            fig, vax = ax.figure, None
        first = self.steps[0]
        xs = [0.0 if x == "time" else 0] + [s.time if x == "time" else s.step for s in self.steps]
        ys = [first.loss_before, *self.loss]
        xlabel = "training time (s)" if x == "time" else "step"
        (ax.semilogy if logy else ax.plot)(xs, ys, label=label or "training loss")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (mean r²)")
        ax.grid(True, which="both", alpha=0.3)
        if label is not None:
            ax.legend()
        if vax is not None:
            vx = [e.time if x == "time" else e.step for e in validation]
            vax.plot(vx, [e.validation for e in validation], marker=".", label=self.metric)
            vax.set_xlabel(xlabel)
            vax.set_ylabel(f"validation {self.metric}")
            vax.grid(True, alpha=0.3)
        fig.tight_layout()
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
        return fig


# ---------------------------------------------------------------------------------------
# Callbacks


class Callback:
    """Hooks into :func:`fit`; override the ones you need.

    ``on_step`` may return ``True`` to stop training after this step.  A plain
    function ``cb(info)`` is also accepted as a callback: it is called with each
    step's :class:`~secondorder.lm.StepInfo` and may likewise return ``True``.
    """

    def on_train_begin(self, optimizer: LevenbergMarquardt) -> None:
        """Called once before the first step."""

    def on_step(self, record: StepRecord, info: StepInfo) -> bool | None:
        """Called after every step with fit's record and the optimizer's full info."""
        return None

    def on_epoch(self, record: EpochRecord) -> bool | None:
        """Called after every epoch (after validation, if any)."""
        return None

    def on_train_end(self, history: History) -> None:
        """Called once when training ends, however it ends (also after an exception)."""


class _FunctionCallback(Callback):
    def __init__(self, fn: Callable[[StepInfo], Any]) -> None:
        self.fn = fn

    def on_step(self, record: StepRecord, info: StepInfo) -> bool | None:
        return self.fn(info) is True


class CSVLogger(Callback):
    """Write one CSV row per step: step, epoch, time, loss, λ, attempts, stage timings.

    Rows are flushed as they are written, so a long run can be watched with
    ``tail -f``.  With ``epochs_path``, one row per epoch (with the validation metric)
    goes to a second file.

    Args:
        path: the step file (parent folders are created).
        epochs_path: the optional epoch file.
        append: add to existing files instead of replacing them (no second header).
    """

    STEP_FIELDS = (
        "step",
        "epoch",
        "batch",
        "time",
        "loss",
        "loss_before",
        "damping",
        "attempts",
        "accepted",
        "terminated",
        "gain_ratio",
        "step_norm",
        "cg_iterations",
        *(f"time_{k}" for k in TIMING_KEYS),
        "reason",
    )
    EPOCH_FIELDS = ("epoch", "step", "time", "loss", "validation")

    def __init__(
        self, path: str | Path, epochs_path: str | Path | None = None, append: bool = False
    ) -> None:
        if not isinstance(path, (str, Path)):
            raise TypeError(f"path must be a str or pathlib.Path, got {path!r}")
        if epochs_path is not None and not isinstance(epochs_path, (str, Path)):
            raise TypeError(f"epochs_path must be a str, pathlib.Path or None, got {epochs_path!r}")
        self.path = Path(path)
        self.epochs_path = None if epochs_path is None else Path(epochs_path)
        self.append = append
        self._files: list[IO[str]] = []
        self._steps: csv.DictWriter[str] | None = None
        self._epochs: csv.DictWriter[str] | None = None

    def _open(self, path: Path, fields: Sequence[str]) -> csv.DictWriter[str]:
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not (self.append and path.exists() and path.stat().st_size > 0)
        fh = path.open("a" if self.append else "w", newline="", encoding="utf-8")
        self._files.append(fh)
        writer = csv.DictWriter(fh, fieldnames=list(fields), extrasaction="ignore")
        if fresh:
            writer.writeheader()
        return writer

    def on_train_begin(self, optimizer: LevenbergMarquardt) -> None:
        """Open the files and write the headers."""
        self._steps = self._open(self.path, self.STEP_FIELDS)
        if self.epochs_path is not None:
            self._epochs = self._open(self.epochs_path, self.EPOCH_FIELDS)

    def on_step(self, record: StepRecord, info: StepInfo) -> bool | None:
        """Write the step's row."""
        assert self._steps is not None
        row: dict[str, Any] = {
            "step": record.step,
            "epoch": record.epoch,
            "batch": record.batch,
            "time": f"{record.time:.6f}",
            "loss": repr(info.loss),
            "loss_before": repr(info.loss_before),
            "damping": repr(info.damping),
            "attempts": info.attempts,
            "accepted": int(info.accepted),
            "terminated": int(info.terminated),
            "gain_ratio": repr(info.gain_ratio),
            "step_norm": repr(info.step_norm),
            "cg_iterations": info.cg_iterations,
            "reason": info.reason,
        }
        for k in TIMING_KEYS:
            row[f"time_{k}"] = f"{info.timings[k]:.6f}" if k in info.timings else ""
        self._steps.writerow(row)
        self._files[0].flush()
        return None

    def on_epoch(self, record: EpochRecord) -> bool | None:
        """Write the epoch's row, if an epoch file was asked for."""
        if self._epochs is not None:
            self._epochs.writerow(
                {
                    "epoch": record.epoch,
                    "step": record.step,
                    "time": f"{record.time:.6f}",
                    "loss": repr(record.loss),
                    "validation": "" if record.validation is None else repr(record.validation),
                }
            )
            self._files[-1].flush()
        return None

    def on_train_end(self, history: History) -> None:
        """Close the files."""
        for fh in self._files:
            fh.close()
        self._files = []


class TensorBoardLogger(Callback):
    """Log loss, λ, attempts, stage timings, CG iterations and validation to TensorBoard.

    Needs the ``tensorboard`` package (``torch.utils.tensorboard`` imports it); the
    error on construction says so when it is missing.

    Args:
        log_dir: the run's directory, as for ``SummaryWriter``.
        prefix: tag prefix, e.g. ``"lm/"`` to keep several optimizers apart.
    """

    def __init__(self, log_dir: str | Path, prefix: str = "") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "TensorBoardLogger needs tensorboard: `pip install tensorboard`"
            ) from exc
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.prefix = prefix

    def on_step(self, record: StepRecord, info: StepInfo) -> bool | None:
        """Log the step's scalars at its step number."""
        p, s = self.prefix, record.step
        self.writer.add_scalar(f"{p}loss", info.loss, s)
        self.writer.add_scalar(f"{p}damping", info.damping, s)
        self.writer.add_scalar(f"{p}attempts", info.attempts, s)
        if info.solver == "cg":
            self.writer.add_scalar(f"{p}cg_iterations", info.cg_iterations, s)
        for k, v in info.timings.items():
            self.writer.add_scalar(f"{p}time/{k}", v, s)
        return None

    def on_epoch(self, record: EpochRecord) -> bool | None:
        """Log the epoch's validation metric."""
        if record.validation is not None:
            self.writer.add_scalar(f"{self.prefix}validation", record.validation, record.step)
        return None

    def on_train_end(self, history: History) -> None:
        """Flush and close the writer."""
        self.writer.close()


# ---------------------------------------------------------------------------------------
# Progress


class _Progress:
    """A tqdm bar when tqdm is installed, else a plain line to stderr now and then."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.last = -math.inf
        self.total = total
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)

    def update(self, record: StepRecord, epochs: int, validation: str = "") -> None:
        if not self.enabled:
            return
        stats = f"loss {record.loss:.3e}  λ {record.damping:.1e}  attempts {record.attempts}"
        stats += validation
        if self.bar is not None:
            self.bar.set_description(f"epoch {record.epoch}/{epochs}", refresh=False)
            self.bar.set_postfix_str(stats, refresh=False)
            self.bar.update(1)
            return
        now = time.perf_counter()
        if record.step == 1 or now - self.last >= 2.0 or record.terminated:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            print(
                f"epoch {record.epoch}/{epochs} step {record.step}{of}  {stats}  "
                f"{record.time:.1f}s",
                file=sys.stderr,
                flush=True,
            )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------
# Data and validation


def _split_batch(batch: Any, where: str) -> tuple[Any, Any]:
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) in (1, 2):
        return batch[0], (batch[1] if len(batch) == 2 else None)
    size = f" of length {len(batch)}" if hasattr(batch, "__len__") else ""
    raise TypeError(
        f"{where} must be (inputs, targets) (a tuple or list of 2), got "
        f"{type(batch).__name__}{size}"
    )


def _is_single_batch(data: Any) -> bool:
    return (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and isinstance(data[0], Tensor)
        and (data[1] is None or isinstance(data[1], Tensor))
    )


def _batches(data: Any, name: str) -> Callable[[], Iterator[tuple[Any, Any]]]:
    """A function returning a fresh iterator over ``(inputs, targets)`` for each epoch."""
    if _is_single_batch(data):
        single = (data[0], data[1])
        return lambda: iter([single])
    if isinstance(data, Tensor):
        raise TypeError(
            f"{name} must be an (inputs, targets) tuple or an iterable of such batches, "
            f"got a single tensor of shape {tuple(data.shape)}; pass ({name[0]}, targets)"
        )
    if not isinstance(data, Iterable):
        raise TypeError(
            f"{name} must be an (inputs, targets) tuple of tensors or an iterable of "
            f"(inputs, targets) batches (e.g. a DataLoader), got {type(data).__name__}"
        )
    if iter(data) is data:
        items: Iterator[Any] | None = data

        def once() -> Iterator[tuple[Any, Any]]:
            nonlocal items
            if items is None:
                raise ValueError(
                    f"{name} is a one-shot iterator and was used up after one epoch; "
                    "pass a list or a DataLoader to train for several epochs"
                )
            it, items = items, None
            return (_split_batch(b, f"each batch of {name}") for b in it)

        return once
    return lambda: (_split_batch(b, f"each batch of {name}") for b in data)


def _accuracy(outputs: Tensor, targets: Tensor) -> tuple[float, int]:
    if outputs.ndim >= 2 and outputs.shape[1] > 1:
        pred = outputs.argmax(1)
    else:
        pred = (outputs.reshape(targets.shape) > 0).to(targets.dtype)
    if targets.is_floating_point() and targets.shape == outputs.shape and outputs.ndim >= 2:
        targets = targets.argmax(1)  # one-hot or class probabilities
    return float((pred == targets).sum()), int(targets.numel())


def _validator(
    optimizer: LevenbergMarquardt,
    validation: Any,
    metric: str | Callable[[Tensor, Tensor], Any] | None,
) -> tuple[Callable[[], float], str]:
    model: nn.Module = optimizer.model
    if callable(validation) and not isinstance(validation, (Tensor, nn.Module)):
        if metric is not None:
            raise ValueError(
                "metric must be None when validation is a callable (the callable computes "
                f"the metric itself), got metric={metric!r}"
            )
        fn = validation
        name = getattr(fn, "__name__", "validation")

        def call() -> float:
            value = fn()
            try:
                return float(value)
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"validation() must return a number, got {type(value).__name__}: {value!r}"
                ) from exc

        return call, name
    if isinstance(metric, str) and metric not in METRICS:
        raise ValueError(f"Unknown metric={metric!r}; valid choices are {METRICS} or a callable.")
    if metric is not None and not isinstance(metric, str) and not callable(metric):
        raise TypeError(f"metric must be a name in {METRICS} or a callable, got {metric!r}")
    batches = _batches(validation, "validation")
    if not _is_single_batch(validation) and iter(validation) is validation:
        raise ValueError(
            "validation is a one-shot iterator; it is evaluated after every epoch, so pass "
            "a tuple, a list or a DataLoader"
        )
    residual_fn = optimizer.residual_fn
    name = metric if isinstance(metric, str) else getattr(metric, "__name__", "metric")
    if metric is None:
        name = "loss"

    def evaluate() -> float:
        total, count = 0.0, 0
        was_training = model.training
        model.eval()
        try:
            for inputs, targets in batches():
                if metric in (None, "loss"):
                    if isinstance(residual_fn, ModelResidual):
                        r = residual_fn.fn(model, inputs, targets)
                    else:
                        with torch.no_grad():
                            r = residual_fn(model(inputs), targets)
                    r = r.detach().reshape(-1).to(torch.float64)
                    total += float(torch.dot(r, r))
                    count += r.numel()
                    continue
                with torch.no_grad():
                    outputs = model(inputs)
                if metric == "accuracy":
                    right, k = _accuracy(outputs, targets)
                    total, count = total + right, count + k
                else:
                    assert callable(metric)
                    k = len(targets) if targets is not None else len(inputs)
                    total += float(metric(outputs, targets)) * k
                    count += k
        finally:
            model.train(was_training)
        if count == 0:
            raise ValueError("validation yielded no batches")
        return total / count

    return evaluate, name


# ---------------------------------------------------------------------------------------
# The loop


def _as_optimizer(optimizer: Any) -> LevenbergMarquardt:
    if isinstance(optimizer, LevenbergMarquardt):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, LevenbergMarquardt):
        return inner  # the cuPyLMA drop-in wraps one
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a secondorder.LevenbergMarquardt, got "
            f"{type(optimizer).__name__}: fit drives optimizers whose step(inputs, targets) "
            "computes the loss itself; train first-order optimizers with the usual loop"
        )
    raise TypeError(
        f"optimizer must be a secondorder.LevenbergMarquardt, got {type(optimizer).__name__}"
    )


def fit(
    optimizer: LevenbergMarquardt,
    data: Any,
    *,
    epochs: int = 1,
    callbacks: Sequence[Callback | Callable[[StepInfo], Any]] = (),
    progress: bool = True,
    validation: Any = None,
    metric: str | Callable[[Tensor, Tensor], Any] | None = None,
    mode: str = "auto",
    patience: int | None = None,
    restore_best: bool = False,
    stop_on_terminated: bool = True,
) -> History:
    """Train with ``optimizer`` on ``data`` for up to ``epochs`` passes; return the history.

    Example, full batch with a held-out set and early stopping::

        opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy)
        history = so.fit(opt, (x_train, y_train), epochs=100,
                         validation=(x_val, y_val), metric="accuracy", patience=5)
        print(history.stop_reason, history.best_validation)
        history.plot(x="time", path="out/loss.png")

    Args:
        optimizer: a :class:`~secondorder.lm.LevenbergMarquardt` (or the cuPyLMA
            drop-in ``LMA``, whose optimizer is used).
        data: one ``(inputs, targets)`` batch (a tuple of tensors; ``targets`` may be
            ``None``), or an iterable of such batches: a list, or a
            ``torch.utils.data.DataLoader``, which is iterated afresh every epoch.
        epochs: passes over ``data``.  With a single batch an epoch is one step.
        callbacks: :class:`Callback` objects (e.g. :class:`CSVLogger`) or functions
            ``cb(info)`` called with each step's :class:`~secondorder.lm.StepInfo`;
            returning ``True`` stops training.
        progress: show a progress bar (tqdm when installed, else a line on stderr
            every two seconds) with the loss, λ and attempts; ``False`` is silent.
        validation: evaluated after every epoch: an ``(inputs, targets)`` batch or an
            iterable of batches scored by ``metric``, or a function of no arguments
            returning a number (then ``metric`` must be ``None``).
        metric: ``"loss"`` (default: the training residuals' ``mean(r²)`` on the
            validation data), ``"accuracy"`` (argmax of the outputs against class
            indices), or ``metric(outputs, targets) -> number`` averaged over samples.
        mode: ``"min"`` when lower is better, ``"max"`` when higher is, ``"auto"``
            for ``"max"`` with accuracy and ``"min"`` otherwise.
        patience: stop when the validation metric has not improved for this many
            epochs (needs ``validation``); ``None`` never stops early.
        restore_best: after training, load the parameters of the best validation
            epoch back into the model (needs ``validation``).
        stop_on_terminated: stop when a step reports ``terminated``.  With
            mini-batches a convergence test can fire on one batch; ``False`` keeps
            going until ``epochs``.

    Returns:
        A :class:`History` of every step and epoch, with ``stop_reason``.
    """
    opt = _as_optimizer(optimizer)
    check_integer("epochs", epochs)
    check_integer("patience", patience, allow_none=True)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    if mode not in MODES:
        raise ValueError(f"Unknown mode={mode!r}; valid choices are {MODES}.")
    if isinstance(callbacks, (Callback, str)) or callable(callbacks):
        raise TypeError(
            f"callbacks must be a list of callbacks, got {callbacks!r}; wrap it: callbacks=[...]"
        )
    hooks: list[Callback] = []
    for cb in callbacks:
        if isinstance(cb, Callback):
            hooks.append(cb)
        elif callable(cb):
            hooks.append(_FunctionCallback(cb))
        else:
            raise TypeError(f"each of callbacks must be a Callback or a function, got {cb!r}")
    if validation is None:
        if patience is not None:
            raise ValueError(f"patience={patience} needs validation data to watch; pass validation")
        if restore_best:
            raise ValueError("restore_best=True needs validation data; pass validation")
        if metric is not None:
            raise ValueError(f"metric={metric!r} needs validation data; pass validation")
    batches = _batches(data, "data")
    evaluate, metric_name = (
        _validator(opt, validation, metric) if validation is not None else (None, None)
    )
    maximize = mode == "max" or (mode == "auto" and metric_name == "accuracy")

    total: int | None = None
    if _is_single_batch(data):
        total = epochs
    elif hasattr(data, "__len__"):
        try:
            total = epochs * len(data)
        except TypeError:
            total = None

    history = History(metric=metric_name)
    bar = _Progress(progress, total)
    best_state: dict[str, Tensor] | None = None
    stale = 0
    spent_validating = 0.0
    step = 0
    shown = ""
    t0 = time.perf_counter()
    try:
        for hook in hooks:
            hook.on_train_begin(opt)
        stop = ""
        for epoch in range(1, epochs + 1):
            losses: list[float] = []
            for batch_index, (inputs, targets) in enumerate(batches(), start=1):
                info = opt.step(inputs, targets)
                step += 1
                record = StepRecord(
                    step=step,
                    epoch=epoch,
                    batch=batch_index,
                    time=time.perf_counter() - t0 - spent_validating,
                    loss=info.loss,
                    loss_before=info.loss_before,
                    damping=info.damping,
                    attempts=info.attempts,
                    accepted=info.accepted,
                    terminated=info.terminated,
                    reason=info.reason,
                    timings=dict(info.timings),
                    cg_iterations=info.cg_iterations,
                )
                history.steps.append(record)
                losses.append(info.loss)
                bar.update(record, epochs, shown)
                for hook in hooks:
                    if hook.on_step(record, info) is True:
                        stop = f"stopped by callback {type(hook).__name__}"
                if info.terminated and stop_on_terminated and not stop:
                    stop = f"optimizer terminated: {info.reason}"
                if stop:
                    break
            if not losses:
                raise ValueError(f"data yielded no batches in epoch {epoch}")
            value: float | None = None
            if evaluate is not None:
                tv = time.perf_counter()
                value = evaluate()
                spent_validating += time.perf_counter() - tv
                best = history.best_validation
                better = best is None or (value > best if maximize else value < best)
                if better:
                    history.best_validation, history.best_epoch = value, epoch
                    stale = 0
                    if restore_best:
                        best_state = copy.deepcopy(opt.model.state_dict())
                else:
                    stale += 1
            erec = EpochRecord(
                epoch=epoch,
                step=step,
                time=history.steps[-1].time,
                loss=sum(losses) / len(losses),
                validation=value,
            )
            history.epochs.append(erec)
            if value is not None:
                shown = f"  val {metric_name} {value:.4g}"
            for hook in hooks:
                if hook.on_epoch(erec) is True and not stop:
                    stop = f"stopped by callback {type(hook).__name__}"
            if patience is not None and stale >= patience and not stop:
                stop = (
                    f"early stopping: validation {metric_name} did not improve for "
                    f"{patience} epoch{'s' if patience > 1 else ''} (best "
                    f"{history.best_validation:.6g} at epoch {history.best_epoch})"
                )
            if stop:
                break
        history.stop_reason = stop or f"completed {epochs} epoch{'s' if epochs > 1 else ''}"
        if best_state is not None:
            opt.model.load_state_dict(best_state)
            history.stop_reason += f"; restored the parameters of epoch {history.best_epoch}"
    finally:
        bar.close()
        for hook in hooks:
            hook.on_train_end(history)
    if history.stop_reason:
        bar.message(f"fit: {history.stop_reason}")
    return history
