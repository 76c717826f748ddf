"""Solvers by name: the factory above the solver modules.

``solver="auto"`` is not a solver: the memory planner picks one of these names for
each batch (:mod:`secondorder.lm.planner`), and this factory builds it, on the
array module ``linalg_backend`` names, wrapped so that every participant of a
shared batch takes the root's step (:class:`~.broadcast.BroadcastSolver`).
"""

from __future__ import annotations

from ...distributed.reducer import LocalReducer, Reducer
from .backends import BACKEND_SOLVERS, LINALG_BACKENDS, ArrayCholeskySolver, ArrayEighSolver
from .base import LinearSolver
from .broadcast import BroadcastSolver
from .cg import CGSolver
from .cholesky import CholeskySolver
from .eigh import EighSolver
from .qr import QRSolver

__all__ = ["SOLVERS", "make_solver"]

SOLVERS = ("auto", "cholesky", "eigh", "qr", "cg")


def make_solver(
    name: str,
    *,
    backend: str = "torch",
    cg_rtol: float = 1e-6,
    cg_max_iter: int | None = None,
    cg_forcing: float | None = None,
    cg_preconditioner: str = "jacobi",
    host: bool = False,
    reducer: Reducer | None = None,
) -> LinearSolver:
    """Build the solver called ``name`` (not ``"auto"``, which the planner resolves).

    ``backend``: ``"torch"``, or an array module (:mod:`.backends`) offering
    ``"cholesky"`` and ``"eigh"``.  ``host``: let ``"qr"`` factor a few float64 CPU
    columns in NumPy (:class:`~.qr.QRSolver`).  ``reducer``: where several
    participants share the batch, every one of them takes the root's step.
    """
    solver = _solver(name, backend, cg_rtol, cg_max_iter, cg_forcing, cg_preconditioner, host)
    reducer = reducer if reducer is not None else LocalReducer()
    return solver if reducer.is_identity else BroadcastSolver(solver, reducer)


def _solver(
    name: str,
    backend: str,
    cg_rtol: float,
    cg_max_iter: int | None,
    cg_forcing: float | None,
    cg_preconditioner: str,
    host: bool,
) -> LinearSolver:
    if backend != "torch":
        if backend not in LINALG_BACKENDS:
            raise ValueError(
                f"Unknown linalg_backend={backend!r}; valid choices are {LINALG_BACKENDS}."
            )
        if name == "cholesky":
            return ArrayCholeskySolver(backend)
        if name == "eigh":
            return ArrayEighSolver(backend)
        raise ValueError(
            f"Invalid solver={name!r} with linalg_backend={backend!r}: that backend provides "
            f"{BACKEND_SOLVERS}."
        )
    if name == "cholesky":
        return CholeskySolver()
    if name == "eigh":
        return EighSolver()
    if name == "qr":
        return QRSolver(host=host)
    if name == "cg":
        return CGSolver(cg_rtol, cg_max_iter, cg_forcing, cg_preconditioner)
    raise ValueError(f"Unknown solver={name!r}; valid choices are {SOLVERS}.")
