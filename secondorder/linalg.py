"""Linear algebra of one LM iteration: the normal-equation record and its solvers.

Every solver answers the same question for a given λ and damping diagonal ``D``:

    δ = (JᵀJ + λD)⁻¹ b,        b = Jᵀw,

where the LM step uses ``w = -r`` and geodesic acceleration uses ``w = -r''``.  Each
solver splits the work into :meth:`LinearSolver.factor`, done once per iteration, and
:meth:`Factorization.solve`, done for every λ an iteration tries, so that a rejected
attempt costs a solve rather than a new factorisation wherever the method allows it.

Which solver to choose:

* ``"cholesky"``: factor ``JᵀJ + λD`` (primal, n×n) or ``J D⁻¹Jᵀ + λI`` (dual, m×m)
  for each λ.  The fastest for moderate sizes; a failed factorisation (an indefinite
  matrix in finite precision) is reported, and the optimizer raises λ instead of
  throwing.
* ``"eigh"``: one symmetric eigendecomposition of the scaled normal matrix per
  iteration; every retry with a new λ then costs two matrix-vector products.  The
  best choice when many retries are expected, and the most robust in float32.
* ``"qr"``: a QR factorisation of J itself, never of ``JᵀJ``, so the condition number
  is that of J rather than its square (MINPACK's method); needs J stored.  For each λ,
  a QR of the small stacked matrix ``[R; √λ·D^½]``.
* ``"cg"``: matrix-free conjugate gradients with a Jacobi preconditioner, using only
  products with J and Jᵀ; for parameter counts whose n×n Gram does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "SOLVERS",
    "CGSolver",
    "CholeskySolver",
    "EighSolver",
    "Factorization",
    "LinearSolver",
    "NormalEquations",
    "QRSolver",
    "make_solver",
]


@dataclass
class NormalEquations:
    """The record an LM iteration shares between its stages.

    Built from the Jacobian slices of one batch and already reduced over slices,
    devices and processes.  ``jac`` and ``residuals`` are kept only when the form or
    the solver needs J itself (the dual form, QR, CG); otherwise only the n×n ``gram``
    and the vectors survive, and J was never held whole.

    Attributes:
        loss_sum: ``Σ r²`` over every residual entry (a 0-d tensor).
        count: number of residual entries.
        grad: ``Jᵀr``.
        col_sq: ``diag(JᵀJ)``, the squared column norms of J.
        gram: ``JᵀJ`` (primal form with a factorising solver), else ``None``.
        jac: J, rows of this process (dual form, QR, CG), else ``None``.
        residuals: ``r`` matching ``jac``'s rows, else ``None``.
        dual: whether the solve works with ``J D⁻¹ Jᵀ`` (m×m) rather than ``JᵀJ``.
        scale_sq: squared column norms the damping matrix is built from, when they
            differ from ``col_sq`` (robust losses rescale J's rows; the trust region
            stays in the units of the unscaled problem).  ``None``: use ``col_sq``.
    """

    loss_sum: Tensor
    count: int
    grad: Tensor
    col_sq: Tensor
    gram: Tensor | None = None
    jac: Tensor | None = None
    residuals: Tensor | None = None
    dual: bool = False
    scale_sq: Tensor | None = None

    @property
    def n(self) -> int:
        """Number of parameters."""
        return self.grad.numel()

    def curvature(self, delta: Tensor) -> Tensor:
        """``‖Jδ‖² = δᵀJᵀJδ``, the curvature of the linear model along ``delta``."""
        if self.gram is not None:
            d = delta.to(self.gram.dtype)
            return torch.dot(d, self.gram @ d)
        if self.jac is None:
            raise RuntimeError("NormalEquations holds neither gram nor jac")
        jd = self.jac @ delta.to(self.jac.dtype)
        return torch.dot(jd, jd)


class Factorization:
    """The reusable part of a solve for one iteration; :meth:`solve` runs per λ."""

    #: Conjugate-gradient iterations spent by the last :meth:`solve` (0 for direct solvers).
    iterations: int = 0

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        """Return ``(JᵀJ + λD)⁻¹ b`` with ``b = Jᵀw``, or ``None`` if it failed.

        ``w`` is required by the solvers that work on J directly (dual form, QR).
        A ``None`` result tells the optimizer to raise λ and try again.
        """
        raise NotImplementedError


class LinearSolver:
    """Base class of the solvers: a name and a :meth:`factor` method."""

    name = ""
    #: Whether this solver needs J itself (not only ``JᵀJ``) in the primal form.
    needs_jacobian = False

    def factor(self, system: NormalEquations, d: Tensor) -> Factorization:
        """Prepare the solves of one iteration for damping diagonal ``d``."""
        raise NotImplementedError


def _finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _require_w(w: Tensor | None, solver: str) -> Tensor:
    if w is None:
        raise RuntimeError(f"the {solver} solver needs the residual-space vector w")
    return w


# ---------------------------------------------------------------------------------------
# Cholesky


class _CholeskyPrimal(Factorization):
    def __init__(self, gram: Tensor, d: Tensor) -> None:
        self.gram = gram
        self.d = d.to(gram.dtype)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        m = self.gram + torch.diag(damping * self.d)
        L, info = torch.linalg.cholesky_ex(m)
        if int(info) != 0:
            return None
        return torch.cholesky_solve(b.to(m.dtype).unsqueeze(-1), L).squeeze(-1)


class _CholeskyDual(Factorization):
    """``δ = D^-½ Jsᵀ (Js Jsᵀ + λI)⁻¹ w`` with ``Js = J D^-½`` (push-through identity)."""

    def __init__(self, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        self.inv_sqrt_d = d.to(dtype).rsqrt()
        self.js = jac.to(dtype) * self.inv_sqrt_d
        self.k = self.js @ self.js.T

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        w = _require_w(w, "dual cholesky")
        m = self.k + damping * torch.eye(self.k.shape[0], dtype=self.k.dtype, device=self.k.device)
        L, info = torch.linalg.cholesky_ex(m)
        if int(info) != 0:
            return None
        y = torch.cholesky_solve(w.to(m.dtype).unsqueeze(-1), L).squeeze(-1)
        return self.inv_sqrt_d * (self.js.T @ y)


class CholeskySolver(LinearSolver):
    """Cholesky factorisation of the damped normal matrix, once per λ.

    Primal: ``JᵀJ + λD`` (n×n).  Dual (fewer residuals than parameters):
    ``Js Jsᵀ + λI`` (m×m) with ``Js = J D^-½``, then ``δ = D^-½ Jsᵀ y``.
    """

    name = "cholesky"

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    def factor(self, system: NormalEquations, d: Tensor) -> Factorization:  # noqa: D102
        if system.dual:
            assert system.jac is not None
            return _CholeskyDual(system.jac, d, self.dtype or system.jac.dtype)
        if system.gram is None:
            raise RuntimeError("the primal cholesky solver needs the Gram matrix")
        return _CholeskyPrimal(system.gram, d)


# ---------------------------------------------------------------------------------------
# Eigendecomposition


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
        self.inv_sqrt_d = d.to(dtype).rsqrt()
        self.js = jac.to(dtype) * self.inv_sqrt_d
        evals, self.u = torch.linalg.eigh(self.js @ self.js.T)
        self.evals = torch.clamp(evals, min=0.0)

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        w = _require_w(w, "dual eigh")
        y = self.u @ ((self.u.T @ w.to(self.u.dtype)) / (self.evals + damping))
        return self.inv_sqrt_d * (self.js.T @ y)


class EighSolver(LinearSolver):
    """Factor once per iteration by a symmetric eigendecomposition; retries are O(n²)."""

    name = "eigh"

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    def factor(self, system: NormalEquations, d: Tensor) -> Factorization:  # noqa: D102
        if system.dual:
            assert system.jac is not None
            return _EighDual(system.jac, d, self.dtype or system.jac.dtype)
        if system.gram is None:
            raise RuntimeError("the primal eigh solver needs the Gram matrix")
        return _EighPrimal(system.gram, d)


# ---------------------------------------------------------------------------------------
# QR


class _QR(Factorization):
    """Solve ``min ‖[R0; √λ·D^½] δ - [Q0ᵀw; 0]‖`` where ``J = Q0 R0``.

    ``[J; √λD^½]`` and ``[R0; √λD^½]`` have the same normal matrix, so the per-λ QR
    runs on a ``(min(m, n) + n) × n`` matrix however many residuals there are.
    """

    def __init__(self, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        j = jac.to(dtype)
        self.sqrt_d = d.to(dtype).sqrt()
        if j.shape[0] > j.shape[1]:
            self.q0, self.r0 = torch.linalg.qr(j, mode="reduced")
        else:
            self.q0, self.r0 = None, j

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        w = _require_w(w, "qr")
        w = w.to(self.r0.dtype)
        if damping == 0.0 and self.r0.shape[0] < self.r0.shape[1]:
            return self._min_norm(w)
        c = self.q0.T @ w if self.q0 is not None else w
        a = torch.cat([self.r0, torch.diag(math.sqrt(damping) * self.sqrt_d)])
        q, r = torch.linalg.qr(a, mode="reduced")
        diag = torch.diagonal(r)
        if not _finite(r) or bool((diag == 0).any()):
            return None
        rhs = q[: c.shape[0]].T @ c
        return torch.linalg.solve_triangular(r, rhs.unsqueeze(-1), upper=True).squeeze(-1)

    def _min_norm(self, w: Tensor) -> Tensor | None:
        """λ = 0 with fewer rows than columns: the solution of ``Jδ = w`` nearest 0.

        ``[J; 0]`` is singular, but the limit λ → 0 of the damped step is the
        minimum-D-norm solution ``D^-½·pinv(J·D^-½)·w``, from a QR of ``(J·D^-½)ᵀ``.
        """
        if not bool((self.sqrt_d > 0).all()):
            return None
        q, r = torch.linalg.qr((self.r0 / self.sqrt_d).T, mode="reduced")
        if not _finite(r) or bool((torch.diagonal(r) == 0).any()):
            return None
        z = torch.linalg.solve_triangular(r.T, w.unsqueeze(-1), upper=False).squeeze(-1)
        return (q @ z) / self.sqrt_d


class QRSolver(LinearSolver):
    """QR of J itself (MINPACK's approach): squares no condition number."""

    name = "qr"
    needs_jacobian = True

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    def factor(self, system: NormalEquations, d: Tensor) -> Factorization:  # noqa: D102
        if system.jac is None:
            raise RuntimeError("the qr solver needs the Jacobian")
        return _QR(system.jac, d, self.dtype or system.jac.dtype)


# ---------------------------------------------------------------------------------------
# Conjugate gradients


@dataclass
class _CG(Factorization):
    system: NormalEquations
    d: Tensor
    rtol: float
    max_iter: int
    iterations: int = field(default=0)

    def _matvec(self, v: Tensor, damping: float) -> Tensor:
        s = self.system
        if s.gram is not None:
            jtjv = s.gram @ v
        else:
            assert s.jac is not None
            jtjv = s.jac.T @ (s.jac @ v)
        return jtjv + damping * self.d * v

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        """Preconditioned CG from zero; stops at ``‖res‖ ≤ rtol·‖b‖``."""
        precond = 1.0 / (self.system.col_sq + damping * self.d)
        x = torch.zeros_like(b)
        res = b.clone()
        z = precond * res
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
            z = precond * res
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
    """

    name = "cg"
    needs_jacobian = True

    def __init__(
        self, rtol: float = 1e-6, max_iter: int | None = None, forcing: float | None = None
    ) -> None:
        self.rtol = rtol
        self.max_iter = max_iter
        self.forcing = forcing

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

    def factor(self, system: NormalEquations, d: Tensor) -> Factorization:  # noqa: D102
        if system.dual:
            raise RuntimeError("the cg solver works on the primal form")
        max_iter = self.max_iter if self.max_iter is not None else max(1, system.n)
        return _CG(system, d.to(system.grad.dtype), self.tolerance(system), max_iter)


SOLVERS = ("auto", "cholesky", "eigh", "qr", "cg")


def make_solver(
    name: str,
    dtype: torch.dtype | None = None,
    cg_rtol: float = 1e-6,
    cg_max_iter: int | None = None,
    cg_forcing: float | None = None,
) -> LinearSolver:
    """Build the solver called ``name``; ``"auto"`` is resolved by the caller."""
    if name == "cholesky":
        return CholeskySolver(dtype)
    if name == "eigh":
        return EighSolver(dtype)
    if name == "qr":
        return QRSolver(dtype)
    if name == "cg":
        return CGSolver(cg_rtol, cg_max_iter, cg_forcing)
    raise ValueError(f"Unknown solver={name!r}; valid choices are {SOLVERS}.")
