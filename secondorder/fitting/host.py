"""The QR and SVD of a small host system, with LAPACK called without NumPy's wrappers.

:func:`~secondorder.fitting.least_squares` factors a few float64 columns on the host
(:class:`~secondorder.lm.linalg.QRSolver` with ``host=True``): one QR of ``[J, -r]``
and one SVD of ``R0 D^-½`` per iteration.  At NIST's sizes (n ≤ 9, m ≤ 250) a LAPACK
call is so short that ``np.linalg``'s Python around it (argument checks, a type
promotion, a copy, an error-state context) costs about as much again.  :class:`HostQRSolver`
builds the same factorisation from the same LAPACK calls (NumPy's linalg gufuncs,
given the arrays ``np.linalg.qr``/``svd``/``solve`` would give them), so every number
is the wrapped path's to the last bit; where NumPy does not expose the gufuncs it
falls back to the wrappers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..lm.linalg import HOST_MAX_N, Factorization, NormalEquations, QRSolver
from ..lm.linalg.host_svd import HostSVD, _upper
from ..lm.precision import NATIVE, StepPrecision

__all__ = ["HostQRSolver", "has_lapack_gufuncs"]

_gufuncs: Any
try:  # NumPy's own LAPACK gufuncs (np.linalg's implementation, present since NumPy 1.8)
    from numpy.linalg import _umath_linalg as _gufuncs
except ImportError:  # pragma: no cover - every NumPy this package supports has them
    _gufuncs = None

_LAPACK: Any = (
    _gufuncs if all(hasattr(_gufuncs, k) for k in ("qr_r_raw", "svd_s", "solve1")) else None
)


def has_lapack_gufuncs() -> bool:
    """Whether :class:`HostQRSolver` calls LAPACK directly (else through ``np.linalg``)."""
    return _LAPACK is not None


class HostQRSolver(QRSolver):
    """:class:`~secondorder.lm.linalg.QRSolver` on the host, factoring a host system leanly.

    A system formed on the host (``system.host``, from
    :meth:`~secondorder.fitting.problem.FunctionProblem.linearize`) with at least as
    many residuals as parameters gets :class:`_LeanHostSVD`: the factorisation of
    ``QRSolver(host=True)`` computed by the same LAPACK calls without their wrappers.
    Any other system goes to ``QRSolver(host=True)`` unchanged.
    """

    def __init__(self) -> None:
        super().__init__(host=True)

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: torch.Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        arrays = system.host
        if (
            _LAPACK is None
            or arrays is None
            or system.residuals is None
            or precision.dtype not in (None, torch.float64)
            or d.dtype != torch.float64
            or not d.is_cpu
        ):
            return super().factor(system, d, uniform, precision)
        m, n = arrays.jac.shape
        if m < n or n > HOST_MAX_N:
            return super().factor(system, d, uniform, precision)
        # The engine read the scalars before factoring: finite means J (through its
        # column norms) and r (through the loss) hold finite numbers only.
        return _LeanHostSVD.build(arrays.jac, arrays.residuals, d.numpy(), system.scalars()[0])


class _LeanHostSVD(HostSVD):
    """:class:`~secondorder.lm.linalg.host_svd.HostSVD`'s factorisation, LAPACK called directly.

    The same arrays in the same layouts go to the same gufuncs ``np.linalg`` calls
    (``qr_r_raw`` on an F-ordered ``[J, -r]``, ``svd_s`` on ``R0 D^-½``, ``solve1`` for
    the Gauss-Newton step), under the error state those wrappers set, so the steps
    are bitwise the wrapped class's; the solves are inherited.
    """

    #: LAPACK's ``gesv`` for one right-hand side (NumPy's ``solve1`` gufunc).
    _solve1: Any
    #: Whether R0 has a zero on its diagonal (read at the first Gauss-Newton step).
    _singular: bool | None

    @classmethod
    def build(cls, j: np.ndarray, r: np.ndarray, d: np.ndarray, finite: bool) -> _LeanHostSVD:
        """Factor ``[J, -r]`` (``m ≥ n``) and ``R0 D^-½``; raise torch's LinAlgError on failure."""
        self = cls.__new__(cls)
        m, n = j.shape
        # -r once: the engine's w (recognised by identity) and the QR's last column.
        neg_r = np.negative(r)
        both = np.empty((m, n + 1), order="F")
        both[:, :n] = j
        both[:, n] = neg_r
        if not finite and not np.isfinite(both).all():
            # LAPACK may not return on NaN or inf: a failed factorisation, λ rises.
            raise torch.linalg.LinAlgError("J D^-1/2 is not finite")
        # No error state raises here: a LAPACK failure fills the gufunc's outputs with
        # NaN (np.linalg turns its "invalid" flag into an error), found by the checks.
        with np.errstate(all="ignore"):
            sqrt_d = np.sqrt(d)
            inv_sqrt_d = 1.0 / sqrt_d
            _LAPACK.qr_r_raw(both, signature="d->d")  # in place, as np.linalg.qr's copy
            top = both[:n]
            r0 = top[:, :n] * _upper(n)
            a = r0 * inv_sqrt_d
            # R0 D^-½ is finite only if D^-½ is (a zero column of R0 gives 0·inf = NaN).
            if not np.isfinite(a).all():
                raise torch.linalg.LinAlgError("R0 D^-1/2 is not finite")
            u, s, vt = _LAPACK.svd_s(a, signature="d->ddd")
        if s.size and math.isnan(s[0]):
            raise torch.linalg.LinAlgError("factorisation of J D^-1/2: SVD did not converge")
        self.sqrt_d, self.inv_sqrt_d = sqrt_d, inv_sqrt_d
        self._j, self.q0 = j, None
        self._neg_r, self._qt_neg_r = neg_r, top[:, n]
        self.w = torch.from_numpy(neg_r)
        self.r0, self.u, self.s, self.vt = r0, u, s, vt
        self.s2 = s * s
        self._full_rank = bool(self.s2.size and self.s2[-1] > 0.0)
        self._w = None
        self._c = self._sc = self._qw = np.zeros(0)
        self._safe = False
        self._solve1 = _LAPACK.solve1
        self._singular = None
        return self

    def _gauss_newton(self) -> np.ndarray | None:
        r0 = self.r0
        if self._singular is None:
            self._singular = not bool((r0.diagonal() != 0).all())
        if self._singular:
            return None
        # Back substitution: LU's pivoting keeps an upper triangle's rows, and a nonzero
        # diagonal cannot fail.  Called inside solve_scaled's error-state guard.
        out: np.ndarray = self._solve1(r0, self._qw, signature="dd->d")
        return out
