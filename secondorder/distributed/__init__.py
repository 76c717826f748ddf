"""Reducers: the one place where partial sums from slices, devices or ranks meet.

The numerics never call ``torch.distributed``; they hand their partial normal
equations to a reducer.  On one process the reducer is :class:`LocalReducer`, which
does nothing, so the single-process path and a distributed path run the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["LocalReducer", "Reducer"]


class Reducer:
    """Sums tensors across whatever holds other shares of the batch."""

    #: Number of participants whose shares are summed (1 on a single process).
    world_size: int = 1

    def sum_(self, tensors: Sequence[Tensor]) -> None:
        """Replace each tensor in place by its sum over all participants."""
        raise NotImplementedError


class LocalReducer(Reducer):
    """The single-process reducer: every share is already the whole."""

    def sum_(self, tensors: Sequence[Tensor]) -> None:  # noqa: D102
        return None
