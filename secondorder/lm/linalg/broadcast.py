"""One step for every participant: the root's solution, broadcast.

Every participant factors the same summed system, so their solutions agree to
rounding; :class:`BroadcastSolver` makes them agree bit for bit by broadcasting the
root's step (``n + 1`` numbers per solve), whatever the linear-algebra library does
with threads or which GPU model runs it.  A factorisation that fails on any
participant fails on all of them, so they take the same branch of the iteration.
The factory wraps a solver in it only where the batch is shared
(:func:`~.factory.make_solver`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed.reducer import Reducer
from ..precision import NATIVE, StepPrecision
from .base import Factorization, LinearSolver
from .record import NormalEquations

__all__ = ["BroadcastSolver"]


class _BroadcastFactorization(Factorization):
    def __init__(self, inner: Factorization, reducer: Reducer) -> None:
        self.inner = inner
        self.reducer = reducer
        self.dtype = inner.dtype

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        try:
            delta = self.inner.solve(damping, b, w)
        except torch.linalg.LinAlgError:
            delta = None
        self.iterations = self.inner.iterations
        # One message carries the step and whether the root found one, so a failure on
        # the root is a failure everywhere and a failure elsewhere is overruled.
        packed = torch.zeros(b.numel() + 1, dtype=b.dtype, device=b.device)
        if delta is not None:
            packed[0] = 1.0
            packed[1:] = delta.reshape(-1).to(b.dtype)
        self.reducer.broadcast_([packed])
        if packed[0] == 0:
            return None
        return packed[1:].view_as(b)


class BroadcastSolver(LinearSolver):
    """Run ``inner`` on every participant, and make every participant use the root's solution."""

    def __init__(self, inner: LinearSolver, reducer: Reducer) -> None:
        self.inner = inner
        self.reducer = reducer
        self.name = inner.name
        self.needs_jacobian = inner.needs_jacobian
        self.needs_kronecker = inner.needs_kronecker
        self.row_shards = inner.row_shards
        self.forms_matrix = inner.forms_matrix

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        fact: Factorization | None = None
        error: BaseException | None = None
        try:
            fact = self.inner.factor(system, d, uniform, precision)
        except Exception as exc:
            error = exc
        flags = torch.zeros(2, dtype=torch.float64, device=d.device)
        if error is not None:
            flags[0 if isinstance(error, torch.linalg.LinAlgError) else 1] = 1.0
        self.reducer.sum_([flags])
        if flags[1] > 0:
            if error is not None:
                raise error
            raise RuntimeError(
                f"the {self.name} factorisation raised on another rank; see that rank's error"
            )
        if flags[0] > 0:
            raise torch.linalg.LinAlgError(
                f"the {self.name} factorisation failed on {int(flags[0])} of the ranks"
            )
        assert fact is not None
        return _BroadcastFactorization(fact, self.reducer)
