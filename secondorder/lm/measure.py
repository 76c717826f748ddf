"""What an attempt measures: the predicted reduction, the step's norms, in one read.

The engine (:mod:`secondorder.lm.engine`) reads these numbers once per attempt; a
factorisation that lives on the host gets the same numbers from NumPy, without a
torch call.  :func:`convergence` holds scipy's ftol and xtol tests on them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .linalg import Factorization, NormalEquations

__all__ = ["HostView", "convergence", "measure", "measure_on_host", "predicted_reduction"]


def convergence(
    ftol: float,
    xtol: float,
    loss0: float,
    actual: float,
    pred: float,
    rho: float,
    step_norm: float,
    xnorm: float,
) -> tuple[int, str]:
    """Scipy's ftol/xtol tests for one evaluated attempt: ``(status, reason)``."""
    ftol_hit = abs(actual) <= ftol * loss0 and pred <= ftol * loss0 and rho <= 2.0
    xtol_hit = step_norm <= xtol * (xtol + xnorm)
    if ftol_hit and xtol_hit:
        return 4, "ftol and xtol: both the loss reduction and the step are below tolerance"
    if ftol_hit:
        return 2, "ftol: relative reduction of the loss below ftol"
    if xtol_hit:
        return 3, "xtol: relative step size below xtol"
    return 0, ""


def predicted_reduction(
    system: NormalEquations, g: Tensor, delta: Tensor, image: Tensor | None = None
) -> Tensor:
    """``-2gᵀδ - ‖Jδ‖²``, the reduction of ``Σr²`` the linear model predicts, in float64.

    ``image``: ``Jδ`` when the solve formed it already (the dual form), else ``None``.

    With residuals near 1e19 a float32 ``gᵀδ`` or ``‖Jδ‖²`` overflows although every
    factor is finite.  ``gᵀδ`` is summed in float64; ``‖Jδ‖²`` is evaluated along
    ``δ/s``, with ``s`` the largest power of two not above ``max|δ|`` (an exact
    scaling), and multiplied by ``s²`` in float64: the same number whenever the
    unscaled product would not have overflowed.  Everything stays on the device, so
    the caller reads it back with its other scalars in one transfer.
    """
    wide = torch.float64
    linear = torch.dot(g.to(wide), delta.to(wide))
    if delta.numel() == 0:
        return -2.0 * linear
    top = delta.abs().max()
    scalable = torch.isfinite(top) & (top > 0)
    exponent = torch.frexp(torch.where(scalable, top, torch.ones_like(top)))[1]
    scale = torch.ldexp(torch.ones_like(top), exponent - 1)
    if image is None:
        curvature = system.curvature(delta / scale).to(wide)
    else:
        jd = image / scale.to(image.dtype)
        curvature = torch.dot(jd, jd).to(wide)
    scale64 = scale.to(wide)
    return -2.0 * linear - curvature * scale64 * scale64


def measure(
    system: NormalEquations,
    xnorm0: Tensor,
    d: Tensor | None,
    delta: Tensor,
    x_try: Tensor,
    image: Tensor | None,
) -> list[float]:
    """``[finite, predicted reduction, ‖δ‖, ‖x + δ‖, ‖x‖]`` (+ ``‖D^½δ‖, gᵀδ``), one read.

    ``image``: ``Jδ`` when the factorisation formed it (:meth:`Factorization.image`);
    ``d``: the damping diagonal, given for a rule that measures the step (``‖D^½δ‖``).
    """
    wide = torch.float64
    read = [
        torch.isfinite(delta).all().to(wide),
        predicted_reduction(system, system.grad, delta, image),
        torch.linalg.vector_norm(delta, dtype=wide),
        torch.linalg.vector_norm(x_try, dtype=wide),
        xnorm0,
    ]
    if d is not None:
        # What the trust region measures: ‖D^½δ‖ and the slope gᵀδ, in the same read.
        read.append(torch.linalg.vector_norm(d.to(wide).sqrt() * delta.to(wide)))
        read.append(torch.dot(system.grad.to(wide), delta.to(wide)))
    return torch.stack(read).tolist()


class HostView:
    """The iteration's vectors as NumPy views, for a factorisation that lives on the host."""

    __slots__ = ("grad", "jac", "sqrt_d", "x", "xnorm")

    def __init__(
        self, x: np.ndarray, grad: np.ndarray, jac: np.ndarray | None, sqrt_d: np.ndarray
    ) -> None:
        self.x, self.grad, self.jac, self.sqrt_d = x, grad, jac, sqrt_d
        #: ``‖x‖``, once the first attempt has measured it.
        self.xnorm: float | None = None

    @classmethod
    def of(cls, x: Tensor, system: NormalEquations, d: Tensor, fact: Factorization) -> HostView:
        """Views of ``x``, ``Jᵀr``, J and ``D^½`` (CPU float64 tensors).

        A system formed on the host brings its own views, and a host factorisation
        its ``D^½``: each conversion saved is a call as costly as the arithmetic.
        """
        arrays = system.host
        jac: np.ndarray | None
        if arrays is not None and system.jac is not None:
            grad, jac = arrays.grad, arrays.jac
        else:
            grad = system.grad.numpy()
            jac = None if system.jac is None else system.jac.numpy()
        sqrt_d = fact.host_sqrt_d()
        if sqrt_d is None:
            with np.errstate(all="ignore"):
                sqrt_d = np.sqrt(d.numpy())
        return cls(x.numpy(), grad, jac, sqrt_d)


def measure_on_host(
    system: NormalEquations, view: HostView, delta: np.ndarray, xt: np.ndarray, chooses: bool
) -> list[float]:
    """:func:`measure` in NumPy (a few columns on the host), without a torch call.

    The same quantities in float64: the predicted reduction along ``δ/s`` with ``s``
    the power of two below ``max|δ|``, as on the device.  Overflow gives inf, as on the
    device (one error-state guard costs less than bounding the entries first).
    ``xt`` is the trial point ``x + δ``; ``chooses``: the rule measures the step.
    """
    with np.errstate(all="ignore"):
        top = float(np.abs(delta).max()) if delta.size else 0.0
        if not math.isfinite(top):
            return [0.0] * 7
        # ndarray.dot: the products of @, with less dispatch.
        slope = float(view.grad.dot(delta))
        scale = math.ldexp(1.0, math.frexp(top)[1] - 1) if top > 0.0 else 1.0
        if view.jac is not None:
            jd = view.jac.dot(delta / scale)
            curvature = float(jd.dot(jd))
        else:
            curvature = float(system.curvature(torch.from_numpy(delta / scale)))
        if view.xnorm is None:
            view.xnorm = math.sqrt(float(view.x.dot(view.x)))
        values = [
            1.0,
            -2.0 * slope - curvature * scale * scale,
            math.sqrt(float(delta.dot(delta))),
            math.sqrt(float(xt.dot(xt))),
            view.xnorm,
        ]
        if chooses:
            sd = view.sqrt_d * delta
            values += [math.sqrt(float(sd.dot(sd))), slope]
    return values
