"""The normal-equation solve on a NumPy-API array module: NumPy or cuPyNumeric.

``linalg_backend`` chooses where the factorisation and the per-λ solves of an LM
iteration run:

* ``"torch"`` (default): ``torch.linalg`` on the parameters' device
  (:mod:`secondorder.lm.linalg`).
* ``"numpy"``: NumPy's LAPACK on the host: the reference for, and the test of, the
  array-module path that cuPyNumeric takes.
* ``"cupynumeric"``: NVIDIA cuPyNumeric on Legate, which spreads arrays and the
  Cholesky factorisation over the GPUs (and nodes) the ``legate`` launcher gives
  it.  This is the choice when the n×n Gram (or the m×m dual matrix) and its
  factor outgrow one GPU.  Install with ``pip install 'secondorder[cupynumeric]'``
  (the ``nvidia-cupynumeric`` wheel, with ``legate``); it needs an NVIDIA driver
  and is run as ``legate script.py``.

Both array modules run the same code: the solvers below only call functions that
NumPy and cuPyNumeric share (``asarray``, ``@``, ``linalg.cholesky``,
``linalg.solve``, ``linalg.eigh``, elementwise arithmetic).  Conversion between
torch and the array module happens at the boundary only: the reduced Gram (primal)
or the Jacobian rows (dual) cross once per iteration, in :meth:`factor`; the
right-hand side crosses in and the step out once per λ.  Everything before
(Jacobian, reduction over slices and ranks) and after (trial points, acceptance)
stays in torch, so the distributed reducers work unchanged.

The solvers mirror :class:`~secondorder.lm.linalg.CholeskySolver` and
:class:`~secondorder.lm.linalg.EighSolver`, primal and dual:

* ``"cholesky"``: per λ, ``L Lᵀ = JᵀJ + λD`` (or ``Js Jsᵀ + λI``) and two
  triangular systems, solved with ``linalg.solve`` since the NumPy API has no
  triangular solver (about 5n³/3 operations per λ where torch needs n³/3).
  cuPyNumeric distributes this factorisation over GPUs.
* ``"eigh"``: one eigendecomposition of the scaled matrix per iteration, then two
  matrix-vector products per λ.  cuPyNumeric runs one matrix's ``eigh`` on one GPU.

cuPyNumeric's Cholesky ends the process when the matrix is not numerically
positive definite, instead of raising.  For an array module that cannot report the
failure, the cholesky solver therefore factors only matrices that a rounding-error
bound proves positive definite (:func:`surely_positive_definite`: the damping
λD is large enough against the Gram's diagonal) and solves the others, at very
small λ, by LU (``linalg.solve``, which raises ``LinAlgError`` for a singular
matrix); a step from a matrix that was not definite after all fails the gain ratio
test and the optimizer raises λ, as after a failed factorisation.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..precision import NATIVE, StepPrecision
from .base import Factorization, LinearSolver
from .record import NormalEquations

__all__ = [
    "BACKEND_SOLVERS",
    "LINALG_BACKENDS",
    "ArrayCholeskySolver",
    "ArrayEighSolver",
    "array_module",
    "surely_positive_definite",
]

LINALG_BACKENDS = ("torch", "numpy", "cupynumeric")
#: Solvers an array-module backend provides (``"auto"`` resolves to ``"cholesky"``).
BACKEND_SOLVERS = ("auto", "cholesky", "eigh")

_INSTALL = {
    "numpy": "pip install numpy",
    "cupynumeric": (
        "pip install 'secondorder[cupynumeric]' (the nvidia-cupynumeric and legate wheels). "
        "cuPyNumeric needs an NVIDIA GPU driver (libcuda.so.1) to import, and scripts "
        "that use it are launched with the `legate` launcher (legate script.py)"
    ),
}


def array_module(name: str) -> ModuleType:
    """The array module of ``linalg_backend=name``; raise a clear error if it cannot load.

    Raises:
        ValueError: ``name`` is not an array-module backend.
        ImportError: the module is not installed or refuses to import (cuPyNumeric
            without an NVIDIA driver); the message says how to install it.
    """
    if name not in ("numpy", "cupynumeric"):
        raise ValueError(
            f"Unknown linalg_backend={name!r} for an array module; valid choices are "
            "('numpy', 'cupynumeric')."
        )
    try:
        return importlib.import_module(name)
    except Exception as exc:  # cuPyNumeric raises more than ImportError without a driver
        raise ImportError(
            f"linalg_backend={name!r} needs the {name} package, which could not be "
            f"imported ({type(exc).__name__}: {exc}). Install it with: {_INSTALL[name]}."
        ) from exc


def surely_positive_definite(gram_diag: Tensor, shift: Tensor, eps: float) -> bool:
    """Whether Cholesky of ``A = G + diag(shift)`` cannot fail, for a Gram matrix G.

    Scale A to unit diagonal, ``H = Δ^-½ A Δ^-½`` with ``Δ = diag(A)``.  Cholesky in
    floating point runs to completion when ``20·k^{3/2}·u·κ₂(H) ≤ 1`` (Demmel's
    bound; k the order, u the unit roundoff).  G is positive semidefinite, so
    ``λ_min(H) ≥ minᵢ shiftᵢ/(Gᵢᵢ + shiftᵢ)``, and ``λ_max(H) ≤ trace(H) = k``; the
    test below asks for twice that margin, for the rounding of G itself.  It is
    sufficient, not necessary: a small shift is often factorable although not
    proven so.  A zero shift is never proven safe.
    """
    k = shift.numel()
    if k == 0:
        return True
    shift = shift.to(torch.float64)
    if not bool((shift > 0).all()) or not bool(torch.isfinite(shift).all()):
        return False
    ratio = shift / (gram_diag.to(torch.float64).clamp(min=0.0) + shift)
    return 40.0 * k**2.5 * eps <= float(ratio.min())


class _Boundary:
    """Conversion between torch tensors and one array module's arrays."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp
        # NumPy raises LinAlgError for a matrix that is not positive definite;
        # cuPyNumeric's Cholesky stops the process instead.
        self.reports_failure = xp.__name__ == "numpy"
        self.errors: tuple[type[BaseException], ...] = (
            getattr(xp.linalg, "LinAlgError", ArithmeticError),
        )

    def to_xp(self, t: Tensor, dtype: torch.dtype) -> Any:
        return self.xp.asarray(t.detach().to(device="cpu", dtype=dtype).numpy())

    def to_torch(self, a: Any, like: Tensor) -> Tensor:
        import numpy as np

        host = np.array(a, copy=True)  # a private, writable host copy of the result
        return torch.from_numpy(host).to(device=like.device, dtype=like.dtype)

    def finite(self, a: Any) -> bool:
        return bool(self.xp.all(self.xp.isfinite(a)))

    def damped_solve(self, m: Any, b: Any, cholesky_safe: bool) -> Any | None:
        """``m⁻¹ b`` for a damped normal matrix ``m``; ``None`` if it is not definite.

        With ``cholesky_safe``: ``m = L Lᵀ`` and a forward and a backward
        substitution (by ``linalg.solve``: the NumPy API has no triangular
        solver).  Otherwise (cuPyNumeric, where a failed Cholesky ends the process,
        and a matrix not proven definite): an LU solve, whose step the gain ratio
        then judges like any other.
        """
        xp = self.xp
        try:
            if cholesky_safe:
                L = xp.linalg.cholesky(m)
                if not self.finite(L):
                    return None
                x = xp.linalg.solve(L.T, xp.linalg.solve(L, b))
            else:
                x = xp.linalg.solve(m, b)
        except self.errors:
            return None
        return x if self.finite(x) else None


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


class _ArrayCholeskyPrimal(Factorization):
    dtype: torch.dtype

    def __init__(self, io: _Boundary, gram: Tensor, d: Tensor) -> None:
        self.io, self.dtype = io, gram.dtype
        self.gram = io.to_xp(gram, gram.dtype)
        self.d = io.to_xp(d, gram.dtype)
        self.gram_diag, self.d_torch = gram.diagonal().clone(), d.clone()

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        io = self.io
        m = self.gram + io.xp.diag(damping * self.d)
        safe = io.reports_failure or surely_positive_definite(
            self.gram_diag, damping * self.d_torch, _eps(self.dtype)
        )
        x = io.damped_solve(m, io.to_xp(b, self.dtype), safe)
        return None if x is None else io.to_torch(x, b)


class _ArrayCholeskyDual(Factorization):
    """``δ = D^-½ Jsᵀ (Js Jsᵀ + λI)⁻¹ w`` with ``Js = J D^-½``, on the array module."""

    dtype: torch.dtype

    def __init__(self, io: _Boundary, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        self.io, self.dtype = io, dtype
        xp = io.xp
        self.inv_sqrt_d = 1.0 / xp.sqrt(io.to_xp(d, dtype))
        self.js = io.to_xp(jac, dtype) * self.inv_sqrt_d
        self.k = self.js @ self.js.T
        self.eye = xp.eye(self.k.shape[0], dtype=self.k.dtype)
        # diag(Js Jsᵀ), in torch, for the positive-definiteness test.
        self.k_diag = (jac.to(torch.float64) ** 2 / d.to(torch.float64)).sum(1)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        if w is None:
            raise RuntimeError("the dual cholesky solver needs the residual-space vector w")
        io = self.io
        safe = io.reports_failure or surely_positive_definite(
            self.k_diag, torch.full_like(self.k_diag, damping), _eps(self.dtype)
        )
        y = io.damped_solve(self.k + damping * self.eye, io.to_xp(w, self.dtype), safe)
        return None if y is None else io.to_torch(self.inv_sqrt_d * (self.js.T @ y), b)


class _ArrayEighPrimal(Factorization):
    """``D^-½ G D^-½ = QΛQᵀ`` once; ``δ = D^-½ Q (Λ + λ)⁻¹ Qᵀ D^-½ b`` per λ."""

    dtype: torch.dtype

    def __init__(self, io: _Boundary, gram: Tensor, d: Tensor) -> None:
        xp = io.xp
        self.io, self.dtype = io, gram.dtype
        self.inv_sqrt_d = 1.0 / xp.sqrt(io.to_xp(d, gram.dtype))
        s = io.to_xp(gram, gram.dtype) * self.inv_sqrt_d[:, None] * self.inv_sqrt_d[None, :]
        evals, self.q = xp.linalg.eigh(s)
        # Round-off can make eigenvalues of a semidefinite matrix slightly negative.
        self.evals = xp.maximum(evals, 0.0)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        denom = self.evals + damping
        if not bool(self.io.xp.all(denom > 0)):
            return None  # singular without damping (torch's solver yields inf here)
        c = self.q.T @ (self.inv_sqrt_d * self.io.to_xp(b, self.dtype))
        return self.io.to_torch(self.inv_sqrt_d * (self.q @ (c / denom)), b)


class _ArrayEighDual(Factorization):
    """``Js Jsᵀ = UΛUᵀ`` once; ``δ = D^-½ Jsᵀ U (Λ + λ)⁻¹ Uᵀ w`` per λ."""

    dtype: torch.dtype

    def __init__(self, io: _Boundary, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        xp = io.xp
        self.io, self.dtype = io, dtype
        self.inv_sqrt_d = 1.0 / xp.sqrt(io.to_xp(d, dtype))
        self.js = io.to_xp(jac, dtype) * self.inv_sqrt_d
        evals, self.u = xp.linalg.eigh(self.js @ self.js.T)
        self.evals = xp.maximum(evals, 0.0)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        if w is None:
            raise RuntimeError("the dual eigh solver needs the residual-space vector w")
        denom = self.evals + damping
        if not bool(self.io.xp.all(denom > 0)):
            return None
        u = self.u
        y = u @ ((u.T @ self.io.to_xp(w, self.dtype)) / denom)
        return self.io.to_torch(self.inv_sqrt_d * (self.js.T @ y), b)


class _ArraySolver(LinearSolver):
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.io = _Boundary(array_module(backend))

    def _parts(self, system: NormalEquations) -> tuple[Tensor | None, Tensor | None]:
        if system.dual:
            if system.jac is None:
                raise RuntimeError(f"the dual {self.name} solver needs the Jacobian")
            return None, system.jac
        if system.gram is None:
            raise RuntimeError(f"the primal {self.name} solver needs the Gram matrix")
        return system.gram, None


class ArrayCholeskySolver(_ArraySolver):
    """Cholesky of the damped normal matrix per λ, on NumPy or cuPyNumeric.

    Primal: ``JᵀJ + λD`` (n×n); dual: ``Js Jsᵀ + λI`` (m×m) with ``Js = J D^-½``.
    The same equations as :class:`~secondorder.lm.linalg.CholeskySolver`; choose it with
    ``linalg_backend="cupynumeric"`` when that matrix should be factored across GPUs.
    """

    name = "cholesky"

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        gram, jac = self._parts(system)
        if jac is not None:
            return _ArrayCholeskyDual(self.io, jac, d, precision.dtype or jac.dtype)
        assert gram is not None
        return _ArrayCholeskyPrimal(self.io, gram, d)


class ArrayEighSolver(_ArraySolver):
    """One eigendecomposition per iteration on NumPy or cuPyNumeric; retries are O(n²).

    The same equations as :class:`~secondorder.lm.linalg.EighSolver`: the best choice
    when many λ retries are expected, and the only one that never factors an
    indefinite matrix.
    """

    name = "eigh"

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        gram, jac = self._parts(system)
        if jac is not None:
            return _ArrayEighDual(self.io, jac, d, precision.dtype or jac.dtype)
        assert gram is not None
        return _ArrayEighPrimal(self.io, gram, d)
