"""Conversions between the user's arrays (tensors, NumPy, sequences) and float64 tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["as_float64", "like"]


def as_float64(a: Any, name: str) -> Tensor:
    """``a`` as a detached float64 tensor; a non-numeric ``a`` raises naming ``name``."""
    if isinstance(a, Tensor):
        return a.detach().to(torch.float64)
    try:
        return torch.as_tensor(np.asarray(a, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of numbers, got {a!r}") from exc


def like(t: Tensor, template: Any) -> Any:
    """``t`` as a tensor when ``template`` is one, else as a NumPy array."""
    return t if isinstance(template, Tensor) else t.numpy()
