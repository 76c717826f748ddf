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

    def broadcast_from_(self, tensors: Sequence[Tensor], src: int) -> None:
        """Overwrite each tensor in place with participant ``src``'s copy.

        Unlike :meth:`broadcast_`, the source is any participant, so work that one
        participant did (a K-FAC layer's eigendecomposition) reaches the others.
        """
        raise NotImplementedError

    def split(self, groups: Sequence[Sequence[int]]) -> Reducer:
        """The reducer over the one group of ``groups`` that holds this participant.

        ``groups`` partitions ``range(world_size)`` (every participant exactly once);
        every participant calls :meth:`split` with the same ``groups`` in the same
        order, because building process groups is itself collective.  In the
        returned reducer, ``rank`` is this participant's position in its group sorted
        ascending.
        """
        raise NotImplementedError


def check_partition(groups: Sequence[Sequence[int]], world_size: int) -> int:
    """Index of the group of ``groups`` that holds rank 0; ValueError unless a partition."""
    flat = [r for g in groups for r in g]
    if sorted(flat) != list(range(world_size)) or any(len(g) == 0 for g in groups):
        raise ValueError(
            f"Invalid groups={[list(g) for g in groups]!r}: must be non-empty lists that "
            f"together hold every rank of range({world_size}) exactly once."
        )
    return next(i for i, g in enumerate(groups) if 0 in g)


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

    def broadcast_from_(self, tensors: Sequence[Tensor], src: int) -> None:  # noqa: D102
        if src != 0:
            raise ValueError(f"Invalid src={src!r}: a single process has only participant 0.")
        return None

    def split(self, groups: Sequence[Sequence[int]]) -> Reducer:  # noqa: D102
        check_partition(groups, 1)
        return self
