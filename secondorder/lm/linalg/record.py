"""The normal-equation record that an LM iteration's stages share.

:class:`NormalEquations` holds one linearisation, already reduced over slices,
devices and processes: ``Σr²``, ``Jᵀr``, ``diag(JᵀJ)`` and either the Gram or J's
rows.  Solvers factor it (:mod:`.base`); the engine reads its scalars once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...distributed.reducer import LocalReducer, Reducer
from ..kfac_cg import KroneckerStats

__all__ = ["HOST_MAX_N", "HostArrays", "NormalEquations"]

#: Columns up to which a float64 CPU system is read and solved on the host (NumPy).
HOST_MAX_N = 16


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
        weight_sum: what the reported loss divides ``loss_sum`` by where that is not
            ``count`` (cross-entropy's ``Σ w[yᵢ]``, :mod:`~secondorder.lm.loss_mean`), a
            0-d float64 tensor summed over slices and ranks, read with :meth:`scalars`;
            ``None``: ``count``.  Only the report uses it.
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
            precision choice needs it (:mod:`secondorder.lm.precision`); read with
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
        reducer: how the participants that share the batch meet; the identity
            (:class:`~secondorder.distributed.LocalReducer`) on one process.
        rows_sharded: ``jac`` and ``residuals`` hold this participant's rows only (the
            CG solver works on them through ``reducer``); ``False`` when they hold every
            row or are absent.
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
    reducer: Reducer = field(default_factory=LocalReducer, repr=False, compare=False)
    rows_sharded: bool = False
    weight_sum: Tensor | None = None
    _host: tuple[bool, float, float] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    #: ``carry_check`` as read by :meth:`scalars` (True without a check).
    carry_valid: bool = field(default=True, init=False, repr=False, compare=False)
    _dual_scale_host: float | None = field(default=None, init=False, repr=False, compare=False)
    _weight_sum_host: float | None = field(default=None, init=False, repr=False, compare=False)

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
            if self.weight_sum is not None:
                read.append(self.weight_sum.to(wide))
            if self.carry_check is not None:
                read.append(self.carry_check.to(wide))
            values = torch.stack(read).tolist()
            self._host = (bool(values[0]), values[1], values[2])
            if self.dual_scale is not None:
                self._dual_scale_host = values[3]
            if self.weight_sum is not None:
                self._weight_sum_host = values[3 + (self.dual_scale is not None)]
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
        if self.weight_sum is None:
            loss = float(self.loss_sum)
        else:  # one read for both
            loss, self._weight_sum_host = torch.stack([self.loss_sum, self.weight_sum]).tolist()
        return _host_scalars(loss, self.grad.numpy(), self.col_sq.numpy(), gram)

    def dual_scale_value(self) -> float | None:
        """``dual_scale`` as a number (read in :meth:`scalars`'s one synchronisation)."""
        self.scalars()
        return self._dual_scale_host

    def mean_denominator(self) -> float:
        """What the reported loss divides ``Σ r²`` by: ``weight_sum``, else ``count``.

        Read with :meth:`scalars` (its own read only for a system formed on the host).
        """
        if self.weight_sum is None:
            return float(max(self.count, 1))
        self.scalars()
        if self._weight_sum_host is None:
            self._weight_sum_host = float(self.weight_sum)
        return self._weight_sum_host

    def curvature(self, delta: Tensor) -> Tensor:
        """``‖Jδ‖² = δᵀJᵀJδ``, the curvature of the linear model along ``delta``.

        The same bits for every participant: with sharded rows the sum of each one's
        ``‖J_kδ‖²``, otherwise the root's value (every participant holds the same
        system, and the reducer shares the root's number).
        """
        if self.rows_sharded and self.gram is None:
            assert self.jac is not None
            jd = self.jac @ delta.to(self.jac.dtype)
            value = torch.dot(jd, jd).reshape(1)
            self.reducer.sum_([value])
            return value[0]
        if self.gram is not None:
            d = delta.to(self.gram.dtype)
            return self.reducer.root_value(torch.dot(d, self.gram @ d))
        if self.jac is None:
            raise RuntimeError("NormalEquations holds neither gram nor jac")
        jd = self.jac @ delta.to(self.jac.dtype)
        return self.reducer.root_value(torch.dot(jd, jd))


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
