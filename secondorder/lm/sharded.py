r"""Linear algebra of an LM iteration whose residuals are spread over several ranks.

Rank k holds the rows ``J_k`` of the Jacobian and the residuals ``r_k`` of its shard;
the normal equations are sums over ranks,

.. math:: J^\top J = \sum_k J_k^\top J_k, \qquad J^\top r = \sum_k J_k^\top r_k,

which is what a :class:`~secondorder.distributed.Reducer` computes.  How each form
meets the ranks:

* **primal, with a factorising solver** (cholesky, eigh): the n×n Gram is summed
  (one all-reduce of n² numbers per step) and every rank factors the same matrix.
* **primal, CG** (:class:`ShardedCGSolver`): matrix-free.  J_k never leaves its
  rank; each CG iteration computes ``J_kᵀ(J_k v)`` locally and sums it over ranks,
  one all-reduce of n numbers.  The iterates, and so the stopping test, are the same
  on every rank because they are built from summed quantities only.
* **dual** (and **QR**, which factors J itself): these need every row of J.  The rows
  are gathered (one all-gather of m·n numbers), after which each rank solves the
  full system as a single process would.  The dual form is chosen when m < n, so
  the gather moves fewer numbers than the primal form's n² all-reduce; gathering
  blocks of ``J D⁻¹Jᵀ`` instead would need every pair of ranks' rows, which is the
  same all-gather plus more products.

:class:`BroadcastSolver` wraps any of these so that rank 0's step is the one every
rank tries, and :class:`ShardedNormalEquations` makes ``‖Jδ‖²`` a reduced quantity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..distributed.reducer import LocalReducer, Reducer
from .cg import CGFactorization, CGSolver
from .linalg import Factorization, LinearSolver, NormalEquations

__all__ = ["BroadcastSolver", "ShardedCGSolver", "ShardedNormalEquations"]


@dataclass
class ShardedNormalEquations(NormalEquations):
    """Normal equations whose ``jac`` may hold only this rank's rows.

    Attributes:
        reducer: how ranks meet.
        rows_sharded: ``jac`` and ``residuals`` hold this rank's rows only (CG);
            ``False`` when they hold every row (gathered for the dual form or QR) or
            are absent (primal Gram).
    """

    reducer: Reducer = field(default_factory=LocalReducer)
    rows_sharded: bool = False

    def curvature(self, delta: Tensor) -> Tensor:
        """``‖Jδ‖²`` over every rank's rows, the same bits on every rank.

        With sharded rows it is ``Σ_k ‖J_kδ‖²``, an all-reduce; otherwise every rank
        computes it from the same data and rank 0's value is broadcast.
        """
        if self.rows_sharded and self.gram is None:
            assert self.jac is not None
            jd = self.jac @ delta.to(self.jac.dtype)
            value = torch.dot(jd, jd).reshape(1)
            self.reducer.sum_([value])
        else:
            value = super().curvature(delta).reshape(1).clone()
            self.reducer.broadcast_([value])
        return value[0]


class _ShardedCG(CGFactorization):
    """CG whose products with ``JᵀJ`` sum every rank's ``J_kᵀ(J_k v)``."""

    reducer: Reducer

    def _matvec(self, v: Tensor, damping: float) -> Tensor:
        s = self.system
        if s.gram is not None:
            jtjv = s.gram @ v
        else:
            assert s.jac is not None
            jtjv = s.jac.T @ (s.jac @ v)
            self.reducer.sum_([jtjv])
        return jtjv + damping * self.d * v


class ShardedCGSolver(CGSolver):
    """Preconditioned CG on ``JᵀJ + λD`` with J's rows spread over ranks.

    Each iteration costs two local products (``J_k v`` and ``J_kᵀu``) and one
    all-reduce of an n-vector; the Jacobi preconditioner ``1/(diag(JᵀJ) + λD)`` uses
    the column norms already summed during linearisation.  Memory per rank is that
    rank's rows of J plus a few n-vectors: no n×n matrix exists anywhere.
    """

    #: Works on this rank's rows of J; the other solvers need every row.
    rows_sharded = True

    def __init__(
        self,
        reducer: Reducer,
        rtol: float = 1e-6,
        max_iter: int | None = None,
        forcing: float | None = None,
        preconditioner: str = "jacobi",
    ) -> None:
        super().__init__(rtol, max_iter, forcing, preconditioner)
        self.reducer = reducer

    def factor(self, system: NormalEquations, d: Tensor, uniform: bool = False) -> Factorization:  # noqa: D102
        if system.dual:
            raise RuntimeError("the cg solver works on the primal form")
        max_iter = self.max_iter if self.max_iter is not None else max(1, system.n)
        # The forcing term is built from summed quantities: every rank stops alike.
        d = d.to(system.grad.dtype)
        # The K-FAC factors were summed over ranks: every rank builds the same M⁻¹.
        kron = self.kronecker(system, d)
        fact = _ShardedCG(system, d, self.tolerance(system), max_iter, kronecker=kron)
        fact.reducer = self.reducer
        return fact


class _BroadcastFactorization(Factorization):
    def __init__(self, inner: Factorization, reducer: Reducer) -> None:
        self.inner = inner
        self.reducer = reducer

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        try:
            delta = self.inner.solve(damping, b, w)
        except torch.linalg.LinAlgError:
            delta = None
        self.iterations = self.inner.iterations
        # One message carries the step and whether rank 0 found one, so a failure on
        # rank 0 is a failure everywhere and a failure elsewhere is overruled.
        packed = torch.zeros(b.numel() + 1, dtype=b.dtype, device=b.device)
        if delta is not None:
            packed[0] = 1.0
            packed[1:] = delta.reshape(-1).to(b.dtype)
        self.reducer.broadcast_([packed])
        if packed[0] == 0:
            return None
        return packed[1:].view_as(b)


class BroadcastSolver(LinearSolver):
    """Run ``inner`` on every rank, and make every rank use rank 0's solution.

    All ranks factor the same summed system, so the solutions agree to rounding; the
    broadcast (``n + 1`` numbers per solve) makes them agree bit for bit, whatever
    the linear-algebra library does with threads or which GPU model runs it.  A
    factorisation that fails on any rank fails on all of them, so the ranks take the
    same branch of the iteration.
    """

    def __init__(self, inner: LinearSolver, reducer: Reducer) -> None:
        self.inner = inner
        self.reducer = reducer
        self.name = inner.name
        self.needs_jacobian = inner.needs_jacobian
        self.rows_sharded = bool(getattr(inner, "rows_sharded", False))
        self.needs_kronecker = bool(getattr(inner, "needs_kronecker", False))

    def factor(self, system: NormalEquations, d: Tensor, uniform: bool = False) -> Factorization:  # noqa: D102
        fact: Factorization | None = None
        error: BaseException | None = None
        try:
            fact = self.inner.factor(system, d, uniform)
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
                f"the {self.name} factorisation failed on {int(flags[0])} of "
                f"{self.reducer.world_size} ranks"
            )
        assert fact is not None
        return _BroadcastFactorization(fact, self.reducer)
