"""Counting host reads: every call that makes the host wait for a tensor's value.

Every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``nonzero``, boolean-mask indexing, ...) stalls a GPU until its queue
drains.  A :class:`~torch.overrides.TorchFunctionMode` sees each such call, on CPU
too, so host reads are counted by tests without a GPU.  :class:`SyncCounter` records
each read with the secondorder file, line and function that made it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["SYNCS", "SyncCounter"]

SYNCS = {
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__repr__",
    "__format__",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "equal",
    "allclose",
    "numpy",
    "cpu",
}


def _bool_index(args: tuple[Any, ...]) -> bool:
    """``t[mask]`` with a boolean tensor: its result's size is read on the host."""
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool and i.ndim > 0 for i in index)


class SyncCounter(TorchFunctionMode):
    """Record every call that makes the host wait for a tensor's value, with its site."""

    def __init__(self) -> None:
        super().__init__()
        #: ``"item at engine.py:120"``: the call and the line that made it, in order.
        self.sites: list[str] = []
        #: ``"engine.py:step"``: the file and function of each read, in the same order.
        self.functions: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCS or (name == "__getitem__" and _bool_index(args)):
            frames = [f for f in traceback.extract_stack()[:-1] if "secondorder" in f.filename]
            last = frames[-1] if frames else None
            file = last.filename.split("/")[-1] if last else "?"
            self.sites.append(f"{name} at {file}:{last.lineno}" if last else f"{name} at ?")
            self.functions.append(f"{file}:{last.name}" if last else "?")
        return func(*args, **(kwargs or {}))
