"""The optimizer's arguments: the model's parameters, the ranks' agreement, step's batch.

The constructor's checks come first: trainable parameters of one dtype on one
device, the same optimizer on every rank.  Then ``step``'s arguments: ``step(x, y)``
or ``step(batch)`` with a loader's ``(inputs, targets)`` pair; a loader or a closure
is refused with a message that says what to pass instead.  Tensors made under
``torch.inference_mode`` are cloned, since the step differentiates the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..distributed import Reducer
from .config import LMConfig
from .residuals import LossResidual, ModelResidual

__all__ = [
    "NO_TARGETS",
    "agree_across_ranks",
    "is_torch_loss",
    "outside_inference",
    "trainable_parameters",
    "unpack_batch",
]


class _NoTargets:
    """The default of ``step``'s ``targets``: none given (unlike an explicit ``None``)."""

    def __repr__(self) -> str:
        return "<no targets>"


NO_TARGETS: Any = _NoTargets()


def is_torch_loss(obj: object) -> bool:
    """Whether ``obj`` is one of torch's loss modules (or a subclass of one)."""
    if not isinstance(obj, nn.modules.loss._Loss):
        return False
    return any(
        c.__module__ == "torch.nn.modules.loss" and not c.__name__.startswith("_")
        for c in type(obj).__mro__
    )


def unpack_batch(inputs: Any, targets: Any) -> tuple[Any, Any]:
    """``step``'s arguments as ``(inputs, targets)``; loaders and closures refused."""
    if isinstance(inputs, torch.utils.data.DataLoader) or (
        isinstance(inputs, Iterable)
        and not isinstance(inputs, (Tensor, list, tuple, dict, str, bytes))
        and not hasattr(inputs, "__array__")
    ):
        raise TypeError(
            f"step() takes one batch, got a {type(inputs).__name__}: loop over the loader "
            "yourself, for x, y in loader: info = opt.step(x, y) (each call is one LM "
            "iteration on that batch; LM works best on large batches, e.g. "
            "DataLoader(..., batch_size=len(dataset)))"
        )
    if callable(inputs) and not isinstance(inputs, (Tensor, nn.Module)):
        raise TypeError(
            f"step() takes the batch, step(inputs, targets), not a {type(inputs).__name__}: "
            "LevenbergMarquardt evaluates residual_fn(model(inputs), targets) and its "
            "Jacobian itself, so it cannot use a closure that returns a loss; the loss "
            "of the step is in the StepInfo it returns (info.loss)"
        )
    if targets is NO_TARGETS:
        if isinstance(inputs, (list, tuple)) and len(inputs) == 2:
            # The [x, y] (or (x, y)) a DataLoader yields.
            return inputs[0], inputs[1]
        return inputs, None
    return inputs, targets


def outside_inference(tree: Any) -> Any:
    """``tree`` with inference tensors (made under ``inference_mode``) cloned.

    Autograd cannot save an inference tensor for the backward pass; a clone made
    outside inference mode is an ordinary tensor with the same values.
    """
    leaves, spec = tree_flatten(tree)
    if not any(isinstance(t, Tensor) and t.is_inference() for t in leaves):
        return tree
    return tree_unflatten(
        [t.clone() if isinstance(t, Tensor) and t.is_inference() else t for t in leaves], spec
    )


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable parameters by name: some, materialised, one dtype and device."""
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(
            f"model {type(model).__name__} has no trainable parameters "
            "(none with requires_grad=True)"
        )
    meta = [k for k, p in named if p.is_meta]
    if meta:
        raise ValueError(
            f"model {type(model).__name__} has parameters on the meta device, which hold "
            f"no values ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}): "
            "materialise them before building the optimizer, e.g. "
            "model.to_empty(device='cpu') and initialise, or "
            "model.load_state_dict(state, assign=True)"
        )
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TypeError(
            f"model parameters must share one floating dtype, got {sorted(map(str, dtypes))}"
        )
    devs = {p.device for _, p in named}
    if len(devs) != 1:
        raise ValueError(f"model parameters must be on one device, got {sorted(map(str, devs))}")
    return named


def agree_across_ranks(
    reducer: Reducer,
    named: list[tuple[str, nn.Parameter]],
    residual_fn: Callable[..., Tensor] | ModelResidual,
    config: LMConfig,
) -> None:
    """Check that the ranks built the same optimizer; give them rank 0's parameters.

    The identity on one process.  ``slice_size`` and ``memory_budget`` may differ:
    they only change how a rank walks its own shard.
    """
    settings: dict[str, Any] = {
        "parameter names": [k for k, _ in named],
        "parameter shapes": [tuple(p.shape) for _, p in named],
        "parameter dtype": str(named[0][1].dtype),
        # A mapped torch loss names the loss and its parameters.
        "residual_fn": repr(residual_fn)
        if isinstance(residual_fn, LossResidual)
        else getattr(residual_fn, "__qualname__", type(residual_fn).__qualname__),
    }
    local_only = ("slice_size", "memory_budget")
    for key, value in asdict(config).items():
        if key not in local_only:
            settings[key] = str(value) if isinstance(value, torch.dtype) else value
    reducer.check_agree(settings, "LevenbergMarquardt settings")
    with torch.no_grad():
        reducer.broadcast_([p.data for _, p in named])
