"""The reducer interface and its single-process implementation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["LocalReducer", "RankFailedError", "Reducer"]


class RankFailedError(RuntimeError):
    """Another rank raised during the rank-local part of a step; see its error."""


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

    # -- what the numerics ask of the participants, built on the collectives above --------
    @property
    def is_identity(self) -> bool:
        """Whether every collective is the identity: this participant's share is the whole."""
        return self.world_size == 1

    def hold(self, error: Exception) -> Exception:
        """An error of this participant's local work, held until the others learn of it.

        Alone, the error is raised at once.  With others, they are on their way into
        a collective: the caller joins it with zeros of the same shapes and a failure
        flag, then calls :meth:`raise_together`, so that every participant raises and
        the group stays in step for the next call.
        """
        if self.is_identity:
            raise error
        return error

    def raise_together(self, error: Exception | None, failures: Tensor | float, what: str) -> None:
        """After a sum that carried the failure flags: every participant raises, or none.

        ``failures``: the summed flags (read only where there are other participants).
        """
        if error is not None:
            raise error
        if self.is_identity:
            return
        failed = int(failures)
        if failed:
            raise RankFailedError(
                f"{failed} of {self.world_size} ranks raised while {what} (see the error "
                "raised there); every rank raises with it, so no rank changed its parameters "
                "and the process group stays usable: a loop that catches the error may go on "
                "with the next batch."
            )

    def gather_values(self, values: Sequence[float], device: Any = None) -> list[list[float]]:
        """Every participant's ``values`` (a few numbers of the same length), in rank order.

        One sum of a ``world × len(values)`` float64 table, on ``device`` (where the
        collectives run); alone, ``[values]`` without touching a device.
        """
        if self.is_identity:
            return [list(values)]
        table = torch.zeros(self.world_size, len(values), dtype=torch.float64, device=device)
        table[self.rank] = torch.tensor(values, dtype=torch.float64)
        self.sum_([table])
        rows: list[list[float]] = table.tolist()
        return rows

    def gather_rows_together(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`gather_rows` of tensors with the same rows (2-D, or 1-D as one column).

        One gather carries them all, side by side; alone, the tensors as given.
        """
        if self.is_identity:
            return list(tensors)
        columns = [t if t.ndim == 2 else t[:, None] for t in tensors]
        both = self.gather_rows(torch.cat(columns, dim=1))
        out: list[Tensor] = []
        start = 0
        for t, c in zip(tensors, columns, strict=True):
            part = both[:, start : start + c.shape[1]]
            out.append((part if t.ndim == 2 else part[:, 0]).to(t.dtype))
            start += c.shape[1]
        return out

    def sum_with_values(self, value: Tensor, values: Sequence[float]) -> tuple[Tensor, list[float]]:
        """A 0-d float64 ``value`` and a few host numbers, summed in one collective.

        Alone, both as given, without touching a device.
        """
        if self.is_identity:
            return value, list(values)
        table = torch.tensor([0.0, *values], dtype=torch.float64, device=value.device)
        table[0] = value
        self.sum_([table])
        rest: list[float] = table[1:].tolist()
        return table[0], rest

    def root_value(self, value: Tensor) -> Tensor:
        """``value`` as the root computed it: the same bits on every participant."""
        if self.is_identity:
            return value
        shared = value.reshape(-1).clone()
        self.broadcast_([shared])
        return shared.view_as(value)

    def total(self, local: int, summed: Tensor) -> int:
        """An integer count over every participant, from a sum that carried ``local``.

        ``summed`` is read from the device only where there are other participants.
        """
        return local if self.is_identity else int(summed)


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
