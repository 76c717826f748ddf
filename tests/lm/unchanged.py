"""Shared test helpers: an optimizer's state as plain values, and "nothing changed"."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.checkpoint import entries


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
        assert torch.equal(now[k], v) if isinstance(v, Tensor) else now[k] == v, k
