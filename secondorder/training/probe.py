"""The check of the validation data that :func:`fit <secondorder.training.fit>` makes first.

Validation runs after each epoch; bad validation data (targets that do not match the
model's outputs, inputs of another dtype, an empty loader) would otherwise be found
only after a whole epoch of training.  Before anything changes, ``fit`` scores the
metric on the first :data:`PROBE_SAMPLES` samples of the first validation batch, the
same code the epochs run, so the error is the one validation would raise later.

What it costs: the first batch is drawn from the validation data (for a
``DataLoader``, one more iterator: its workers start once more) and the model runs
forward on two samples.  The whole first batch is scored instead where two samples
would not be the same check: a residual that couples the samples (a step whose
``couples_samples`` is true, as Levenberg-Marquardt's with a
:class:`~secondorder.lm.ModelResidual`), a batch whose tensors differ in length, or to
confirm a refusal of the two samples (a model that only takes full batches).  The
random number generators the draw uses (torch's, Python's, NumPy's and the loader's
own) are put back afterwards, so training draws the same numbers as without the check.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from ..lm.residuals import describe
from .data import batches, is_single_batch
from .protocol import TrainingStep

__all__ = ["PROBE_SAMPLES", "check_validation"]

#: Samples of the first validation batch scored before training.
PROBE_SAMPLES = 2

#: Errors re-raised as their builtin kind with fit's message (any other as ValueError).
_KINDS = (TypeError, ValueError, IndexError, RuntimeError)


def _length(tree: Any) -> int | None:
    """The length every tensor of ``tree`` shares along its first dimension, else ``None``."""
    tensors = [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]
    if not tensors or any(t.ndim == 0 for t in tensors):
        return None
    lengths = {t.shape[0] for t in tensors}
    return lengths.pop() if len(lengths) == 1 else None


def _head(tree: Any, k: int) -> Any:
    return tree_map(lambda t: t[:k] if isinstance(t, Tensor) else t, tree)


def _generators(data: Any) -> list[torch.Generator]:
    """The generators a loader draws from besides torch's default one (its own, its sampler's)."""
    found: dict[int, torch.Generator] = {}
    holders = [data]
    for name in ("sampler", "batch_sampler"):
        holders.append(getattr(data, name, None))
    holders.append(getattr(getattr(data, "batch_sampler", None), "sampler", None))
    for holder in holders:
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator):
            found[id(g)] = g
    return list(found.values())


@contextlib.contextmanager
def _random_state_kept(data: Any) -> Iterator[None]:
    """Put back the CPU random number generators a draw from ``data`` may advance."""
    own = [(g, g.get_state()) for g in _generators(data)]
    py, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for g, state in own:
            g.set_state(state)
        random.setstate(py)
        np.random.set_state(np_state)


def _described(validation: Any) -> str:
    """The validation data in a message: its kind and size, never its values."""
    if isinstance(validation, (tuple, list)):
        return describe(validation)
    size = len(validation) if hasattr(validation, "__len__") else None
    return type(validation).__name__ + ("" if size is None else f" of {size} batches")


def _refusal(exc: Exception, validation: Any, inputs: Any, targets: Any, name: str) -> Exception:
    """``exc`` with the message of fit: the argument, the first batch, what to pass."""
    batch = f"inputs {describe(inputs)}, targets {describe(targets)}"
    where = (
        f"=({batch}): metric={name!r} cannot be computed on it"
        if is_single_batch(validation)
        else f"={_described(validation)}: metric={name!r} cannot be computed on its first "
        f"batch ({batch})"
    )
    message = (
        f"Invalid validation{where}: {exc}. Pass validation data shaped like the training "
        "data (fit checks it before training: nothing was trained)"
    )
    kind = next((k for k in _KINDS if isinstance(exc, k)), ValueError)
    return kind(message)


def check_validation(
    stepper: TrainingStep,
    validation: Any,
    name: str,
    score: Callable[[Any, Any], tuple[float, float]],
) -> None:
    """Score the first validation batch's first samples now; raise what validation would.

    ``score(inputs, targets)`` is the metric's ``(total, count)`` on one batch, as the
    epochs compute it; ``name`` is the metric's name for the message.  The model runs
    in eval mode and is put back in its own mode.
    """
    model = stepper.model
    with _random_state_kept(validation):
        first = next(batches(validation, "validation")(), None)
    if first is None:
        raise ValueError(
            f"Invalid validation={_described(validation)}: it yields no batches; pass at "
            "least one (inputs, targets) batch, or leave validation=None"
        )
    inputs, targets = first
    couples = bool(getattr(stepper, "couples_samples", False))
    n = None if couples else _length((inputs, targets))
    whole = n is None or n <= PROBE_SAMPLES
    was_training = model.training
    model.eval()
    try:
        try:
            if whole:
                score(inputs, targets)
            else:
                score(_head(inputs, PROBE_SAMPLES), _head(targets, PROBE_SAMPLES))
        except Exception as exc:
            if whole:
                raise _refusal(exc, validation, inputs, targets, name) from exc
            try:
                score(inputs, targets)  # a model that takes whole batches only
            except Exception as again:
                raise _refusal(again, validation, inputs, targets, name) from again
    finally:
        model.train(was_training)
