"""The damping matrix ``D`` of ``JᵀJ + λD``: identity, Marquardt's ``diag(JᵀJ)``, Moré's."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..._validation import check_choice
from .state import DampingState, DeviceDamping

__all__ = [
    "DAMPING_MATRICES",
    "DampingMatrix",
    "IdentityMatrix",
    "MarquardtMatrix",
    "MoreMatrix",
    "make_damping_matrix",
]


class DampingMatrix:
    """Base class: the diagonal ``D`` of the damping term, from the column norms of J.

    Every matrix has a floor, ``d ≥ floor·max(d)`` (and a tiny absolute floor), so a
    zero column of J (a dead unit, an unused parameter) still gets positive damping and
    ``JᵀJ + λD`` stays positive definite for every λ > 0.  Without it, Marquardt's
    ``diag(JᵀJ)`` leaves such a system singular whatever λ is, and LM stalls.  The
    floor also bounds how far a parameter with a tiny but nonzero column may move
    while the linear model is not yet trusted (a saturated unit of a network).

    Once λ has fallen to ``damping_min``, the linear model has predicted every recent
    step and λ can fall no further; the floor, ``λ·floor·max(d)``, would then be the
    only damping left on a column with ``‖J_j‖² < λ·floor·max(d)``, and LM would crawl
    along it (a column-scaled problem with cond(J) = 1e12 gains ~1% per step).  So at
    ``damping_min`` only zero, subnormal and non-finite columns are floored, and every
    other column is damped by its own curvature: with ``D = diag(JᵀJ)`` the damped
    system is ``S(C + λI)S`` with ``S = D^½`` and ``C`` the correlation matrix of J's
    columns: up to a diagonal scaling, as well conditioned as ``C + λI`` whatever the
    column scales.
    """

    name = ""
    #: Whether ``D`` is always a multiple of the identity (known without reading it).
    uniform = False

    def __init__(self, floor: float = 1e-9) -> None:
        self.floor = floor

    def diagonal(self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0) -> Tensor:
        """Return ``D`` (a positive vector) for squared column norms ``col_sq``.

        ``damping_min`` is the lower bound of λ; at it only unusable columns are floored.
        """
        raise NotImplementedError

    def device_scale(self, col_sq: Tensor, state: DeviceDamping) -> Tensor | None:
        """The running scale after this linearisation, not yet stored (``None``: none kept)."""
        return None

    def device_diagonal(self, col_sq: Tensor, state: DeviceDamping, damping_min: float) -> Tensor:
        """:meth:`diagonal` with λ a 0-d tensor (the capturable step): no host read.

        ``col_sq``: the squared column norms, or :meth:`device_scale`'s scale.  The
        floor's two cases are both computed and one is picked by a mask; for finite
        column norms (a step with any other is rejected whatever D is) the result is
        :meth:`diagonal`'s.
        """
        raise NotImplementedError

    def _floored_where(self, d: Tensor, at_min: Tensor) -> Tensor:
        """:meth:`_floored` of finite ``d`` with the branch chosen by the 0-d mask ``at_min``."""
        wide = torch.float64
        tiny = torch.finfo(d.dtype).tiny
        # At damping_min: only columns without a scale of their own are floored.
        usable = d >= tiny
        largest = torch.where(usable, d, 0.0).max().to(wide)
        fill = torch.clamp(largest * self.floor, min=tiny).to(d.dtype)
        kept = torch.where(usable, d, fill)
        # Above it: every column at least floor·max(d).
        top = d.max().to(wide)
        floor = torch.clamp(top * self.floor, min=tiny**0.5).to(d.dtype)
        raised = torch.maximum(d, floor)
        out = torch.where(at_min, kept, raised)
        return torch.where(torch.where(at_min, largest, top) > 0.0, out, 1.0)

    def _floored(self, d: Tensor, state: DampingState, damping_min: float) -> Tensor:
        # Computed on the device (no host read): floors in float64, as Python would,
        # then rounded to d's dtype; D = I when no column is usable.
        if _small_host(d):
            return torch.from_numpy(self._floored_host(d.numpy(), state, damping_min))
        if state.damping <= damping_min:
            # Floor only the columns that carry no scale of their own.
            if d.numel() == 0:
                return torch.ones_like(d)
            tiny = torch.finfo(d.dtype).tiny
            usable = torch.isfinite(d) & (d >= tiny)
            largest = torch.where(usable, d, torch.zeros_like(d)).max().to(torch.float64)
            fill = torch.clamp(largest * self.floor, min=tiny).to(d.dtype)
            return torch.where(largest > 0.0, torch.where(usable, d, fill), torch.ones_like(d))
        top = d.max().to(torch.float64)
        tiny = torch.finfo(d.dtype).tiny ** 0.5
        floor = torch.clamp(top * self.floor, min=tiny).to(d.dtype)
        usable = torch.isfinite(top) & (top > 0.0)
        return torch.where(usable, torch.maximum(d, floor), torch.ones_like(d))

    def _floored_host(self, d: np.ndarray, state: DampingState, damping_min: float) -> np.ndarray:
        """:meth:`_floored` for a few float64 columns on the CPU, in NumPy.

        The same exact operations (maxima, one product, comparisons): the same D,
        without torch calls.
        """
        if state.damping <= damping_min:
            if d.size == 0:
                return np.ones_like(d)
            tiny = _TINY64
            if all(tiny <= v < math.inf for v in d.tolist()):
                # Every column usable (the usual case): D is d, which np.where would copy
                # (a Python loop over a few entries costs less than the five array calls).
                return d.copy()
            usable = np.isfinite(d) & (d >= tiny)
            largest = float(np.where(usable, d, 0.0).max())
            fill = max(largest * self.floor, tiny)
            return np.where(usable, d, fill) if largest > 0.0 else np.ones_like(d)
        top = float(d.max())
        floor = max(top * self.floor, _TINY64**0.5)
        if not (math.isfinite(top) and top > 0.0):
            return np.ones_like(d)
        return np.maximum(d, floor)


#: The smallest normal float64 (``np.finfo`` is a call per use).
_TINY64 = float(np.finfo(np.float64).tiny)


def _small_host(t: Tensor) -> bool:
    """A few float64 entries on the CPU: NumPy does their arithmetic without dispatch."""
    return t.dtype == torch.float64 and t.numel() <= 16 and t.is_cpu


class IdentityMatrix(DampingMatrix):
    """``D = I``: the original Levenberg damping; λ is then in units of ``JᵀJ``."""

    name = "identity"
    uniform = True

    def diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0
    ) -> Tensor:
        return torch.ones_like(col_sq)

    def device_diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DeviceDamping, damping_min: float
    ) -> Tensor:
        return torch.ones_like(col_sq)


class MarquardtMatrix(DampingMatrix):
    """``D = diag(JᵀJ)`` (Marquardt 1963, Fletcher 1971), floored.

    Invariant to a rescaling of each parameter, so λ is dimensionless; the usual choice
    for neural networks whose layers have very different gradient scales.
    """

    name = "marquardt"

    def diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0
    ) -> Tensor:
        return self._floored(col_sq, state, damping_min)

    def device_diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DeviceDamping, damping_min: float
    ) -> Tensor:
        return self._floored_where(col_sq, _at_min(state, damping_min))


def _at_min(state: DeviceDamping, damping_min: float) -> Tensor:
    return state.damping <= damping_min


class MoreMatrix(DampingMatrix):
    """Moré's scaling (MINPACK): the running maximum of ``diag(JᵀJ)`` over iterations.

    Like Marquardt's, but a parameter whose column shrinks keeps the damping of its
    largest seen scale, which makes the trust region steadier on curve-fitting
    problems.  The running maximum lives in the optimizer's state.
    """

    name = "more"

    def diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DampingState, damping_min: float = 0.0
    ) -> Tensor:
        if state.scale is None or state.scale.shape != col_sq.shape:
            state.scale = col_sq.clone()
        elif _small_host(col_sq) and _small_host(state.scale):
            # The running maximum and its floor in NumPy, crossing to torch once each way.
            scale = np.maximum(state.scale.numpy(), col_sq.numpy())
            state.scale = torch.from_numpy(scale)
            return torch.from_numpy(self._floored_host(scale, state, damping_min))
        else:
            state.scale = torch.maximum(state.scale.to(col_sq), col_sq)
        return self._floored(state.scale, state, damping_min)

    def device_scale(self, col_sq: Tensor, state: DeviceDamping) -> Tensor | None:  # noqa: D102
        if state.scale is None or state.scale.shape != col_sq.shape:
            return col_sq.clone()
        return torch.maximum(state.scale, col_sq)

    def device_diagonal(  # noqa: D102
        self, col_sq: Tensor, state: DeviceDamping, damping_min: float
    ) -> Tensor:
        return self._floored_where(col_sq, _at_min(state, damping_min))


DAMPING_MATRICES = ("identity", "marquardt", "more")


def make_damping_matrix(name: str, floor: float = 1e-9) -> DampingMatrix:
    """Build the damping matrix called ``name`` (one of :data:`DAMPING_MATRICES`)."""
    if name == "identity":
        return IdentityMatrix(floor)
    if name == "marquardt":
        return MarquardtMatrix(floor)
    if name == "more":
        return MoreMatrix(floor)
    check_choice("damping_matrix", name, DAMPING_MATRICES)
    raise AssertionError(name)  # pragma: no cover - check_choice raised
