"""Hooks into :func:`fit <secondorder.training.fit>`: :class:`Callback` and three loggers.

:class:`CSVLogger` writes a row per step (and per epoch); :class:`TensorBoardLogger`
writes scalars; :class:`LoggerCallback` hands the same scalars, as a dict, to any
function of the shape ``log(metrics, step)`` (``mlflow.log_metrics``, ``wandb.log``).
A Levenberg-Marquardt run logs the columns and tags it always has (λ, attempts, gain
ratio, stage timings, ...); any other optimizer logs the common fields and the numbers
in its records' ``details``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from ..lm import LevenbergMarquardt, StepInfo
from .history import EpochRecord, History, StepRecord

__all__ = ["CSVLogger", "Callback", "LoggerCallback", "TensorBoardLogger", "as_callbacks"]

TIMING_KEYS = ("linearize", "solve_and_trials", "total")


class Callback:
    """Hooks into :func:`~secondorder.training.fit`; override the ones you need.

    ``on_step`` may return ``True`` to stop training after this step.  A plain
    function ``cb(info)`` is also accepted as a callback: it is called with each
    step's ``info`` (Levenberg-Marquardt: its :class:`~secondorder.lm.StepInfo`; other
    optimizers: the :class:`~secondorder.training.StepRecord`) and may likewise return
    ``True``.
    """

    def on_train_begin(self, optimizer: Any) -> None:
        """Called once before the first step with the optimizer ``fit`` drives."""

    def on_step(self, record: StepRecord, info: Any) -> bool | None:
        """Called after every step with fit's record and the optimizer's full info."""
        return None

    def on_epoch(self, record: EpochRecord) -> bool | None:
        """Called after every epoch (after validation, if any)."""
        return None

    def on_train_end(self, history: History) -> None:
        """Called once when training ends, however it ends (also after an exception)."""


class _FunctionCallback(Callback):
    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def on_step(self, record: StepRecord, info: Any) -> bool | None:
        return self.fn(info) is True


def as_callbacks(callbacks: Any) -> list[Callback]:
    """``fit``'s ``callbacks`` argument as :class:`Callback` objects (functions wrapped)."""
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
    return hooks


def _cell(value: Any) -> Any:
    """A detail as a CSV cell: floats exactly (``repr``), booleans as 0/1."""
    if isinstance(value, bool):
        return int(value)
    return repr(value) if isinstance(value, float) else value


def _flat(details: dict[str, Any]) -> dict[str, Any]:
    """Nested detail dicts (stage timings) as ``name_key`` columns."""
    out: dict[str, Any] = {}
    for key, value in details.items():
        if isinstance(value, dict):
            out.update({f"{key}_{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


class CSVLogger(Callback):
    """Write one CSV row per step: step, epoch, time, loss, the optimizer's own fields.

    Levenberg-Marquardt rows have the columns :attr:`STEP_FIELDS` (λ, attempts, gain
    ratio, stage timings, ...); other optimizers' rows have :attr:`COMMON_FIELDS` and
    then their records' ``details`` (``lr``, ``evaluations`` for ``torch.optim``).  Rows
    are flushed as they are written, so a long run can be watched with ``tail -f``.
    With ``epochs_path``, one row per epoch (with the validation metric) goes to a
    second file.

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
    COMMON_FIELDS = ("step", "epoch", "batch", "time", "loss", "loss_before", "terminated")
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
        self._fresh: list[bool] = []
        self._steps: csv.DictWriter[str] | None = None
        self._epochs: csv.DictWriter[str] | None = None

    def _open(self, path: Path) -> int:
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not (self.append and path.exists() and path.stat().st_size > 0)
        self._files.append(path.open("a" if self.append else "w", newline="", encoding="utf-8"))
        self._fresh.append(fresh)
        return len(self._files) - 1

    def _writer(self, index: int, fields: Iterable[str]) -> csv.DictWriter[str]:
        writer = csv.DictWriter(self._files[index], fieldnames=list(fields), extrasaction="ignore")
        if self._fresh[index]:
            writer.writeheader()
        return writer

    def on_train_begin(self, optimizer: Any) -> None:
        """Open the files and write the headers (another optimizer's: at its first step)."""
        self._steps = None
        self._open(self.path)
        if isinstance(optimizer, LevenbergMarquardt):
            self._steps = self._writer(0, self.STEP_FIELDS)
        if self.epochs_path is not None:
            self._epochs = self._writer(self._open(self.epochs_path), self.EPOCH_FIELDS)

    def _lm_row(self, record: StepRecord, info: StepInfo) -> dict[str, Any]:
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
        return row

    def _row(self, record: StepRecord) -> dict[str, Any]:
        before = record.loss_before
        row: dict[str, Any] = {
            "step": record.step,
            "epoch": record.epoch,
            "batch": record.batch,
            "time": f"{record.time:.6f}",
            "loss": repr(record.loss),
            "loss_before": "" if before is None else repr(before),
            "terminated": int(record.terminated),
        }
        row.update({k: _cell(v) for k, v in _flat(record.details).items()})
        row["reason"] = record.reason
        return row

    def on_step(self, record: StepRecord, info: Any) -> bool | None:
        """Write the step's row."""
        row = self._lm_row(record, info) if isinstance(info, StepInfo) else self._row(record)
        if self._steps is None:
            self._steps = self._writer(0, row)
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
        self._files, self._fresh = [], []


def step_scalars(record: StepRecord, info: Any) -> Sequence[tuple[str, float]]:
    """The numbers a step logs, as ``(name, value)`` pairs.

    Levenberg-Marquardt: ``loss``, ``damping``, ``attempts``, ``cg_iterations`` (CG
    solver) and ``time/<stage>``; other optimizers: ``loss`` and the numbers in the
    record's ``details`` (``lr``, or ``lr/0``, ``lr/1``, ... with several groups).
    """
    if isinstance(info, StepInfo):
        out = [
            ("loss", float(info.loss)),
            ("damping", float(info.damping)),
            ("attempts", int(info.attempts)),
        ]
        if info.solver == "cg":
            out.append(("cg_iterations", info.cg_iterations))
        return out + [(f"time/{k}", v) for k, v in info.timings.items()]
    out = [("loss", record.loss)]
    for key, value in _flat(record.details).items():
        values = value if isinstance(value, tuple) else (value,)
        for i, v in enumerate(values):
            if isinstance(v, (int, float)):
                out.append((key if len(values) == 1 else f"{key}/{i}", v))
    return out


class TensorBoardLogger(Callback):
    """Log the loss, the optimizer's own numbers and validation to TensorBoard.

    Levenberg-Marquardt logs λ, attempts, stage timings and (CG solver) CG
    iterations; other optimizers log the numbers in their records' ``details``
    (``lr``, ``evaluations``).  Needs the ``tensorboard`` package
    (``torch.utils.tensorboard`` imports it); the error on construction says so when it
    is missing.

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

    def on_step(self, record: StepRecord, info: Any) -> bool | None:
        """Log the step's scalars at its step number."""
        for tag, value in step_scalars(record, info):
            self.writer.add_scalar(f"{self.prefix}{tag}", value, record.step)
        return None

    def on_epoch(self, record: EpochRecord) -> bool | None:
        """Log the epoch's validation metric."""
        if record.validation is not None:
            self.writer.add_scalar(f"{self.prefix}validation", record.validation, record.step)
        return None

    def on_train_end(self, history: History) -> None:
        """Flush and close the writer."""
        self.writer.close()


EVERY = ("epoch", "step", "both")


class LoggerCallback(Callback):
    """Send the metrics of each epoch (or step) to any logger: ``log(metrics, step)``.

    ``log`` is called with a dict of floats and the step number, the shape of
    ``mlflow.log_metrics`` and ``wandb.log``, so either plugs in directly and neither
    is a dependency of secondorder::

        import mlflow
        with mlflow.start_run():
            so.fit(opt, data, epochs=50, validation=(xv, yv),
                   callbacks=[so.training.LoggerCallback(mlflow.log_metrics)])

        import wandb
        run = wandb.init(project="lm")
        so.fit(opt, data, epochs=50, callbacks=[so.training.LoggerCallback(wandb.log)])
        run.finish()

    Any other logger takes a two-line function, e.g. for a ``SummaryWriter``:
    ``lambda metrics, step: [writer.add_scalar(k, v, step) for k, v in metrics.items()]``.

    An epoch logs ``epoch``, ``epoch_loss`` (the mean of its step losses), ``time``
    (training seconds) and ``validation`` (when measured), the fields of its
    :class:`~secondorder.training.EpochRecord`.  A step logs the scalars
    :class:`TensorBoardLogger` writes: ``loss`` and, for Levenberg-Marquardt,
    ``damping``, ``attempts``, ``time/<stage>`` (``cg_iterations`` with CG); for other
    optimizers the numbers in the record's ``details`` (``lr``).  Both use the optimizer
    step as ``step`` (an epoch: its last step), so steps never decrease, as W&B
    requires; with ``every="both"`` an epoch's metrics share the step of its last step.

    Args:
        log: called as ``log(metrics, step)``; what it returns is ignored.
        every: ``"epoch"`` (one call per epoch, the usual choice), ``"step"`` (one per
            optimizer step, for long epochs of mini-batches) or ``"both"``.
        prefix: put before every name, e.g. ``"lm/"`` to keep several runs apart.
    """

    def __init__(
        self, log: Callable[[dict[str, float], int], Any], every: str = "epoch", prefix: str = ""
    ) -> None:
        if not callable(log):
            raise TypeError(
                f"log must be a function log(metrics: dict, step: int), got {log!r}; "
                "for example mlflow.log_metrics or wandb.log"
            )
        if every not in EVERY:
            raise ValueError(f"Unknown every={every!r}; valid choices are {EVERY}.")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        self.log, self.every, self.prefix = log, every, prefix

    def _send(self, metrics: Iterable[tuple[str, float]], step: int) -> None:
        self.log({f"{self.prefix}{k}": float(v) for k, v in metrics}, step)

    def on_step(self, record: StepRecord, info: Any) -> bool | None:
        """Log the step's scalars (with ``every="step"`` or ``"both"``)."""
        if self.every != "epoch":
            self._send(step_scalars(record, info), record.step)
        return None

    def on_epoch(self, record: EpochRecord) -> bool | None:
        """Log the epoch's loss, time and validation (with ``every="epoch"`` or ``"both"``)."""
        if self.every != "step":
            metrics = [("epoch", record.epoch), ("epoch_loss", record.loss), ("time", record.time)]
            if record.validation is not None:
                metrics.append(("validation", record.validation))
            self._send(metrics, record.step)
        return None
