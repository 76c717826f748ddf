"""One symmetric eigendecomposition per iteration (``solver="eigh"``).

Every retry with a new λ then costs two matrix-vector products: the best choice when
many retries are expected, and the most robust in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..precision import NATIVE, StepPrecision
from .base import Factorization, LinearSolver, _require_w, _ScaledRows
from .record import NormalEquations

__all__ = ["EighSolver"]


class _EighPrimal(Factorization):
    """``S = D^-½ G D^-½ = QΛQᵀ`` once; ``δ = D^-½ Q (Λ + λ)⁻¹ Qᵀ D^-½ b`` per λ."""

    def __init__(self, gram: Tensor, d: Tensor) -> None:
        self.inv_sqrt_d = d.to(gram.dtype).rsqrt()
        s = gram * self.inv_sqrt_d[:, None] * self.inv_sqrt_d[None, :]
        evals, self.q = torch.linalg.eigh(s)
        # Round-off can make eigenvalues of a semidefinite matrix slightly negative.
        self.evals = torch.clamp(evals, min=0.0)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        c = self.q.T @ (self.inv_sqrt_d * b.to(self.q.dtype))
        return self.inv_sqrt_d * (self.q @ (c / (self.evals + damping)))


class _EighDual(Factorization):
    """``Js Jsᵀ = UΛUᵀ`` once; ``δ = D^-½ Jsᵀ U (Λ + λ)⁻¹ Uᵀ w`` per λ."""

    def __init__(self, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.rows = _ScaledRows(jac, d, dtype)
        evals, self.u = torch.linalg.eigh(self.rows.k)
        self.evals = torch.clamp(evals, min=0.0)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        w = _require_w(w, "dual eigh")
        y = self.u @ ((self.u.T @ w.to(self.u.dtype)) / (self.evals + damping))
        return self.rows.step(y)

    def image(self) -> Tensor | None:
        return self.rows.image


class EighSolver(LinearSolver):
    """Factor once per iteration by a symmetric eigendecomposition; retries are O(n²)."""

    name = "eigh"

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        if system.dual:
            assert system.jac is not None
            return _EighDual(system.jac, d, precision.dtype or system.jac.dtype)
        if system.gram is None:
            raise RuntimeError("the primal eigh solver needs the Gram matrix")
        return _EighPrimal(system.gram, d)
