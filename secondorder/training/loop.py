"""The epoch loop behind :func:`fit <secondorder.training.fit>`.

One *epoch* is one pass over the data: a step per batch through the
:class:`~secondorder.training.TrainingStep`, then validation (its time is left out of
the records' clock), callbacks and the stopping rules: the optimizer's ``terminated``,
patience on the validation metric, a callback returning ``True``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .callbacks import Callback
from .history import EpochRecord, History, StepRecord
from .progress import Progress
from .protocol import TrainingStep

__all__ = ["Loop", "Stopping"]


@dataclass(frozen=True)
class Stopping:
    """When training ends, besides running out of epochs.

    Attributes:
        epochs: passes over the data.
        patience: epochs without a better validation value before stopping, or ``None``.
        maximize: higher validation values are better.
        restore_best: reload the best validation epoch's parameters at the end.
        on_terminated: stop when a step reports ``terminated``.
    """

    epochs: int
    patience: int | None
    maximize: bool
    restore_best: bool
    on_terminated: bool


class Loop:
    """One :func:`~secondorder.training.fit` run: its state, and the run split into steps."""

    def __init__(
        self,
        stepper: TrainingStep,
        batches: Callable[[], Iterator[tuple[Any, Any]]],
        hooks: list[Callback],
        evaluate: Callable[[], float] | None,
        metric: str | None,
        stopping: Stopping,
        progress: Progress,
    ) -> None:
        self.stepper, self.batches, self.hooks = stepper, batches, hooks
        self.evaluate, self.stopping, self.bar = evaluate, stopping, progress
        label = getattr(stepper, "loss_label", "loss")
        self.history = History(metric=metric, loss_label=label)
        self.best_state: dict[str, Tensor] | None = None
        self.stale = 0
        self.spent_validating = 0.0
        self.step = 0
        self.stop = ""
        self.t0 = 0.0

    def run(self) -> History:
        """Train until a stopping rule fires; return the history."""
        history, epochs = self.history, self.stopping.epochs
        self.t0 = time.perf_counter()
        try:
            for hook in self.hooks:
                hook.on_train_begin(self.stepper.optimizer)
            for epoch in range(1, epochs + 1):
                self._epoch(epoch)
                if self.stop:
                    break
            history.stop_reason = (
                self.stop or f"completed {epochs} epoch{'s' if epochs > 1 else ''}"
            )
            if self.best_state is not None:
                self.stepper.model.load_state_dict(self.best_state)
                history.stop_reason += f"; restored the parameters of epoch {history.best_epoch}"
        finally:
            self.bar.close()
            for hook in self.hooks:
                hook.on_train_end(history)
        if history.stop_reason:
            self.bar.message(f"fit: {history.stop_reason}")
        return history

    def _step(self, epoch: int, batch: int, inputs: Any, targets: Any) -> StepRecord:
        result = self.stepper.step(inputs, targets)
        self.step += 1
        record = StepRecord(
            step=self.step,
            epoch=epoch,
            batch=batch,
            time=time.perf_counter() - self.t0 - self.spent_validating,
            loss=result.loss,
            loss_before=result.loss_before,
            terminated=result.terminated,
            reason=result.reason,
            details=result.details,
        )
        self.history.steps.append(record)
        if self.bar.enabled:
            self.bar.update(record, self.stepper.describe(record), self.evaluate is not None)
        info = record if result.info is None else result.info
        for hook in self.hooks:
            if hook.on_step(record, info) is True:
                self.stop = f"stopped by callback {type(hook).__name__}"
        if record.terminated and self.stopping.on_terminated and not self.stop:
            self.stop = f"optimizer terminated: {record.reason}"
        return record

    def _epoch(self, epoch: int) -> None:
        losses: list[float] = []
        for batch, (inputs, targets) in enumerate(self.batches(), start=1):
            losses.append(self._step(epoch, batch, inputs, targets).loss)
            if self.stop:
                break
        if not losses:
            raise ValueError(f"data yielded no batches in epoch {epoch}")
        value = self._validate(epoch)
        record = EpochRecord(
            epoch=epoch,
            step=self.step,
            time=self.history.steps[-1].time,
            loss=sum(losses) / len(losses),
            validation=value,
        )
        self.history.epochs.append(record)
        self.bar.epoch(record, self.history.metric)
        for hook in self.hooks:
            if hook.on_epoch(record) is True and not self.stop:
                self.stop = f"stopped by callback {type(hook).__name__}"
        patience = self.stopping.patience
        if patience is not None and self.stale >= patience and not self.stop:
            self.stop = (
                f"early stopping: validation {self.history.metric} did not improve for "
                f"{patience} epoch{'s' if patience > 1 else ''} ({self._best_text()})"
            )

    def _best_text(self) -> str:
        best = self.history.best_validation
        if best is None:
            return "no epoch had a validation value that is not NaN"
        return f"best {best:.6g} at epoch {self.history.best_epoch}"

    def _validate(self, epoch: int) -> float | None:
        """Measure the metric (off the clock); track the best epoch and its parameters."""
        if self.evaluate is None:
            return None
        tv = time.perf_counter()
        value = self.evaluate()
        self.spent_validating += time.perf_counter() - tv
        history = self.history
        best = history.best_validation
        # NaN compares false with everything: taken as best once, nothing would ever
        # replace it.  It is never best and counts as an epoch without improvement.
        better = best is None or (value > best if self.stopping.maximize else value < best)
        if better and not math.isnan(value):
            history.best_validation, history.best_epoch = value, epoch
            self.stale = 0
            if self.stopping.restore_best:
                self.best_state = copy.deepcopy(self.stepper.model.state_dict())
        else:
            self.stale += 1
        return value
