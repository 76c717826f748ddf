"""Cholesky factorisation of the damped normal matrix, once per λ (``solver="cholesky"``).

The fastest solver for moderate sizes.  A failed factorisation (an indefinite matrix
in finite precision) is reported, and the engine raises λ instead of throwing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._lapack import shifted_cholesky_solve
from ..precision import NATIVE, StepPrecision
from .base import Factorization, LinearSolver, _nan_unless, _OuterRows, _require_w, _ScaledRows
from .record import NormalEquations

__all__ = ["CholeskySolver"]


class _CholeskyPrimal(Factorization):
    def __init__(self, gram: Tensor, d: Tensor) -> None:
        self.gram = gram
        self.d = d.to(gram.dtype)

    def _solve(self, damping: float, b: Tensor) -> tuple[Tensor, Tensor]:
        return shifted_cholesky_solve(self.gram, damping * self.d, b)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        x, info = self._solve(damping, b)
        return None if int(info) != 0 else x

    def solve_unchecked(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        return _nan_unless(*self._solve(damping, b))


class _CholeskyDual(Factorization):
    """``δ = D^-½ Jsᵀ (Js Jsᵀ + λI)⁻¹ w`` with ``Js = J D^-½`` (push-through identity).

    With ``outer`` (``J Jᵀ`` in ``dtype``, given when ``D = d₀I``) no ``Js`` is formed.
    """

    def __init__(
        self, jac: Tensor, d: Tensor, dtype: torch.dtype, outer: Tensor | None = None
    ) -> None:
        self.dtype = dtype
        self.rows: _ScaledRows | _OuterRows
        if outer is None:
            self.rows = _ScaledRows(jac, d, dtype)
        else:
            self.rows = _OuterRows(jac, d[0], outer)
        self.k = self.rows.k

    def _solve(self, damping: float, w: Tensor | None) -> tuple[Tensor, Tensor]:
        w = _require_w(w, "dual cholesky")
        y, info = shifted_cholesky_solve(self.k, damping, w)
        return self.rows.step(y), info

    def image(self) -> Tensor | None:
        return self.rows.image

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        x, info = self._solve(damping, w)
        return None if int(info) != 0 else x

    def solve_unchecked(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        return _nan_unless(*self._solve(damping, w))


class CholeskySolver(LinearSolver):
    """Cholesky factorisation of the damped normal matrix, once per λ.

    Primal: ``JᵀJ + λD`` (n×n).  Dual (fewer residuals than parameters):
    ``Js Jsᵀ + λI`` (m×m) with ``Js = J D^-½``, then ``δ = D^-½ Jsᵀ y``; with
    ``D = d₀I`` (``uniform``) and the system's ``factor_gram``, ``J Jᵀ/d₀`` from the
    layers' factors.
    """

    name = "cholesky"

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        if system.dual:
            assert system.jac is not None
            jac = system.jac
            dtype = precision.dtype or jac.dtype
            if system.factor_gram is not None and uniform:
                # D = d₀I: J D⁻¹Jᵀ = J Jᵀ/d₀ from the layers' factors, cheap in any
                # dtype, so the float32 attempt behind the dual check would save nothing.
                return _CholeskyDual(jac, d, dtype, system.factor_gram(dtype))
            check = precision.dual_check
            if check is not None and dtype == torch.float64 and jac.dtype == torch.float32:
                # λ alone asked for float64: a float32 matrix is kept where the check
                # proves it accurate enough (the factorisation's dtype then says so).
                narrow = _CholeskyDual(jac, d, torch.float32)
                if check.float32_suffices(narrow.k):
                    return narrow
            return _CholeskyDual(jac, d, dtype)
        if system.gram is None:
            raise RuntimeError("the primal cholesky solver needs the Gram matrix")
        return _CholeskyPrimal(system.gram, d)
