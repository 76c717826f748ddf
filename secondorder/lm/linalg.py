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
  products with J and Jᵀ; for parameter counts whose n×n Gram does not fit.  With
  ``preconditioner="kfac"`` the ``nn.Linear`` blocks are preconditioned by their
  Kronecker-factored Gauss-Newton approximation (:mod:`secondorder.lm.kfac_cg`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .._lapack import shifted_cholesky_solve
from .kfac_cg import KroneckerStats
from .precision import DualFloorCheck

__all__ = [
    "HOST_MAX_N",
    "SOLVERS",
    "CholeskySolver",
    "EighSolver",
    "Factorization",
    "HostArrays",
    "LinearSolver",
    "NormalEquations",
    "QRSolver",
    "dual_blocks",
    "gram_blocks",
    "gram_update",
    "make_solver",
    "symmetric_product",
]


@dataclass(frozen=True)
class HostArrays:
    """A host system's numbers in NumPy, as its builder formed them (float64, CPU).

    For a few parameters each crossing between torch and NumPy costs about as much as
    the arithmetic it carries; the engine and the host factorisation read these
    instead of converting the system's tensors again.  ``jac`` and ``residuals`` share
    memory with the system's tensors.
    """

    loss: float
    grad: np.ndarray
    col_sq: np.ndarray
    jac: np.ndarray
    residuals: np.ndarray


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
        dual_scale: the mean diagonal entry of ``J diag(col_sq)⁻¹ Jᵀ`` (0-d; the
            number of nonzero columns over the number of rows), when the dual form's
            precision choice needs it (:mod:`secondorder.precision`); read with
            :meth:`scalars`.
        kronecker: the K-FAC factors of the model's layers, summed over ranks, when the
            CG solver preconditions with them (:mod:`secondorder.lm.kfac_cg`).
        host: the same numbers in NumPy when the system was formed on the host (a
            few float64 parameters, :class:`HostArrays`), else ``None``.
        factor_gram: ``dtype -> J Jᵀ`` from the layers' factors when the outer-product
            rule wrote every column of J (dual form, one slice, one process), else
            ``None``; the dual Cholesky solver uses it when ``D`` is a multiple of I.
        carry_check: where J came from a kept forward pass
            (:class:`~secondorder.lm.carry.ForwardCarry`), a 0-d bool: whether its point
            and inputs still hold the values it was computed from; read with
            :meth:`scalars` (:attr:`carry_valid`).
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
    dual_scale: Tensor | None = None
    kronecker: KroneckerStats | None = None
    host: HostArrays | None = field(default=None, repr=False, compare=False)
    factor_gram: Callable[[torch.dtype], Tensor] | None = field(
        default=None, repr=False, compare=False
    )
    carry_check: Tensor | None = field(default=None, repr=False, compare=False)
    _host: tuple[bool, float, float] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    #: ``carry_check`` as read by :meth:`scalars` (True without a check).
    carry_valid: bool = field(default=True, init=False, repr=False, compare=False)
    _dual_scale_host: float | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def n(self) -> int:
        """Number of parameters."""
        return self.grad.numel()

    def scalars(self) -> tuple[bool, float, float]:
        """``(finite, Σr², gtol measure)``, read from the device in one synchronisation.

        ``finite``: whether the loss, ``Jᵀr``, the column norms and the Gram (hence
        J) hold finite numbers only.  The gtol measure is MINPACK's: the largest ``|cos|``
        between a column of J and r, ``|Jᵀr|ᵢ / (‖Jᵢ‖·‖r‖)`` over nonzero columns (0 when
        r or J is zero).  Computed once and kept: the optimizer reads these numbers
        before its first attempt, and a GPU stalls at every read.
        """
        if self._host is None and self.carry_check is not None and self._small_on_host():
            self.carry_valid = bool(self.carry_check)  # on the CPU: no device to wait for
        if self._host is None and self.host is not None:
            # Formed on the host: its own arrays, no crossing and no device checks.
            arrays, gram = self.host, None if self.gram is None else self.gram.numpy()
            self._host = _host_scalars(arrays.loss, arrays.grad, arrays.col_sq, gram)
        if self._host is None and self._small_on_host():
            self._host = self._scalars_in_numpy()
        if self._host is None:
            # J itself is not scanned: col_sq = Σ J² is finite exactly when every entry
            # of J is (or its squares overflow J's dtype, which no normal matrix in
            # that dtype would survive either).
            parts = [self.grad, self.col_sq, self.gram]
            finite = torch.isfinite(self.loss_sum)
            for t in parts:
                if t is not None:
                    finite = finite & torch.isfinite(t).all()
            rnorm = self.loss_sum.clamp(min=0.0).sqrt()
            colnorm = self.col_sq.sqrt()
            ratio = self.grad.abs() / (colnorm * rnorm)
            cos = torch.where(colnorm > 0, ratio, torch.zeros_like(ratio)).max()
            cos = torch.where(rnorm > 0, cos, torch.zeros_like(cos))
            wide = torch.float64
            read = [finite.to(wide), self.loss_sum.to(wide), cos.to(wide)]
            if self.dual_scale is not None:
                read.append(self.dual_scale.to(wide))
            if self.carry_check is not None:
                read.append(self.carry_check.to(wide))
            values = torch.stack(read).tolist()
            self._host = (bool(values[0]), values[1], values[2])
            if self.dual_scale is not None:
                self._dual_scale_host = values[3]
            if self.carry_check is not None:
                self.carry_valid = bool(values[-1])
        return self._host

    def _small_on_host(self) -> bool:
        parts = [self.loss_sum, self.grad, self.col_sq, self.gram]
        return (
            self.dual_scale is None
            and self.grad.numel() <= HOST_MAX_N
            and all(
                t.device.type == "cpu" and t.dtype == torch.float64 for t in parts if t is not None
            )
        )

    def _scalars_in_numpy(self) -> tuple[bool, float, float]:
        """:meth:`scalars` for a few float64 parameters on the CPU, in NumPy.

        The same operations without a torch call; the cosine may differ from torch's
        in its last bit (it is only compared with gtol).
        """
        gram = None if self.gram is None else self.gram.numpy()
        return _host_scalars(float(self.loss_sum), self.grad.numpy(), self.col_sq.numpy(), gram)

    def dual_scale_value(self) -> float | None:
        """``dual_scale`` as a number (read in :meth:`scalars`'s one synchronisation)."""
        self.scalars()
        return self._dual_scale_host

    def curvature(self, delta: Tensor) -> Tensor:
        """``‖Jδ‖² = δᵀJᵀJδ``, the curvature of the linear model along ``delta``."""
        if self.gram is not None:
            d = delta.to(self.gram.dtype)
            return torch.dot(d, self.gram @ d)
        if self.jac is None:
            raise RuntimeError("NormalEquations holds neither gram nor jac")
        jd = self.jac @ delta.to(self.jac.dtype)
        return torch.dot(jd, jd)


def _host_scalars(
    loss: float, grad: np.ndarray, col_sq: np.ndarray, gram: np.ndarray | None
) -> tuple[bool, float, float]:
    """``(finite, Σr², gtol measure)`` of :meth:`NormalEquations.scalars` in NumPy.

    A few entries: Python floats first (the same IEEE operations, so the same numbers,
    at a third of the cost of a dozen NumPy calls); anything unusual (a non-finite
    entry, a zero or overflowing denominator) is left to the NumPy expressions.
    """
    if gram is None and math.isfinite(loss) and loss > 0.0:
        rnorm = math.sqrt(loss)
        cos = -math.inf
        usual = True
        for g, c in zip(grad.tolist(), col_sq.tolist(), strict=True):
            if not (math.isfinite(g) and math.isfinite(c)):
                usual = False
                break
            if c > 0.0:
                denom = math.sqrt(c) * rnorm
                if not 0.0 < denom < math.inf:
                    usual = False
                    break
                cos = max(cos, abs(g) / denom)
            else:
                cos = max(cos, 0.0)  # a zero column makes no angle
        if usual:
            return True, loss, cos
    with np.errstate(all="ignore"):
        finite = math.isfinite(loss) and bool(np.isfinite(grad).all() & np.isfinite(col_sq).all())
        if finite and gram is not None:
            finite = bool(np.isfinite(gram).all())
        rnorm = math.sqrt(max(loss, 0.0)) if not math.isnan(loss) else math.nan
        colnorm = np.sqrt(col_sq)
        ratio = np.abs(grad) / (colnorm * rnorm)
        cos = float(np.where(colnorm > 0, ratio, 0.0).max(initial=-math.inf))
    if not rnorm > 0:  # r = 0 (or not a number): no angle
        cos = 0.0
    return finite, loss, cos


def gram_blocks(n: int) -> int:
    """Column blocks :func:`gram_update` splits an ``n``-column Jacobian into.

    ``JᵀJ`` is symmetric: with the columns in k blocks, only the k(k+1)/2 blocks on
    and above the diagonal need a product, ``(k+1)/2k`` of a general product's
    flops (75% for k = 2, 62.5% for k = 4), and the rest is a copy.  Each block
    product must stay wide enough for the matrix-multiply kernel to run near its
    peak: blocks are at least 96 columns, and at most 4 (measured on 2 CPU
    threads: 1.2x faster at 193 columns with 2 blocks, 1.4x at 769 with 3 or 4).
    """
    return max(1, min(4, n // 96))


def gram_update(
    gram: Tensor | None, jac: Tensor, dtype: torch.dtype | None = None, chunk: int | None = None
) -> Tensor:
    """Return ``gram + JᵀJ`` (``JᵀJ`` when ``gram`` is None), in ``dtype``.

    J (a slice of rows) is converted to ``dtype`` (default: its own) first; products
    of float32 entries are exact in float64, so a float64 Gram of a float32 J carries
    only the rounding of its sums.  With ``chunk``, a float64 Gram of a float32 J is
    instead summed from float32 products of ``chunk`` rows at a time (no float64 copy
    of J; :meth:`~secondorder.lm.precision.GramPrecision.chunk_rows` says when that is
    accurate enough).  ``gram`` is updated in place.  Wide Jacobians are multiplied
    block by block above the diagonal (:func:`gram_blocks`), a symmetric rank-k
    update written with general products so it runs on any device; the result is
    exactly symmetric off the diagonal blocks.
    """
    if chunk is not None and dtype == torch.float64 and jac.dtype == torch.float32:
        n = jac.shape[1]
        if gram is None:
            gram = torch.zeros(n, n, dtype=torch.float64, device=jac.device)
        for start in range(0, jac.shape[0], chunk):
            gram.add_(gram_update(None, jac[start : start + chunk]))
        return gram
    j = jac if dtype is None else jac.to(dtype)
    n = j.shape[1]
    k = gram_blocks(n)
    if k == 1:
        return j.T @ j if gram is None else gram.addmm_(j.T, j)
    if gram is None:
        gram = torch.zeros(n, n, dtype=j.dtype, device=j.device)
    return _add_blocked_aat(gram, j.T, k)


def _add_blocked_aat(out: Tensor, a: Tensor, blocks: int) -> Tensor:
    """``out += A Aᵀ``, A's rows in ``blocks`` blocks; returns ``out``.

    Products on and above the diagonal only; the blocks below are copies of those
    above, so the result is exactly symmetric off the diagonal blocks.  The Gram is
    this with ``A = Jᵀ``, the dual matrix with ``A = J D^-½``.
    """
    m = a.shape[0]
    edges = [(i * m) // blocks for i in range(blocks + 1)]
    for lo, hi in itertools.pairwise(edges):
        out[lo:hi, lo:].addmm_(a[lo:hi], a[lo:].T)
    for lo, hi in itertools.pairwise(edges[:-1]):
        out[hi:, lo:hi] = out[lo:hi, hi:].T
    return out


def dual_blocks(m: int, device: torch.device | None = None) -> int:
    """Row blocks :func:`symmetric_product` splits an m-row product into.

    As in :func:`gram_blocks`, only the blocks on and above the diagonal need a
    product: 75% of the flops with 2 blocks.  Two blocks from 64 rows on, no more
    (measured, 300 interleaved rounds, float32: at 1 thread 128 × 19,210 in 10.0 ms
    median against 11.9 ms for one product, 256 × 1,370 in 1.48 against 1.90 ms, and 4
    blocks no faster; at 2 threads on a loaded machine 4 blocks of 32 rows took twice
    the single product's median at 128 × 19,210, where 2 blocks matched it).  One
    block off the CPU, where a single launch is cheaper at these sizes.
    """
    if device is not None and device.type != "cpu":
        return 1
    return max(1, min(2, m // 32))


def symmetric_product(js: Tensor) -> Tensor:
    """``Js Jsᵀ`` (m × m): the dual form's normal matrix, a row block at a time.

    Each row block is multiplied by the rows from its own onwards (one product per
    block, :func:`dual_blocks`), and the blocks below the diagonal are copies of those
    above, so the result is exactly symmetric off the diagonal blocks.
    """
    m = js.shape[0]
    blocks = dual_blocks(m, js.device)
    if blocks == 1:
        return js @ js.T
    return _add_blocked_aat(torch.zeros(m, m, dtype=js.dtype, device=js.device), js, blocks)


class _ScaledRows:
    """``Js = J D^-½`` for the dual solvers: ``Js Jsᵀ`` once, ``Jsᵀ y`` per solve."""

    def __init__(self, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        self.inv_sqrt_d = d.to(dtype).rsqrt()
        self.js = jac.to(dtype) * self.inv_sqrt_d
        self.k = symmetric_product(self.js)
        #: ``Jδ`` of the last :meth:`step`.
        self.image: Tensor | None = None

    def step(self, y: Tensor) -> Tensor:
        """``δ = D^-½ Jsᵀ y``; its image ``Jδ = Js Jsᵀ y`` is kept in :attr:`image`."""
        # An m×m product instead of a pass over J's m×n entries to measure the step.
        self.image = self.k @ y
        return self.inv_sqrt_d * (self.js.T @ y)


class _OuterRows:
    """``J D⁻¹Jᵀ`` for ``D = d₀I`` from the factors' ``J Jᵀ``; ``δ = Jᵀy / d₀`` from J.

    ``d0`` stays a 0-d tensor on the device: reading it would cost a host read.
    """

    def __init__(self, jac: Tensor, d0: Tensor, outer: Tensor) -> None:
        self.jac, self.d0 = jac, d0.to(jac.dtype)
        self.k = outer.div_(d0.to(outer.dtype))
        #: ``Jδ`` of the last :meth:`step`.
        self.image: Tensor | None = None

    def step(self, y: Tensor) -> Tensor:
        """``δ = Jᵀy / d₀`` (in J's dtype); its image ``Jδ = K y`` is kept in :attr:`image`."""
        self.image = self.k @ y
        return (self.jac.T @ y.to(self.jac.dtype)) / self.d0


class Factorization:
    """The reusable part of a solve for one iteration; :meth:`solve` runs per λ."""

    #: Conjugate-gradient iterations spent by the last :meth:`solve` (0 for direct solvers).
    iterations: int = 0
    #: Whether :meth:`solve_scaled` gives ``(δ, ‖D^½δ‖)`` without touching the device
    #: (a few parameters: the factors live in NumPy arrays on the host).
    on_host: bool = False

    def solve_scaled(self, damping: float, w: Tensor) -> tuple[Tensor, float] | None:
        """``(δ, ‖D^½δ‖)`` for ``b = Jᵀw``, or ``None`` if it failed (only when :attr:`on_host`)."""
        raise NotImplementedError

    def scaled_norm(self, damping: float, w: Tensor) -> float | None:
        """``‖D^½δ‖`` of :meth:`solve_scaled`'s step alone (only when :attr:`on_host`)."""
        raise NotImplementedError

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        """Return ``(JᵀJ + λD)⁻¹ b`` with ``b = Jᵀw``, or ``None`` if it failed.

        ``w`` is required by the solvers that work on J directly (dual form, QR).
        A ``None`` result tells the optimizer to raise λ and try again.
        """
        raise NotImplementedError

    def image(self) -> Tensor | None:
        """``Jδ`` for the ``δ`` of the last solve, if this factorisation formed it already.

        The dual form has it from the m×m matrix (``Jδ = Js Jsᵀ y``), so measuring a
        step's curvature ``‖Jδ‖²`` need not pass over J again; ``None`` (the default)
        leaves it to :meth:`NormalEquations.curvature`.  Valid until the next solve.
        """
        return None

    def solve_unchecked(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        """:meth:`solve` without reading a failure flag on the host.

        A failure may show as a non-finite result rather than ``None``; the optimizer
        checks the step's finiteness in the same synchronisation as its predicted
        reduction, so a solve costs no host round trip of its own.
        """
        return self.solve(damping, b, w)


class LinearSolver:
    """Base class of the solvers: a name and a :meth:`factor` method."""

    name = ""
    #: Whether this solver needs J itself (not only ``JᵀJ``) in the primal form.
    needs_jacobian = False
    #: Whether this solver needs the record's K-FAC factors (CG with ``"kfac"``).
    needs_kronecker = False

    def factor(self, system: NormalEquations, d: Tensor, uniform: bool = False) -> Factorization:
        """Prepare the solves of one iteration for damping diagonal ``d``.

        ``uniform``: the caller knows ``d`` to be a multiple of the identity (its damping
        matrix says so), which no solver then reads from the device.
        """
        raise NotImplementedError


def _finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _nan_unless(x: Tensor, info: Tensor) -> Tensor:
    """``x`` where the factorisation succeeded (``info == 0``), NaN otherwise."""
    return torch.where(info == 0, x, torch.full_like(x, math.nan))


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

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        #: Set for one iteration by ``gram_dtype="auto"`` when λ alone asked for a
        #: float64 dual matrix: try float32 first and keep it if the check passes
        #: (:class:`~secondorder.lm.precision.DualFloorCheck`); ``dtype`` then says
        #: float32.  Cleared by the next :meth:`factor`.
        self.dual_check: DualFloorCheck | None = None

    def factor(self, system: NormalEquations, d: Tensor, uniform: bool = False) -> Factorization:  # noqa: D102
        check, self.dual_check = self.dual_check, None
        if system.dual:
            assert system.jac is not None
            jac = system.jac
            dtype = self.dtype or jac.dtype
            if system.factor_gram is not None and uniform:
                # D = d₀I: J D⁻¹Jᵀ = J Jᵀ/d₀ from the layers' factors, cheap in any
                # dtype, so the float32 attempt behind ``check`` would save nothing.
                return _CholeskyDual(jac, d, dtype, system.factor_gram(dtype))
            if check is not None and dtype == torch.float64 and jac.dtype == torch.float32:
                narrow = _CholeskyDual(jac, d, torch.float32)
                if check.float32_suffices(narrow.k):
                    self.dtype = torch.float32
                    return narrow
            return _CholeskyDual(jac, d, dtype)
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

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    def factor(self, system: NormalEquations, d: Tensor, uniform: bool = False) -> Factorization:  # noqa: D102
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


class _HostSVD(Factorization):
    """A few parameters on the host: ``J = Q0 R0`` and an SVD of ``R0 D^-½`` once.

    With ``R0 D^-½ = U S Vᵀ`` the damped step and its scaled length are, for every λ,

        δ(λ) = D^-½ V diag(s / (s² + λ)) UᵀQ0ᵀw,     ‖D^½δ(λ)‖ = ‖s / (s² + λ) ∘ UᵀQ0ᵀw‖,

    the minimiser the per-λ QR of ``[R0; √λ·D^½]`` finds, so a trust region's search
    for λ costs three vector operations per λ.  The Gauss-Newton step (λ = 0, the
    steps that end a fit) is instead ``R0⁻¹Q0ᵀw`` by back substitution, as MINPACK and
    the device solver take it: Householder QR is backward stable column by column
    whatever the columns' scales, where the SVD's error is relative to the largest
    scaled column (with finite differences that cost NIST's Bennett5 a digit).  Where
    R0 is singular (or m < n) the λ = 0 step is the SVD's minimum-norm one, the limit
    λ → 0.  For n ≤ :data:`HOST_MAX_N` float64 columns on the CPU, torch's per-call
    overhead (a few µs a call, a host read per check) was the whole cost of a solve;
    here J crosses to NumPy once per iteration.

    Given the residuals r, the QR is of ``[J, -r]`` (MINPACK's ``qtf``): its last
    column is ``Q0ᵀ(-r)``, the reflectors applied to ``-r`` without forming Q0, and the
    first n columns are J's own R0 (a Householder step never looks right of its
    column).  The engine's ``w`` is ``-r``; any other ``w`` (geodesic acceleration)
    forms Q0 when it first comes.
    """

    on_host = True

    def __init__(
        self,
        jac: Tensor,
        d: Tensor,
        residuals: Tensor | None = None,
        arrays: HostArrays | None = None,
        finite: bool = False,
    ) -> None:
        with np.errstate(all="ignore"):
            self.sqrt_d = np.sqrt(d.numpy())
            self.inv_sqrt_d = 1.0 / self.sqrt_d
            # The system's own NumPy views when it was formed on the host.
            j = jac.numpy() if arrays is None else arrays.jac
            m, n = j.shape
            self._j = j
            #: ``-r`` and ``Q0ᵀ(-r)`` from the QR of ``[J, -r]`` (``None``: not given).
            self._neg_r: np.ndarray | None = None
            self._qt_neg_r = np.zeros(0)
            self.q0: np.ndarray | None = None
            #: ``-r`` as a tensor (a view of the factored copy), for the engine's ``w``:
            #: that very tensor is recognised without comparing its entries.
            self.w: Tensor | None = None
            if residuals is not None and m >= n:
                both = np.empty((m, n + 1), order="F")
                both[:, :n] = j
                r = residuals.numpy() if arrays is None else arrays.residuals
                np.negative(r, out=both[:, n])
                checked = both
            else:
                both, checked = None, j
            # A host system whose scalars were read finite has finite J (its column norms)
            # and r (its loss): no second scan.
            known = arrays is not None and finite
            if not known and not np.isfinite(checked).all():
                # LAPACK may not return on NaN or inf: a failed factorisation, λ rises.
                raise torch.linalg.LinAlgError("J D^-1/2 is not finite")
            try:
                if both is not None:
                    top = np.linalg.qr(both, mode="raw")[0].T[:n]
                    self.r0 = top[:, :n] * _upper(n)
                    self._neg_r, self._qt_neg_r = both[:, n], top[:, n]
                    self.w = torch.from_numpy(self._neg_r)
                elif m >= n:
                    self.q0, self.r0 = np.linalg.qr(j)
                else:
                    self.r0 = j
                a = self.r0 * self.inv_sqrt_d
                # R0 D^-½ is finite only if D^-½ is (a zero column of R0 gives 0·inf = NaN).
                if not np.isfinite(a).all():
                    raise torch.linalg.LinAlgError("R0 D^-1/2 is not finite")
                self.u, self.s, self.vt = np.linalg.svd(a, full_matrices=False)
            except np.linalg.LinAlgError as exc:
                # Not converged: the engine raises λ on torch's error, as after a failed QR.
                raise torch.linalg.LinAlgError(f"factorisation of J D^-1/2: {exc}") from exc
            self.s2 = self.s * self.s
            self._full_rank = bool(self.s2.size and self.s2[-1] > 0.0)
        self._w: Tensor | None = None
        self._c = self._sc = np.zeros(0)
        self._qw = np.zeros(0)
        self._safe = False

    def _project(self, w: Tensor) -> np.ndarray:
        """``Q0ᵀw`` (``w`` itself when m < n)."""
        if w is self.w:
            return self._qt_neg_r
        wn = w.numpy()
        if self._neg_r is not None:
            if np.array_equal(wn, self._neg_r):
                return self._qt_neg_r
            if self.q0 is None:
                self.q0 = np.linalg.qr(self._j)[0]
        return wn if self.q0 is None else self.q0.T @ wn

    def _coefficients(self, w: Tensor) -> np.ndarray:
        # The LM direction and the λ search share w = -r: project it once, and decide
        # once whether a step can overflow (‖z‖ ≤ ‖Uᵀw‖/s_min for every λ ≥ 0), so the
        # per-λ solves skip NumPy's error-state guard when it cannot.
        if w is not self._w:
            with np.errstate(all="ignore"):
                self._qw = self._project(w)
                self._c = self.u.T @ self._qw
                self._sc = self.s * self._c
                smallest = float(self.s[-1]) if self.s.size else 0.0
                bound = float(np.abs(self._c).sum()) / smallest if smallest > 1e-150 else math.inf
                self._safe = bool(bound * float(self.inv_sqrt_d.max(initial=0.0)) < 1e140)
            self._w = w
        return self._c

    def _z(self, damping: float) -> np.ndarray:
        """``z = D^½δ`` in V's basis: ``(s ∘ Uᵀw) / (s² + λ)`` (after :meth:`_coefficients`)."""
        if damping > 0.0 or self._full_rank:
            return self._sc / (self.s2 + damping)
        # λ = 0 with a zero singular value: it contributes nothing (pseudo-inverse).
        denom = self.s2 + damping
        return np.divide(self._sc, denom, out=np.zeros_like(self.s), where=denom > 0)

    def scaled_norm(self, damping: float, w: Tensor) -> float | None:
        """``‖D^½δ(λ)‖`` alone (a trust region's search), or ``None`` if not finite."""
        self._coefficients(w)
        if not self.s.size:
            return 0.0
        if self._safe:
            z = self._z(damping)
            norm = math.sqrt(float(z.dot(z)))
        else:
            with np.errstate(all="ignore"):
                z = self._z(damping)
                norm = math.sqrt(float(z.dot(z)))
        return norm if math.isfinite(norm) else None

    def solve_scaled(self, damping: float, w: Tensor) -> tuple[Tensor, float] | None:
        self._coefficients(w)
        if not self.s.size:  # no parameters (or no residuals): the step is empty
            return torch.zeros(self.inv_sqrt_d.size, dtype=torch.float64), 0.0
        with np.errstate(all="ignore"):  # an overflow is a failed solve, as on the device
            delta = self._gauss_newton() if damping == 0.0 else None
            if delta is None:
                delta = self.inv_sqrt_d * self.vt.T.dot(self._z(damping))
            scaled = self.sqrt_d * delta
            norm = math.sqrt(float(scaled.dot(scaled)))
        if not np.isfinite(delta).all():
            return None
        return torch.from_numpy(delta), norm

    def _gauss_newton(self) -> np.ndarray | None:
        """λ = 0: ``R0 δ = Q0ᵀw`` by back substitution; ``None`` if R0 is singular or m < n."""
        r0 = self.r0
        if r0.shape[0] < r0.shape[1] or not (np.diagonal(r0) != 0).all():
            return None
        # R0 is upper triangular: LU's partial pivoting keeps its rows, so this is back
        # substitution (NumPy has no triangular solver of its own).
        return np.asarray(np.linalg.solve(r0, self._qw))

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        out = self.solve_scaled(damping, _require_w(w, "qr"))
        return None if out is None else out[0]


#: Columns up to which :class:`QRSolver` (with ``host=True``) solves on the host.
HOST_MAX_N = 16

_UPPER: dict[int, np.ndarray] = {}


def _upper(n: int) -> np.ndarray:
    """The n × n upper-triangular mask of ones (kept: ``np.triu`` costs more than R0)."""
    mask = _UPPER.get(n)
    if mask is None:
        mask = _UPPER[n] = np.triu(np.ones((n, n)))
    return mask


class QRSolver(LinearSolver):
    """QR of J itself (MINPACK's approach): squares no condition number.

    ``host=True`` (the functional :func:`~secondorder.least_squares`): a float64 J on
    the CPU with at most :data:`HOST_MAX_N` columns is factored on the host instead
    (:class:`_HostSVD`), where a per-λ solve costs microseconds, not torch calls.
    """

    name = "qr"
    needs_jacobian = True

    def __init__(self, dtype: torch.dtype | None = None, host: bool = False) -> None:
        self.dtype = dtype
        self.host = host

    def factor(self, system: NormalEquations, d: Tensor, uniform: bool = False) -> Factorization:  # noqa: D102
        if system.jac is None:
            raise RuntimeError("the qr solver needs the Jacobian")
        dtype = self.dtype or system.jac.dtype
        jac = system.jac
        if (
            self.host
            and dtype == torch.float64 == jac.dtype == d.dtype
            and jac.device.type == "cpu"
            and jac.ndim == 2
            and jac.shape[1] <= HOST_MAX_N
        ):
            arrays = system.host if system.residuals is not None else None
            # scalars() has run (the engine reads them first) when _host is set.
            finite = system._host is not None and system._host[0]
            return _HostSVD(jac, d, system.residuals, arrays, finite)
        return _QR(jac, d, dtype)


# ---------------------------------------------------------------------------------------
# Conjugate gradients


SOLVERS = ("auto", "cholesky", "eigh", "qr", "cg")


def make_solver(
    name: str,
    dtype: torch.dtype | None = None,
    cg_rtol: float = 1e-6,
    cg_max_iter: int | None = None,
    cg_forcing: float | None = None,
    cg_preconditioner: str = "jacobi",
    host: bool = False,
) -> LinearSolver:
    """Build the solver called ``name``; ``"auto"`` is resolved by the caller.

    ``host``: let ``"qr"`` factor a few float64 CPU columns in NumPy (:class:`QRSolver`).
    """
    if name == "cholesky":
        return CholeskySolver(dtype)
    if name == "eigh":
        return EighSolver(dtype)
    if name == "qr":
        return QRSolver(dtype, host=host)
    if name == "cg":
        # cg.py builds on this module's record and interfaces, so it is imported here.
        from .cg import CGSolver

        return CGSolver(cg_rtol, cg_max_iter, cg_forcing, cg_preconditioner)
    raise ValueError(f"Unknown solver={name!r}; valid choices are {SOLVERS}.")


def __getattr__(name: str) -> object:
    """The CG classes, importable from here as before they moved to :mod:`secondorder.lm.cg`.

    ``cg`` builds on this module's record and interfaces, so it is imported on demand.
    """
    if name in ("CGSolver", "CGFactorization"):
        from . import cg

        return getattr(cg, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
