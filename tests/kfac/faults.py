"""Faults injected into real K-FAC steps, and the state a failed step must leave alone.

:class:`Fault` is a ``torch.overrides.TorchFunctionMode``: PyTorch's own dispatch hook,
through which every ``torch.linalg.eigh``, ``cholesky_ex`` or ``Tensor.copy_`` of the
step passes.  At the chosen call it raises what a failing LAPACK routine (or a Ctrl-C)
would raise there; every other call runs the real function.  :func:`state_of` reads
everything a step may change, so that a failed step can be compared bitwise with the
state before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from secondorder.kfac import KFAC

__all__ = ["Fault", "same", "state_of", "writes_a_grad"]

#: A layer's statistics since the last factor update.
STATS = ("a_sum", "g_sum", "a_rows", "g_samples", "forward_calls", "backward_calls", "counted")


class Fault(TorchFunctionMode):
    """Raise ``error`` at the ``at``-th call (1-based) of ``func`` that ``when`` accepts.

    Raises once; ``calls`` counts the accepted calls seen.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        error: BaseException,
        at: int = 1,
        when: Callable[[tuple[Any, ...]], bool] | None = None,
    ) -> None:
        super().__init__()
        self.func, self.error, self.at, self.when = func, error, at, when
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is self.func and (self.when is None or self.when(args)):
            self.calls += 1
            if self.calls == self.at:
                raise self.error
        return func(*args, **(kwargs or {}))


def writes_a_grad(model: nn.Module) -> Callable[[tuple[Any, ...]], bool]:
    """A ``when`` for ``Tensor.copy_``: the destination is a parameter's ``.grad``."""

    def when(args: tuple[Any, ...]) -> bool:
        return any(p.grad is not None and args[0] is p.grad for p in model.parameters())

    return when


def _copy(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_copy(v) for v in x]
    if isinstance(x, set):
        return sorted(x)
    return x


def state_of(kfac: KFAC, model: nn.Module) -> dict[str, Any]:
    """Everything a K-FAC step may change, copied: its state_dict, the statistics
    gathered since the last step, the hooks' pass records, every parameter and
    ``.grad``."""
    cap = kfac._capture
    return {
        "kfac": _copy(kfac.state_dict()),
        "stats": {
            name: {a: _copy(getattr(layer, a, None)) for a in STATS}
            for name, layer in kfac.layers.items()
        },
        # (not the count of model calls, which a skipped batch or a metric raises)
        "capture": _copy([cap.capturing, cap.layer_pass, getattr(cap, "layer_call", None)]),
        "params": [_copy(p) for p in model.parameters()],
        "grads": [None if p.grad is None else _copy(p.grad) for p in model.parameters()],
    }


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two :func:`state_of` results (dtypes included)."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return (
            isinstance(b, list)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)
