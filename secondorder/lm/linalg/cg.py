"""Matrix-free preconditioned conjugate gradients on ``JᵀJ + λD`` (``solver="cg"``).

Nothing is factored: each solve iterates with products ``Jᵀ(Jv)``, preconditioned by
the Jacobi diagonal ``1/(diag(JᵀJ) + λD)`` or, with ``cg_preconditioner="kfac"``, by the
Kronecker-factored blocks of :mod:`secondorder.lm.kfac_cg`.  Where the batch is shared
by several processes, each keeps its own rows of J and every product ``Jᵀ(Jv)`` is
summed through the record's reducer (one all-reduce of n numbers per iteration; on
one process the reducer is the identity): no n×n matrix exists anywhere, and the
iterates, built from summed quantities only, are the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..kfac_cg import CG_PRECONDITIONERS, KroneckerPreconditioner
from ..precision import NATIVE, StepPrecision
from .base import Factorization, LinearSolver
from .record import NormalEquations

__all__ = ["CGFactorization", "CGSolver"]


@dataclass
class CGFactorization(Factorization):
    """CG "factorisation": nothing is factored; each solve iterates on ``(JᵀJ + λD)v = b``.

    ``kronecker``, when given, replaces the Jacobi preconditioner: its eigenbases were
    computed once, and every λ reuses them.
    """

    system: NormalEquations
    d: Tensor
    rtol: float
    max_iter: int
    iterations: int = field(default=0)
    kronecker: KroneckerPreconditioner | None = None

    def _preconditioner(self, damping: float) -> Callable[[Tensor], Tensor]:
        """``v ↦ M⁻¹v`` at λ = ``damping``: Jacobi, or K-FAC where configured."""
        kron = self.kronecker
        if kron is not None:
            return lambda res: kron.apply(damping, res)
        precond = 1.0 / (self.system.col_sq + damping * self.d)
        return lambda res: precond * res

    def _matvec(self, v: Tensor, damping: float) -> Tensor:
        s = self.system
        if s.gram is not None:
            jtjv = s.gram @ v
        else:
            assert s.jac is not None
            jtjv = s.jac.T @ (s.jac @ v)
            # Σ_k J_kᵀ(J_k v) over the participants' rows (the identity on one process).
            s.reducer.sum_([jtjv])
        return jtjv + damping * self.d * v

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        """Preconditioned CG from zero; stops at ``‖res‖ ≤ rtol·‖b‖``."""
        precond = self._preconditioner(damping)
        x = torch.zeros_like(b)
        res = b.clone()
        z = precond(res)
        p = z.clone()
        rz = torch.dot(res, z)
        target = self.rtol * float(torch.linalg.vector_norm(b))
        self.iterations = 0
        for _ in range(self.max_iter):
            if float(torch.linalg.vector_norm(res)) <= target:
                break
            ap = self._matvec(p, damping)
            pap = torch.dot(p, ap)
            if not bool(pap > 0):
                break
            alpha = rz / pap
            x = x + alpha * p
            res = res - alpha * ap
            z = precond(res)
            rz_new = torch.dot(res, z)
            p = z + (rz_new / rz) * p
            rz = rz_new
            self.iterations += 1
        return x


class CGSolver(LinearSolver):
    """Matrix-free preconditioned conjugate gradients on ``JᵀJ + λD``.

    Each iteration costs one product with J and one with Jᵀ; the Jacobi
    preconditioner is ``1/(diag(JᵀJ) + λD)``, from the squared column norms of J
    that linearisation already summed.  Iterates until the relative residual
    ``‖(JᵀJ + λD)δ - b‖ / ‖b‖`` falls below the tolerance or ``max_iter`` iterations
    (default: n) are spent.

    The tolerance is ``rtol``, or with ``forcing = η_max`` the inexact-Newton
    forcing term::

        η = max(rtol, min(η_max, √γ)),    γ = ‖Jᵀr‖ / (‖J‖_F·‖r‖) ∈ [0, 1].

    γ is a scale-free size of the gradient (0 at a stationary point; at most 1 by
    Cauchy-Schwarz).  Far from a minimum, where the linear model is poor anyway, CG
    stops after a few iterations; near one, η shrinks like the square root of the
    gradient, the forcing sequence ``min(½, √‖∇f‖)`` of truncated Newton-CG made
    independent of the problem's scale, which keeps superlinear local convergence
    where Gauss-Newton has it (small residuals).  Any δ that CG returns from a
    zero start is a descent direction, and the gain ratio judges it with the exact
    model reduction ``-2gᵀδ - ‖Jδ‖²``, so an inexact step is never accepted on a
    false promise.  Choose a forcing term when CG iterations dominate the step
    time; ``η_max = 0.5`` is a common choice.

    ``preconditioner="kfac"`` preconditions each ``nn.Linear`` block by its
    Kronecker-factored Gauss-Newton approximation ``G ⊗ A`` plus damping
    (:mod:`secondorder.lm.kfac_cg`), the rest by Jacobi; the record must then carry
    the factors (``needs_kronecker``), which the LM problem computes in ``linearize``.
    """

    name = "cg"
    needs_jacobian = True
    row_shards = True
    forms_matrix = False

    def __init__(
        self,
        rtol: float = 1e-6,
        max_iter: int | None = None,
        forcing: float | None = None,
        preconditioner: str = "jacobi",
    ) -> None:
        if preconditioner not in CG_PRECONDITIONERS:
            raise ValueError(
                f"Unknown cg_preconditioner={preconditioner!r}; valid choices are "
                f"{CG_PRECONDITIONERS}."
            )
        self.rtol = rtol
        self.max_iter = max_iter
        self.forcing = forcing
        self.preconditioner = preconditioner
        #: Whether ``factor`` needs the record's K-FAC factors.
        self.needs_kronecker = preconditioner == "kfac"

    def kronecker(self, system: NormalEquations, d: Tensor) -> KroneckerPreconditioner | None:
        """The K-FAC preconditioner of ``system`` (``None`` under Jacobi)."""
        if not self.needs_kronecker:
            return None
        if system.kronecker is None:
            raise RuntimeError("cg_preconditioner='kfac' needs the record's Kronecker factors")
        return KroneckerPreconditioner(system.kronecker, d, system.col_sq)

    def tolerance(self, system: NormalEquations) -> float:
        """The relative residual at which CG stops for ``system`` (see the class)."""
        if self.forcing is None:
            return self.rtol
        gnorm = float(torch.linalg.vector_norm(system.grad.to(torch.float64)))
        jnorm = math.sqrt(max(float(system.col_sq.to(torch.float64).sum()), 0.0))
        rnorm = math.sqrt(max(float(system.loss_sum), 0.0))
        gamma = gnorm / (jnorm * rnorm) if jnorm > 0 and rnorm > 0 else 0.0
        if not math.isfinite(gamma):
            return self.rtol
        return max(self.rtol, min(self.forcing, math.sqrt(min(gamma, 1.0))))

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        if system.dual:
            raise RuntimeError("the cg solver works on the primal form")
        max_iter = self.max_iter if self.max_iter is not None else max(1, system.n)
        # The forcing term and the K-FAC factors are built from summed quantities:
        # every participant stops alike and builds the same M⁻¹.
        d = d.to(system.grad.dtype)
        kron = self.kronecker(system, d)
        return CGFactorization(system, d, self.tolerance(system), max_iter, kronecker=kron)
