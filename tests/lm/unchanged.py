"""Shared test helpers: an optimizer's state as plain values, and "nothing changed"."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.checkpoint import entries


def same_value(x: object, y: object) -> bool:
    """Equality of two state entries: tensors bitwise, a NaN float equal to a NaN float."""
    if isinstance(x, Tensor) or isinstance(y, Tensor):
        return isinstance(x, Tensor) and isinstance(y, Tensor) and torch.equal(x, y)
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x):
        return math.isnan(y)
    return bool(x == y)


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equality of two optimizer state dicts' entries (:func:`same_value` for each)."""
    return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)


def state_of(opt: so.LevenbergMarquardt) -> dict[str, object]:
    """The optimizer's state-dict entries, tensors cloned."""
    return {
        k: v.clone() if isinstance(v, Tensor) else v for k, v in entries(opt.state_dict()).items()
    }


def assert_unchanged(
    model: nn.Module, before: list[Tensor], opt: so.LevenbergMarquardt, state: dict[str, object]
) -> None:
    """The parameters equal ``before`` and the optimizer's state ``state``, bitwise."""
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    now = state_of(opt)
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert same_value(now[k], v), k
