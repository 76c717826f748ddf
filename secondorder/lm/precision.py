"""The dtype of the normal matrix, chosen per iteration from the damping.

A float32 product ``JᵀJ`` costs less than half a float64 one, but it rounds every
entry.  How much that rounding matters depends on λ.  In the units of the damping
matrix (``S = D^-½ JᵀJ D^-½`` with ``D ≥ diag(JᵀJ)``, so ``diag(S) ≤ 1``) the damped
matrix is ``S + λI``, whose smallest eigenvalue is at least λ.  A perturbation ``E``
of ``S`` moves the solution of ``(S + λI) z = b`` by at most about ``‖E‖₂ / λ``
relative to ``z``.  The rounding error of a float32 accumulation over ``k`` terms
behaves like ``‖E‖₂ ≈ u·√k`` in these units (``u = 2⁻²⁴``; the benchmark's sinc
problems stay within that estimate).  So while λ is large the float32 matrix gives
the same step to a fraction of a percent, and only when λ falls toward Gauss-Newton
do its lost digits show.

:class:`GramPrecision` turns that into a rule.  With ``gram_dtype="auto"`` (the
default) and float32 parameters it uses float32 when the estimated error is at most
``tol`` times λ, and float64 otherwise:

* primal form, ``JᵀJ`` (n×n) summed over ``m`` residual rows:
  ``ε = u·√m`` (the diagonal of ``S`` is at most 1);
* dual form, ``J D⁻¹ Jᵀ`` (m×m) summed over ``n`` columns, whose diagonal is not
  bounded by 1: ``ε = u·√n·s`` with ``s`` its mean diagonal entry, the trace over
  ``m``, which with ``D = diag(JᵀJ)`` is the number of nonzero columns over ``m``.
  It is read from the device together with the loss, so the choice adds no
  synchronisation.  On the benchmark's digits problems the estimate is conservative
  by a small factor, where the largest diagonal entry in place of the mean would
  overestimate by an order of magnitude more.

Between the two, the primal Gram can be summed in float64 from float32 products of
row chunks (:meth:`GramPrecision.chunk_rows`): a chunk of b rows rounds by about
``u·√b`` of its share, so chunks as large as ``tol·λ`` allows give a float64 Gram at
about the float32 product's cost.  On sinc
the Gram's own smallest eigenvalue is at rounding level (the network's Jacobian is
rank-deficient in these units), so unlike the dual form's no floor helps there.

In the dual form λ is not the only bound, and ``s`` is the wrong unit.  The rounding of
entry ``(i, j)`` of the float32 ``K̂ = J D⁻¹ Jᵀ`` is proportional to the norms of rows i
and j, and on a classifier's mini-batch those norms spread over many orders of
magnitude (a well-classified sample's residual and row are both tiny: a ratio of
1e20 between the largest and smallest row norm on the benchmark's digits CNN).  Scaled
by ``R = diag(K̂ + λI)^½`` the damped matrix ``M = R⁻¹(K + λI)R⁻¹`` has a unit
diagonal, its rounding error is ``‖R⁻¹ E R⁻¹‖₂ ≈ u·√n`` whatever the row norms
(measured at most 1.3·u·√n on the benchmark's digits problems), and the solve's error
relative to ``R y`` is at most that over ``λ_min(M)``, which with independent rows
stays near 1e-2 as λ falls to 1e-12 (the unscaled ``λ_min(K)`` falls to rounding).  This
is the scale invariance of the Cholesky factorisation (van der Sluis' theorem).  When
λ alone asks for float64, the dual Cholesky solver first forms K̂ in float32 and keeps
it when one float64 factorisation proves ``λ_min(M) ≥ ε̃/tol`` (:class:`DualFloorCheck`,
with ``ε̃ = u·(4√n + m)``: four times the measured product error plus the float32
factorisation's own); otherwise it forms K in float64 as asked.

Every bound above assumes float32 products round as float32 does.  Under TF32 (a CUDA
matmul mode: inputs rounded to 10 mantissa bits) they do not, so where
:func:`reduced_float32_products` finds it on, ``"auto"`` forms every normal matrix in
float64, with no float32 chunks or dual check.

The rule needs ``D ≥ diag(JᵀJ)``, which holds for the ``"marquardt"`` and ``"more"``
damping matrices; with ``"identity"`` λ carries the units of ``JᵀJ`` and ``"auto"``
keeps float64.  Parameters in float64 (or any dtype other than float32) also keep
float64: the saving exists only when the model's own arithmetic is float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._lapack import pad_identity

__all__ = [
    "MIN_CHUNK_ROWS",
    "NATIVE",
    "DualFloorCheck",
    "GramPrecision",
    "PrecisionRule",
    "StepPrecision",
    "floor_holds",
    "reduced_float32_products",
]

_U32 = float(torch.finfo(torch.float32).eps) / 2.0
_U64 = float(torch.finfo(torch.float64).eps) / 2.0
_TINY32 = float(torch.finfo(torch.float32).tiny)

#: The fewest rows of a float32 product that a float64 Gram is summed from
#: (:meth:`GramPrecision.chunk_rows`); below it the products cost more than float64.
MIN_CHUNK_ROWS = 512


def reduced_float32_products(devices: Sequence[torch.device]) -> bool:
    """Whether float32 matrix products on any of ``devices`` may run as TensorFloat-32.

    TF32 rounds each input of a CUDA float32 product to 10 mantissa bits (unit
    roundoff 2⁻¹¹ where float32 has 2⁻²⁴), so the float32 error the ``"auto"`` rule
    certifies no longer bounds a float32 normal matrix, nor the float32 row products
    a chunked float64 Gram is summed from.  TF32 is on where torch's newer API says
    ``"tf32"`` for CUDA matmuls (``torch.backends.cuda.matmul.fp32_precision``, else
    the global ``torch.backends.fp32_precision``), or, where that says nothing, where
    the legacy switch allows it (``torch.set_float32_matmul_precision("high")`` or
    ``"medium"``, ``torch.backends.cuda.matmul.allow_tf32 = True``), and wherever torch
    refuses to report that switch.
    """
    if not any(torch.device(d).type == "cuda" for d in devices):
        return False
    backends: Any = torch.backends
    newer = getattr(backends.cuda.matmul, "fp32_precision", "none")
    if newer == "none":
        newer = getattr(backends, "fp32_precision", "none")
    if newer != "none":
        return bool(newer == "tf32")
    # The legacy switches; torch refuses to report them once the two APIs are mixed
    # (a CPU precision set through the newer one, say): then assume the worst.
    try:
        return bool(backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        return True


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

    def chunk_rows(self, param_dtype: torch.dtype, damping: float, rows: int) -> int | None:
        """Rows per float32 product of a float64 primal Gram, or ``None`` (no chunks).

        Where :meth:`choose` refuses float32 over all ``rows`` (``u·√rows > tol·λ``),
        the Gram can still be summed in float64 from float32 products ``JcᵀJc`` of
        row chunks of b rows: each chunk's rounding is about ``u·√b`` of its own
        share of the diagonal, so the sum's is at most ``u·√b``, at about one float32
        product's time.  Returns the largest power-of-two b with ``u·√b ≤ tol·λ``, at least
        :data:`MIN_CHUNK_ROWS`; ``None`` where float32 over all rows suffices, where
        no such b exists, or where the dtype does not vary.
        """
        if self.fixed(param_dtype) is not None or not (math.isfinite(damping) and damping > 0):
            return None
        largest = (self.tol * damping / _U32) ** 2
        if largest >= rows or largest < MIN_CHUNK_ROWS:
            return None
        chunk = MIN_CHUNK_ROWS
        while chunk * 2 <= largest:
            chunk *= 2
        return chunk


def floor_holds(k: Tensor, mu: float, eps: float) -> bool:
    """Whether ``λ_min(K) > mu`` is proven from a computed ``K̂ = k`` with ``‖K̂ − K‖₂ ≤ eps``.

    Weyl's inequality gives ``λ_min(K) ≥ λ_min(K̂) − eps``, and a Cholesky
    factorisation of ``K̂ − (mu + eps + δ)I`` in float64 that succeeds shows
    ``λ_min(K̂) > mu + eps`` (``δ = m·u₆₄·trace`` covers the factorisation's own
    rounding).  One factorisation of the m × m matrix; ``False`` when it fails or
    ``k`` is not finite.
    """
    return _floor_holds_in_place(k.to(torch.float64, copy=True), mu, eps)


def _floor_holds_in_place(k: Tensor, mu: float, eps: float) -> bool:
    """:func:`floor_holds` on a float64 ``k`` the caller gives up (it is overwritten)."""
    m = k.shape[0]
    if m == 0 or not (math.isfinite(eps) and math.isfinite(mu)):
        return False
    trace = float(k.diagonal().sum())
    if not math.isfinite(trace):
        return False
    k.diagonal().sub_(mu + eps + m * _U64 * abs(trace))
    return int(torch.linalg.cholesky_ex(pad_identity(k))[1]) == 0


@dataclass(frozen=True)
class DualFloorCheck:
    """Whether a float32 dual matrix is accurate enough, judged on the matrix itself.

    Set on the dual Cholesky solver for one iteration when :meth:`GramPrecision.choose`
    asked for float64 from λ alone: the solver then forms ``K̂ = J D⁻¹ Jᵀ`` in float32
    (no wider copy of J), scales ``K̂ + λI`` to a unit diagonal (``M̂ = R⁻¹(K̂ + λI)R⁻¹``)
    and keeps the float32 matrix when :func:`floor_holds` proves ``λ_min(M) ≥ ε̃/tol``
    for ``ε̃ = u·(4√n + m)``; otherwise it forms K in float64 as asked.  The solve's
    error relative to ``R y`` is then at most ``ε̃ / λ_min(M) ≤ tol``.  Later attempts
    of the iteration only raise λ, which only raises ``λ_min`` of ``R⁻¹(K + λI)R⁻¹``
    with the same R, so one check holds for the whole iteration.

    Attributes:
        precision: the configuration's rule (its ``tol``).
        damping: λ of the iteration's first attempt.
        terms: the length of each entry's sum, the number of parameters.
    """

    precision: GramPrecision
    damping: float
    terms: int

    def error_estimate(self, rows: int) -> float:
        """``ε̃ = u·(4√terms + rows)``: the rounding of the unit-diagonal float32 system."""
        return _U32 * (4.0 * math.sqrt(max(self.terms, 1)) + rows)

    def float32_suffices(self, k32: Tensor) -> bool:
        """Whether ``k32`` (the float32 ``K̂``) may be used in place of the float64 K."""
        if not (math.isfinite(self.damping) and self.damping >= 0):
            return False
        m = k32.shape[0]
        k = k32.to(torch.float64, copy=True)
        k.diagonal().add_(self.damping)
        diag = k.diagonal()
        # Rows whose squares reach float32's underflow have no relative accuracy left.
        if not bool((diag > self.terms * _TINY32 / _U32).all()):
            return False
        r = diag.rsqrt()
        k.mul_(r[:, None]).mul_(r[None, :])
        eps = self.error_estimate(m)
        # k is this call's own float64 copy: shift and factor it without another.
        return _floor_holds_in_place(k, eps / self.precision.tol, eps)


@dataclass(frozen=True)
class StepPrecision:
    """The precision of one iteration's normal matrix, decided before it is formed.

    Built by :class:`PrecisionRule` and handed to the linearisation (the Gram's dtype
    and chunks) and to :meth:`~secondorder.lm.linalg.LinearSolver.factor`; a solver
    reads it and keeps no dtype of its own.

    Attributes:
        dtype: the dtype the normal matrix is formed and factored in; ``None``: the
            record's own.
        chunk: with a float64 ``dtype`` and a float32 J, the rows of each float32
            product a primal Gram is summed from (:meth:`GramPrecision.chunk_rows`).
        dual_check: in the dual form, when λ alone asked for float64: the check
            that keeps a float32 matrix where it is accurate enough.
    """

    dtype: torch.dtype | None = None
    chunk: int | None = None
    dual_check: DualFloorCheck | None = None


#: The record's own dtype, no chunks and no dual check: a solver's default.
NATIVE = StepPrecision()


class PrecisionRule:
    """The configuration's precision rule for one model: each step's :class:`StepPrecision`.

    ``gram_dtype="auto"`` with float32 parameters chooses per iteration from λ
    (:meth:`primal`, before J is computed; :meth:`dual`, after, from the dual
    matrix's scale); every other setting gives the same fixed dtype every step.
    Where float32 products may run as TF32 on ``devices``
    (:func:`reduced_float32_products`, read at every step: the switch is global),
    ``"auto"`` forms every normal matrix in float64.
    """

    def __init__(
        self,
        gram: GramPrecision,
        param_dtype: torch.dtype,
        devices: Sequence[torch.device],
        parameters: int,
    ) -> None:
        self.gram = gram
        self.param_dtype = param_dtype
        self.devices = tuple(devices)
        self.parameters = parameters

    @property
    def varies(self) -> bool:
        """Whether the dtype is chosen per iteration (``"auto"`` with float32 parameters)."""
        return self.gram.varies(self.param_dtype)

    @property
    def fixed(self) -> torch.dtype | None:
        """The dtype when it does not depend on λ, else ``None``."""
        return self.gram.fixed(self.param_dtype)

    def certified(self) -> bool:
        """Whether float32 products keep float32's rounding where slices are computed."""
        return not reduced_float32_products(self.devices)

    def primal(self, damping: float, rows: int) -> StepPrecision:
        """The primal Gram's precision for an iteration starting at λ = ``damping``."""
        if not self.varies:
            return StepPrecision(self.fixed)
        if not self.certified():
            return StepPrecision(torch.float64)
        dtype = self.gram.choose(self.param_dtype, damping, rows)
        return StepPrecision(dtype, self.gram.chunk_rows(self.param_dtype, damping, rows))

    def dual(self, damping: float, scale: float | None) -> StepPrecision:
        """The dual matrix's precision at λ = ``damping`` and mean diagonal ``scale``.

        ``scale``: :attr:`~secondorder.lm.linalg.NormalEquations.dual_scale` as read with
        the loss (``None`` when it was not measured: float64).
        """
        if not self.varies:
            return StepPrecision(self.fixed)
        scale = math.inf if scale is None else scale
        if not self.certified():
            return StepPrecision(torch.float64)
        dtype = self.gram.choose(self.param_dtype, damping, self.parameters, scale)
        check = None
        if dtype == torch.float64 and math.isfinite(scale) and self.certified():
            # λ alone asks for float64; the float32 matrix may still be exact enough
            # when its rows are independent (checked on the matrix).
            check = DualFloorCheck(self.gram, damping, self.parameters)
        return StepPrecision(dtype, dual_check=check)
