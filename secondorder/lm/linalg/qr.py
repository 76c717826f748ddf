"""QR of J itself, never of ``JᵀJ`` (``solver="qr"``, MINPACK's method).

The condition number is that of J rather than its square; J must be stored.  For
each λ, a QR of the small stacked matrix ``[R; √λ·D^½]``.  A few float64 columns on
the CPU are factored on the host instead (:mod:`.host_svd`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..precision import NATIVE, StepPrecision
from .base import Factorization, LinearSolver, _finite, _require_w
from .host_svd import HostSVD
from .record import HOST_MAX_N, NormalEquations

__all__ = ["QRSolver"]


class _QR(Factorization):
    """Solve ``min ‖[R0; √λ·D^½] δ - [Q0ᵀw; 0]‖`` where ``J = Q0 R0``.

    ``[J; √λD^½]`` and ``[R0; √λD^½]`` have the same normal matrix, so the per-λ QR
    runs on a ``(min(m, n) + n) × n`` matrix however many residuals there are.
    """

    def __init__(self, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
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
    """QR of J itself (MINPACK's approach): squares no condition number.

    ``host=True`` (the functional :func:`~secondorder.fitting.least_squares`): a float64 J on
    the CPU with at most :data:`HOST_MAX_N` columns is factored on the host instead
    (:class:`~.host_svd.HostSVD`), where a per-λ solve costs microseconds, not torch
    calls.
    """

    name = "qr"
    needs_jacobian = True

    def __init__(self, host: bool = False) -> None:
        self.host = host

    def factor(  # noqa: D102
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        if system.jac is None:
            raise RuntimeError("the qr solver needs the Jacobian")
        dtype = precision.dtype or system.jac.dtype
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
            return HostSVD(jac, d, system.residuals, arrays, finite)
        return _QR(jac, d, dtype)
