"""The dtype of the normal matrix, chosen per iteration from the damping.

A float32 product ``JᵀJ`` costs less than half a float64 one, but it rounds every
entry.  How much that rounding matters depends on λ.  In the units of the damping
matrix (``S = D^-½ JᵀJ D^-½`` with ``D ≥ diag(JᵀJ)``, so ``diag(S) ≤ 1``) the damped
matrix is ``S + λI``, whose smallest eigenvalue is at least λ.  A perturbation ``E``
of ``S`` moves the solution of ``(S + λI) z = b`` by at most about ``‖E‖₂ / λ``
relative to ``z``.  The rounding error of a float32 accumulation over ``k`` terms
behaves like ``‖E‖₂ ≈ u·√k`` in these units (``u = 2⁻²⁴``): measured at the
benchmark's sinc problems, 4.5e-6 against the estimate 8.4e-6 for 20,000 × 193 and
8e-6 to 1.6e-5 against 9.4e-6 for 25,000 × 769.  So while λ is large the float32
matrix gives the same step to a fraction of a percent, and only when λ falls toward
Gauss-Newton do its lost digits show (sinc on 20,000 points: relative step error
1e-3 at λ = 1e-3, 5e-2 at 1e-5, above 1 at 1e-6).

:class:`GramPrecision` turns that into a rule.  With ``gram_dtype="auto"`` (the
default) and float32 parameters it uses float32 when the estimated error is at most
``tol`` times λ, and float64 otherwise:

* primal form, ``JᵀJ`` (n×n) summed over ``m`` residual rows:
  ``ε = u·√m`` (the diagonal of ``S`` is at most 1);
* dual form, ``J D⁻¹ Jᵀ`` (m×m) summed over ``n`` columns, whose diagonal is not
  bounded by 1: ``ε = u·√n·s`` with ``s`` its mean diagonal entry, the trace over
  ``m``, which with ``D = diag(JᵀJ)`` is the number of nonzero columns over ``m``.
  It is read from the device together with the loss, so the choice adds no
  synchronisation.  Measured on the benchmark's digits problems: ``‖E‖₂`` 1.5e-4 to
  2.9e-4 against the estimate 1.0e-3 to 1.1e-3 (128 × 19,210), 1.1e-5 to 1.4e-5
  against 2.4e-5 to 2.6e-5 (256 × 2,410): conservative by 2-7x, where the largest
  diagonal entry in place of the mean would be 15-40x.

In the dual form λ is not the only bound: ``λ_min(K + λI) = λ + λ_min(K)``, and with
independent rows ``λ_min(K)`` is far above the rounding.  When λ alone asks for
float64, the dual Cholesky solver first forms K in float32 and keeps it when
:func:`certified_floor` of that matrix makes :meth:`GramPrecision.choose_dual` say
float32 (:class:`DualFloorCheck`; three m×m factorisations, ~0.1 ms each at
m = 128); otherwise it forms K in float64 as asked.

The rule needs ``D ≥ diag(JᵀJ)``, which holds for the ``"marquardt"`` and ``"more"``
damping matrices; with ``"identity"`` λ carries the units of ``JᵀJ`` and ``"auto"``
keeps float64.  Parameters in float64 (or any dtype other than float32) also keep
float64: the saving exists only when the model's own arithmetic is float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DualFloorCheck", "GramPrecision", "certified_floor"]

_U32 = float(torch.finfo(torch.float32).eps) / 2.0


@dataclass(frozen=True)
class GramPrecision:
    """Which dtype the Gram (or ``JD⁻¹Jᵀ``) and its factorisation use this iteration.

    Attributes:
        requested: ``"auto"``, a dtype, or ``None`` (the parameters' dtype).
        tol: under ``"auto"``, the largest estimated relative error of the solve,
            ``ε / λ``, that float32 may introduce.
        damping_matrix: name of the damping matrix; ``"auto"`` applies only where
            ``D ≥ diag(JᵀJ)``.
    """

    requested: torch.dtype | str | None
    tol: float = 0.1
    damping_matrix: str = "marquardt"

    @property
    def adaptive(self) -> bool:
        """Whether the dtype can change from one iteration to the next."""
        return self.requested == "auto" and self.damping_matrix != "identity"

    def varies(self, param_dtype: torch.dtype) -> bool:
        """Whether the choice depends on λ (and, in the dual form, on the scale of J)."""
        return self.fixed(param_dtype) is None

    def fixed(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype when it does not depend on λ, else ``None``."""
        if self.requested is None:
            return param_dtype
        if isinstance(self.requested, torch.dtype):
            return self.requested
        if not self.adaptive or param_dtype != torch.float32:
            return torch.float64
        return None

    @staticmethod
    def error_estimate(terms: int, scale: float = 1.0) -> float:
        """``u·√terms·scale``: the float32 rounding error of the scaled normal matrix."""
        return _U32 * math.sqrt(max(terms, 1)) * scale

    def choose(
        self, param_dtype: torch.dtype, damping: float, terms: int, scale: float = 1.0
    ) -> torch.dtype:
        """The dtype for an iteration whose first attempt uses damping ``damping``.

        ``terms``: the length of the sums forming each entry (residual rows in the
        primal form, parameters in the dual form); ``scale``: the mean diagonal
        entry of the scaled normal matrix (1 in the primal form).  Later attempts of
        the same iteration only raise λ, so the choice holds for all of them.
        """
        fixed = self.fixed(param_dtype)
        if fixed is not None:
            return fixed
        if not (math.isfinite(scale) and math.isfinite(damping)):
            return torch.float64
        eps = self.error_estimate(terms, scale)
        return torch.float32 if eps <= self.tol * damping else torch.float64

    def choose_dual(
        self, param_dtype: torch.dtype, damping: float, terms: int, scale: float, floor: float
    ) -> torch.dtype:
        """:meth:`choose` for the dual form, given a certified ``floor`` of ``λ_min(JD⁻¹Jᵀ)``.

        The float32 solve of ``(K + λI) y = w`` moves by about ``ε / λ_min(K + λI)``
        relative to ``y``, and ``λ_min(K + λI) = λ + λ_min(K) ≥ λ + floor``: with
        independent rows the floor, not λ, bounds the error (measured on wide_dual:
        float32 steps within 4e-6 of float64 at every λ from 1e-4 to 0.1, where ``ε/λ``
        reaches 11).  ``floor`` comes from :func:`certified_floor`; 0 gives :meth:`choose`.
        """
        fixed = self.fixed(param_dtype)
        if fixed is not None:
            return fixed
        values = (scale, damping, floor)
        if not all(math.isfinite(v) for v in values) or floor < 0:
            return torch.float64
        eps = self.error_estimate(terms, scale)
        return torch.float32 if eps <= self.tol * (damping + floor) else torch.float64


def certified_floor(k: Tensor, eps: float, tries: int = 3) -> float:
    """A lower bound on ``λ_min(K)`` from a computed ``K̂`` with ``‖K̂ − K‖₂ ≤ eps``.

    Weyl's inequality gives ``λ_min(K) ≥ λ_min(K̂) − eps``, and a Cholesky
    factorisation of ``K̂ − (μ + eps + δ)I`` in float64 that succeeds shows
    ``λ_min(K̂) > μ + eps`` (``δ = m·u₆₄·trace`` covers the factorisation's own
    rounding), so ``λ_min(K) > μ``.  Candidates ``μ = t·4⁻ʲ`` (``t`` the mean diagonal
    entry, j = 1..8) are searched by bisection in ``tries`` factorisations of the
    m × m matrix (m³/3 flops each: ~0.1 ms at m = 128); 0.0 when none succeeds.
    """
    m = k.shape[0]
    if m == 0 or not math.isfinite(eps):
        return 0.0
    k64 = k.to(torch.float64)
    trace = float(k64.diagonal().sum())
    if not math.isfinite(trace) or trace <= 0:
        return 0.0
    mean = trace / m
    slack = eps + m * float(torch.finfo(torch.float64).eps) * trace
    lo, hi = 9, 1  # exponents: 4^-9 stands for "nothing certified"
    best = 0.0
    for _ in range(tries):
        if hi >= lo:
            break
        j = (lo + hi) // 2
        mu = mean * 4.0**-j
        shifted = k64.clone()
        shifted.diagonal().sub_(mu + slack)
        if int(torch.linalg.cholesky_ex(shifted)[1]) == 0:
            best, lo = mu, j  # certified: try a larger μ (smaller j)
        else:
            hi = j + 1
    return best


@dataclass(frozen=True)
class DualFloorCheck:
    """Whether a float32 dual matrix is accurate enough, judged on the matrix itself.

    Set on the dual Cholesky solver for one iteration when :meth:`GramPrecision.choose`
    asked for float64 from λ alone: the solver then forms ``K̂ = J D⁻¹ Jᵀ`` in float32
    (no wider copy of J), and keeps it when :func:`certified_floor` of ``K̂`` makes
    :meth:`GramPrecision.choose_dual` say float32; otherwise it forms K in float64 as
    asked.  With independent rows (the usual case of a wide network on a mini-batch)
    the floor, not λ, bounds the error, so the float32 product, about half the
    float64 one's cost, is kept even as λ falls toward Gauss-Newton.

    Attributes:
        precision: the configuration's rule (its ``tol``).
        damping: λ of the iteration's first attempt (later attempts only raise it).
        terms: the length of each entry's sum, the number of parameters.
        scale: the mean diagonal entry of ``J D⁻¹ Jᵀ`` (NormalEquations.dual_scale).
    """

    precision: GramPrecision
    damping: float
    terms: int
    scale: float

    def float32_suffices(self, k32: Tensor) -> bool:
        """Whether ``k32`` (the float32 ``K̂``) may be used in place of the float64 K."""
        eps = self.precision.error_estimate(self.terms, self.scale)
        floor = certified_floor(k32, eps)
        chosen = self.precision.choose_dual(
            torch.float32, self.damping, self.terms, self.scale, floor
        )
        return chosen == torch.float32
