"""The reducer interface and its single-process implementation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

__all__ = ["LocalReducer", "Reducer"]


class Reducer:
    """Sums tensors across whatever holds other shares of the batch.

    Subclasses implement the four collectives below; every participant calls them in
    the same order with tensors of the same shapes (except :meth:`gather_rows`, whose
    row counts may differ).
    """

    #: Number of participants whose shares are summed (1 on a single process).
    world_size: int = 1
    #: This participant's index in ``range(world_size)``; 0 is the root.
    rank: int = 0

    def sum_(self, tensors: Sequence[Tensor]) -> None:
        """Replace each tensor in place by its sum over all participants."""
        raise NotImplementedError

    def broadcast_(self, tensors: Sequence[Tensor]) -> None:
        """Overwrite each tensor in place with the root participant's copy."""
        raise NotImplementedError

    def gather_rows(self, tensor: Tensor) -> Tensor:
        """Concatenate every participant's ``tensor`` along dim 0, in rank order.

        The tensors may have different numbers of rows; their other dimensions and
        their dtype must agree.
        """
        raise NotImplementedError

    def check_agree(self, settings: Mapping[str, Any], what: str) -> None:
        """Raise :class:`ValueError` naming each entry of ``settings`` that differs.

        ``what`` says what the settings belong to, for the message.
        """
        raise NotImplementedError


class LocalReducer(Reducer):
    """The single-process reducer: every share is already the whole."""

    def sum_(self, tensors: Sequence[Tensor]) -> None:  # noqa: D102
        return None

    def broadcast_(self, tensors: Sequence[Tensor]) -> None:  # noqa: D102
        return None

    def gather_rows(self, tensor: Tensor) -> Tensor:  # noqa: D102
        return tensor

    def check_agree(self, settings: Mapping[str, Any], what: str) -> None:  # noqa: D102
        return None
