"""Batches for the training loop: ``(inputs, targets)`` pairs from a tuple, a list or a loader.

:func:`fit <secondorder.training.fit>` and the Lightning integration accept the same
shapes of data, so they share these helpers: a batch is ``(inputs, targets)`` (a tuple or
list of two, ``targets`` may be ``None``) or a bare ``inputs`` tensor.  ``inputs`` may
itself be a tuple or list of tensors, for a model of several inputs: ``((x1, x2), y)`` is
one batch whose model is called as ``model((x1, x2))``; or a dict of tensors, as
Hugging Face-style models take them: ``({"input_ids": ids, "mask": m}, y)`` calls
``model({"input_ids": ids, "mask": m})``, one argument, as LevenbergMarquardt's ``step``
does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeGuard

from torch import Tensor

__all__ = ["batch_size", "batches", "is_one_shot", "is_single_batch", "split_batch"]


def _is_inputs(item: Any) -> bool:
    """Whether ``item`` is the inputs of one batch: a tensor, or a tuple, list or dict of them."""
    if isinstance(item, Tensor):
        return True
    if isinstance(item, Mapping):
        item = list(item.values())
    return (
        isinstance(item, (tuple, list))
        and len(item) > 0
        and all(isinstance(t, Tensor) for t in item)
    )


def batch_size(inputs: Any, targets: Any) -> int:
    """Samples in a batch: the targets' length, else that of the (first) input tensor."""
    if targets is not None:
        return len(targets)
    if isinstance(inputs, Mapping):
        inputs = list(inputs.values())
    if isinstance(inputs, (tuple, list)) and inputs and isinstance(inputs[0], Tensor):
        return len(inputs[0])
    return len(inputs)


def _extra_items(count: int, where: str) -> TypeError:
    return TypeError(
        f"{where} has {count} items; fit takes (inputs, targets). Pass further per-sample "
        "tensors (sample weights, masks) with the inputs, ((x, w), y) or ({'x': x, 'w': w}, "
        "y), and use them in the model, or write the training loop by hand"
    )


def split_batch(batch: Any, where: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of one batch; ``where`` names it in the error message.

    A bare tensor is ``inputs`` with no targets; a tuple or list of one or two items
    is ``(inputs,)`` or ``(inputs, targets)``.
    """
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) in (1, 2):
        return batch[0], (batch[1] if len(batch) == 2 else None)
    if isinstance(batch, (tuple, list)) and _is_inputs(batch[0]):
        raise _extra_items(len(batch), where)
    size = f" of length {len(batch)}" if hasattr(batch, "__len__") else ""
    raise TypeError(
        f"{where} must be (inputs, targets) (a tuple or list of 2), got "
        f"{type(batch).__name__}{size}"
    )


def is_single_batch(data: Any) -> bool:
    """Whether ``data`` is one ``(inputs, targets)`` batch rather than a collection of them.

    A pair is one batch when its targets are a tensor or ``None`` and its inputs are a
    tensor or a tuple/list of tensors (several inputs); a collection of batches has
    batches, not tensors, as its items, so ``[(x1, y1), (x2, y2)]`` stays two batches.
    """
    return (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and _is_inputs(data[0])
        and (data[1] is None or isinstance(data[1], Tensor))
    )


def is_one_shot(data: Any) -> TypeGuard[Iterator[Any]]:
    """Whether ``data`` is an iterator that serves its batches once (a generator, ``iter(x)``).

    Decided without calling ``iter`` on a reusable iterable: a ``DataLoader``'s ``iter``
    draws a seed from its generator (or torch's global one), so an extra call would move
    every later shuffle away from the user's own loop over the same loader.
    """
    return isinstance(data, Iterator) and iter(data) is data


def batches(data: Any, name: str) -> Callable[[], Iterator[tuple[Any, Any]]]:
    """A function returning a fresh iterator over ``(inputs, targets)`` for each epoch.

    A single batch yields itself once per epoch; a list or a ``DataLoader`` is iterated
    afresh; a one-shot iterator serves one epoch and then raises, naming ``name``.
    """
    if is_single_batch(data):
        single = (data[0], data[1])
        return lambda: iter([single])
    if isinstance(data, tuple) and len(data) > 2 and all(isinstance(t, Tensor) for t in data):
        # A tuple of tensors is one batch with extra items, not a collection of batches
        # (a collection is a list, a DataLoader or an iterator).
        raise _extra_items(len(data), name)
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
    if is_one_shot(data):
        items: Iterator[Any] | None = data

        def once() -> Iterator[tuple[Any, Any]]:
            nonlocal items
            if items is None:
                raise ValueError(
                    f"{name} is a one-shot iterator and was used up after one epoch; "
                    "pass a list or a DataLoader to train for several epochs"
                )
            it, items = items, None
            return (split_batch(b, f"each batch of {name}") for b in it)

        return once
    return lambda: (split_batch(b, f"each batch of {name}") for b in data)
