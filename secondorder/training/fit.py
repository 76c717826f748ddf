"""The training loop for any optimizer: progress, logging, validation, early stopping.

:func:`fit` is the loop users otherwise write by hand around an optimizer's step::

    opt = so.LevenbergMarquardt(model, so.residuals.mse)
    history = so.fit(opt, (x, y), epochs=200)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = so.fit(opt, loader, epochs=20, model=model, loss_fn=F.mse_loss)
    history.plot(x="time")

One *epoch* is one pass over ``data``: a single step when ``data`` is one
``(inputs, targets)`` batch (full-batch training, the usual way to run LM on a small or
medium problem), or one step per mini-batch of a ``DataLoader``.  Training stops after
``epochs``, when the optimizer reports ``terminated`` (LM: a convergence test fired, or λ
reached its maximum), when the validation metric has not improved for ``patience``
epochs, or when a callback asks.

Every step becomes a :class:`StepRecord` in the returned :class:`History`; callbacks see
each step as it happens (:class:`CSVLogger` writes them to a file,
:class:`TensorBoardLogger` to TensorBoard when it is installed, :class:`LoggerCallback`
to any ``log(metrics, step)`` function such as ``mlflow.log_metrics`` or ``wandb.log``).
The optimizer is driven through a :class:`~secondorder.training.TrainingStep` (see
:mod:`secondorder.training.protocol`), chosen from its type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from .._validation import check_integer
from .callbacks import Callback, CSVLogger, LoggerCallback, TensorBoardLogger, as_callbacks
from .data import batches, is_single_batch
from .history import EpochRecord, History, StepRecord
from .loop import Loop, Stopping
from .progress import Progress
from .steps import as_training_step
from .validation import validator

__all__ = [
    "CSVLogger",
    "Callback",
    "EpochRecord",
    "History",
    "LoggerCallback",
    "StepRecord",
    "TensorBoardLogger",
    "fit",
]

MODES = ("auto", "min", "max")


def _check(
    epochs: int, patience: int | None, progress: bool, mode: str, validation: Any, **needs: Any
) -> None:
    """The checks of fit's own arguments, before anything runs."""
    check_integer("epochs", epochs)
    check_integer("patience", patience, allow_none=True)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    if mode not in MODES:
        raise ValueError(f"Unknown mode={mode!r}; valid choices are {MODES}.")
    if validation is None:
        if patience is not None:
            raise ValueError(f"patience={patience} needs validation data to watch; pass validation")
        if needs["restore_best"]:
            raise ValueError("restore_best=True needs validation data; pass validation")
        if needs["metric"] is not None:
            raise ValueError(f"metric={needs['metric']!r} needs validation data; pass validation")


def _total(data: Any, epochs: int) -> int | None:
    """Steps the progress bar expects, where the data's length says."""
    if is_single_batch(data):
        return epochs
    if hasattr(data, "__len__"):
        try:
            return epochs * len(data)
        except TypeError:
            return None
    return None


def fit(
    optimizer: Any,
    data: Any,
    *,
    epochs: int = 1,
    model: Any = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    preconditioner: Any = None,
    callbacks: Sequence[Callback | Callable[[Any], Any]] = (),
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

    Args:
        optimizer: a :class:`~secondorder.lm.LevenbergMarquardt` (or the cuPyLMA
            drop-in ``LMA``), a ``torch.optim.Optimizer`` (with ``model`` and
            ``loss_fn``), or any :class:`~secondorder.training.TrainingStep`.
        data: one ``(inputs, targets)`` batch (``targets`` may be ``None``), or an
            iterable of such batches (a list, or a ``DataLoader``, iterated afresh
            every epoch).
        epochs: passes over ``data``.  With a single batch an epoch is one step.
        model: for a ``torch.optim`` optimizer, the module it trains.  A step is
            zero_grad, forward, backward, ``optimizer.step``, in a closure (as LBFGS needs).
        loss_fn: for a ``torch.optim`` optimizer, ``loss_fn(model(inputs), targets)``
            returning the scalar loss, averaged over the batch.
        preconditioner: for a ``torch.optim`` optimizer, an object with ``step()`` (or
            a function) that rewrites ``.grad`` between backward and the step (K-FAC).
        callbacks: :class:`Callback` objects (e.g. :class:`CSVLogger`,
            :class:`LoggerCallback` for MLflow or W&B) or functions
            ``cb(info)`` called with each step's info (LM: its
            :class:`~secondorder.lm.StepInfo`, else the :class:`StepRecord`);
            returning ``True`` stops training.
        progress: a progress bar (tqdm when installed, else a line on stderr every
            two seconds) with the loss (and λ, attempts for LM); ``False`` is silent.
        validation: evaluated after every epoch: an ``(inputs, targets)`` batch or an
            iterable of batches scored by ``metric``, or a function of no arguments
            returning a number (then ``metric`` must be ``None``).  Batches are
            checked before training, on two samples of the first batch (see
            :mod:`~secondorder.training.probe`), so bad data fails before an epoch.
        metric: ``"loss"`` (default: the training loss on the validation data),
            ``"accuracy"`` (argmax of the outputs against class indices), or
            ``metric(outputs, targets) -> number`` averaged over samples.
        mode: ``"min"`` when lower is better, ``"max"`` when higher is, ``"auto"``
            for ``"max"`` with accuracy and ``"min"`` otherwise.
        patience: stop when the validation metric has not improved for this many
            epochs (needs ``validation``); ``None`` never stops early.
        restore_best: after training, load the model parameters of the best
            validation epoch back (needs ``validation``; optimizer state stays).
        stop_on_terminated: stop when a step reports ``terminated``; ``False`` keeps
            going until ``epochs`` (with mini-batches a test can fire on one batch).

    Returns:
        A :class:`History` of every step and epoch, with ``stop_reason``.
    """
    stepper = as_training_step(
        optimizer, model=model, loss_fn=loss_fn, preconditioner=preconditioner
    )
    _check(epochs, patience, progress, mode, validation, restore_best=restore_best, metric=metric)
    hooks = as_callbacks(callbacks)
    each_epoch = batches(data, "data")
    evaluate, metric_name = (
        validator(stepper, validation, metric) if validation is not None else (None, None)
    )
    maximize = mode == "max" or (mode == "auto" and metric_name == "accuracy")
    stopping = Stopping(epochs, patience, maximize, restore_best, stop_on_terminated)
    bar = Progress(progress, _total(data, epochs), epochs)
    return Loop(stepper, each_epoch, hooks, evaluate, metric_name, stopping, bar).run()
