"""A few parameters on the host: QR and SVD of J in NumPy, every λ a few vector operations."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .base import Factorization, _require_w
from .record import HostArrays

__all__ = ["HostSVD"]


class HostSVD(Factorization):
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
    λ → 0.  For n ≤ :data:`~.record.HOST_MAX_N` float64 columns on the CPU, torch's per-call
    overhead (per call, and a host read per check) was the whole cost of a solve;
    here J crosses to NumPy once per iteration.

    Given the residuals r, the QR is of ``[J, -r]`` (MINPACK's ``qtf``): its last
    column is ``Q0ᵀ(-r)``, the reflectors applied to ``-r`` without forming Q0, and the
    first n columns are J's own R0 (a Householder step never looks right of its
    column).  The engine's ``w`` is ``-r``; any other ``w`` (geodesic acceleration)
    forms Q0 when it first comes.
    """

    on_host = True
    dtype = torch.float64

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

    def held_residuals(self) -> Tensor | None:  # noqa: D102
        return self.w

    def host_sqrt_d(self) -> np.ndarray | None:  # noqa: D102
        return np.asarray(self.sqrt_d)

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

    def solve_scaled(self, damping: float, w: Tensor) -> tuple[Tensor, float] | None:  # noqa: D102
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

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:  # noqa: D102
        out = self.solve_scaled(damping, _require_w(w, "qr"))
        return None if out is None else out[0]


_UPPER: dict[int, np.ndarray] = {}


def _upper(n: int) -> np.ndarray:
    """The n × n upper-triangular mask of ones (kept: ``np.triu`` costs more than R0)."""
    mask = _UPPER.get(n)
    if mask is None:
        mask = _UPPER[n] = np.triu(np.ones((n, n)))
    return mask
