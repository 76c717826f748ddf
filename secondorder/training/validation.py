"""The validation metric :func:`fit <secondorder.training.fit>` measures after each epoch.

``metric="loss"`` is the training loss on held-out batches, averaged over what the
optimizer's :meth:`~secondorder.training.TrainingStep.batch_loss` counts (residual
entries for Levenberg-Marquardt, samples for ``torch.optim``); ``"accuracy"`` compares
the argmax of the outputs with class indices; a function ``metric(outputs, targets)`` is
averaged over samples; a function of no arguments is its own metric.  Before training,
:func:`~secondorder.training.probe.check_validation` scores the first samples of the
first batch, so bad validation data fails before an epoch is spent.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .data import batch_size, batches, is_one_shot, is_single_batch
from .probe import check_validation
from .protocol import TrainingStep

__all__ = ["METRICS", "accuracy", "validator"]

METRICS = ("loss", "accuracy")


def _squeezed(shape: torch.Size) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def accuracy(outputs: Tensor, targets: Tensor) -> tuple[float, int]:
    """``(right, count)``: argmax of the outputs (or the sign of one logit) against labels.

    Targets may be class indices, or one-hot rows / class probabilities (their argmax).
    They must hold one label per prediction; shapes that differ only by dimensions of
    size 1 (``(N, 1)`` labels for ``(N,)`` predictions) are the same labels, anything else
    raises, since comparing them would broadcast into a meaningless count.
    """
    if outputs.ndim >= 2 and outputs.shape[1] > 1:
        if targets.is_floating_point() and targets.shape == outputs.shape:
            targets = targets.argmax(1)  # one-hot or class probabilities
        pred = outputs.argmax(1)
    else:
        pred = outputs > 0
    if _squeezed(pred.shape) != _squeezed(targets.shape):
        raise ValueError(
            f"metric='accuracy' needs one label per prediction: outputs of shape "
            f"{tuple(outputs.shape)} give predictions of shape {tuple(pred.shape)}, but the "
            f"targets have shape {tuple(targets.shape)}; pass class indices of shape "
            f"{tuple(pred.shape)} (or one-hot rows shaped like the outputs)"
        )
    targets = targets.reshape(pred.shape)
    return float((pred.to(targets.dtype) == targets).sum()), int(targets.numel())


def _callable_validator(fn: Callable[[], Any], metric: Any) -> tuple[Callable[[], float], str]:
    if metric is not None:
        raise ValueError(
            "metric must be None when validation is a callable (the callable computes "
            f"the metric itself), got metric={metric!r}"
        )

    def call() -> float:
        value = fn()
        try:
            return float(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"validation() must return a number, got {type(value).__name__}: {value!r}"
            ) from exc

    return call, getattr(fn, "__name__", "validation")


def _score(stepper: TrainingStep, metric: Any, inputs: Any, targets: Any) -> tuple[float, float]:
    """``(total, count)`` of the metric on one batch, the model in eval mode.

    The count is what the mean divides by: samples, residual entries, or (a loss
    with class weights) the batch's weight.
    """
    if metric in (None, "loss"):
        return stepper.batch_loss(inputs, targets)
    with torch.no_grad():
        outputs = stepper.model(inputs)
    if metric == "accuracy":
        return accuracy(outputs, targets)
    k = batch_size(inputs, targets)
    return float(metric(outputs, targets)) * k, k


def validator(
    stepper: TrainingStep,
    validation: Any,
    metric: str | Callable[[Tensor, Tensor], Any] | None,
) -> tuple[Callable[[], float], str]:
    """``(evaluate, name)``: a function measuring the metric now, and the metric's name.

    Batches of data are checked now, on the first samples of the first batch (see
    :mod:`~secondorder.training.probe`); a function of no arguments is not called.
    """
    if callable(validation) and not isinstance(validation, (Tensor, nn.Module)):
        return _callable_validator(validation, metric)
    if isinstance(metric, str) and metric not in METRICS:
        raise ValueError(f"Unknown metric={metric!r}; valid choices are {METRICS} or a callable.")
    if metric is not None and not isinstance(metric, str) and not callable(metric):
        raise TypeError(f"metric must be a name in {METRICS} or a callable, got {metric!r}")
    held_out = batches(validation, "validation")
    if not is_single_batch(validation) and is_one_shot(validation):
        raise ValueError(
            "validation is a one-shot iterator; it is evaluated after every epoch, so pass "
            "a tuple, a list or a DataLoader"
        )
    name = metric if isinstance(metric, str) else getattr(metric, "__name__", "metric")
    if metric is None:
        name = "loss"
    model = stepper.model

    def evaluate() -> float:
        total, count, seen = 0.0, 0.0, 0
        was_training = model.training
        model.eval()
        try:
            for inputs, targets in held_out():
                value, k = _score(stepper, metric, inputs, targets)
                total, count, seen = total + value, count + k, seen + 1
        finally:
            model.train(was_training)
        if seen == 0:
            raise ValueError("validation yielded no batches")
        # Nothing to average (every target ignored, or weighted zero): NaN, as torch's
        # mean of no elements.
        return total / count if count else math.nan

    check_validation(stepper, validation, name, functools.partial(_score, stepper, metric))
    return evaluate, name
