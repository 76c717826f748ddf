"""Reducers: the one place where partial sums from slices, devices or ranks meet.

The numerics never call ``torch.distributed``; they hand their partial normal
equations to a reducer.  On one process the reducer is :class:`LocalReducer`, which
does nothing, so the single-process path and a distributed path run the same code.
Across processes it is :class:`ProcessGroupReducer`, which turns each request into a
collective over a ``torch.distributed`` process group.

A reducer offers four operations, each a collective that every participant must call
in the same order:

* :meth:`Reducer.sum_`: replace tensors by their sums over all participants (the
  loss, ``Jᵀr``, ``diag(JᵀJ)``, the Gram, CG matrix-vector products);
* :meth:`Reducer.broadcast_`: overwrite tensors with the root's (participant 0's)
  copy, so that a value computed everywhere is identical everywhere by construction;
* :meth:`Reducer.gather_rows`: concatenate every participant's rows in rank order
  (the Jacobian rows of the dual form and of QR, which need all of J);
* :meth:`Reducer.check_agree`: verify that settings that must be equal are equal,
  and raise an error naming the ones that differ.

On these the reducer builds what the numerics ask of the other participants, each
the identity on one process: :meth:`Reducer.hold` and :meth:`Reducer.raise_together`
(agree on a failure: every participant raises, or none),
:meth:`Reducer.gather_values` (a few numbers from each participant),
:meth:`Reducer.root_value` (the root's bits everywhere) and :meth:`Reducer.total`.
The numerics therefore never ask how many participants there are.  The linear
algebra on top of a reducer (CG whose products are summed across ranks, the wrapper
that makes every rank take the root's step) is in :mod:`secondorder.lm.linalg`.
"""

from __future__ import annotations

from typing import Any

import torch

from .process_group import CollectiveError, ProcessGroupReducer
from .reducer import LocalReducer, RankFailedError, Reducer

__all__ = [
    "CollectiveError",
    "LocalReducer",
    "ProcessGroupReducer",
    "RankFailedError",
    "Reducer",
    "resolve_reducer",
]


def resolve_reducer(reducer: Reducer | None, process_group: Any = None) -> Reducer:
    """The reducer an optimizer uses, from its ``reducer`` and ``process_group`` arguments.

    * ``reducer`` given: that reducer (``process_group`` must then be ``None``).
    * ``process_group`` given: a :class:`ProcessGroupReducer` over that group.
    * neither, and ``torch.distributed`` is initialized: a :class:`ProcessGroupReducer`
      over the default group, so a script launched with ``torchrun`` that calls
      ``init_process_group`` trains one model on the union of the ranks' batches,
      as DDP would.  Pass ``reducer=LocalReducer()`` to train independent models on
      each rank instead.
    * otherwise: a :class:`LocalReducer`.
    """
    if reducer is not None and process_group is not None:
        raise ValueError(
            f"pass either reducer= or process_group=, not both (got reducer={reducer!r} and "
            f"process_group={process_group!r})"
        )
    if reducer is not None:
        if not isinstance(reducer, Reducer):
            raise TypeError(
                f"reducer must be a secondorder.distributed.Reducer, got "
                f"{type(reducer).__name__}: {reducer!r}"
            )
        return reducer
    if process_group is not None:
        return ProcessGroupReducer(process_group)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return ProcessGroupReducer(None)
    return LocalReducer()
