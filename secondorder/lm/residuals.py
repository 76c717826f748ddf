"""Residual adapters: turn a loss into residuals whose sum of squares is that loss.

Levenberg-Marquardt minimises ``½‖r‖²`` where ``r`` is a vector of residuals.  A
residual function maps ``(outputs, targets)`` to a tensor whose first dimension is the
batch; every entry is one residual.  The optimizer reports ``loss = mean(r²)`` over all
entries, so each adapter below is chosen such that this mean is the familiar loss.

Losses that are not a sum of squares go through the *square-root trick*: with a
per-sample loss ``ℓᵢ ≥ 0`` we set ``rᵢ = sqrt(ℓᵢ)``, so ``Σ rᵢ² = Σ ℓᵢ``.  The
Gauss-Newton model of ``sqrt(ℓ)`` is a good model where ``ℓ`` is well away from zero;
near a perfect fit the derivative of the square root grows like ``1/sqrt(ℓ)`` and the
model degrades, which is why a tiny ``eps`` is added before taking the root.

Residuals that are not a function of ``model(inputs)`` alone, such as a
physics-informed residual that differentiates the network with respect to its inputs,
are written as a :class:`ModelResidual`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ModelResidual",
    "ResidualFn",
    "binary_cross_entropy",
    "cross_entropy",
    "huber",
    "l1",
    "mse",
]

ResidualFn = Callable[[Tensor, Tensor], Tensor]


def _matching_targets(name: str, outputs: Tensor, targets: Tensor | None) -> Tensor:
    """``targets`` reshaped to ``outputs.shape`` and cast to its dtype, after checking them.

    Targets match when they hold the same number of values per sample as the outputs
    (``(batch,)`` targets for ``(batch, 1)`` outputs are fine); anything else would
    be silently broadcast or fail deep inside torch, so it is refused here.
    """
    if targets is None:
        raise TypeError(
            f"{name}: targets is None; pass the targets to step(inputs, targets) or use a "
            "residual_fn that needs none"
        )
    if not isinstance(targets, Tensor):
        raise TypeError(f"{name}: targets must be a tensor, got {type(targets).__name__}")
    batch = outputs.shape[0] if outputs.ndim else 1
    t_batch = targets.shape[0] if targets.ndim else 1
    if t_batch != batch or targets.numel() != outputs.numel():
        raise ValueError(
            f"{name}: targets of shape {tuple(targets.shape)} do not match the model outputs "
            f"of shape {tuple(outputs.shape)}: each sample needs "
            f"{outputs.numel() // max(batch, 1)} target value(s), got "
            f"{targets.numel() // max(t_batch, 1)}"
        )
    return targets.reshape(outputs.shape).to(outputs.dtype)


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """Plain residuals ``r = outputs - targets``; ``mean(r²)`` is the mean squared error."""
    return outputs - _matching_targets("mse", outputs, targets)


def l1(outputs: Tensor, targets: Tensor, eps: float = 1e-6) -> Tensor:
    """Residuals whose squares are a smoothed absolute error.

    ``r = sign(e)·sqrt(sqrt(e² + eps²) - eps)`` with ``e = outputs - targets``, so
    ``r² = sqrt(e² + eps²) - eps ≈ |e|``.  The smoothing keeps ``r`` differentiable at
    ``e = 0`` (slope ``1/sqrt(2·eps)`` there) where the raw ``sqrt(|e|)`` is not.
    """
    e = outputs - _matching_targets("l1", outputs, targets)
    # sqrt(e² + eps²) - eps == e² / (sqrt(e² + eps²) + eps); dividing ``e`` by the root
    # of the denominator gives the same residual without a square root of zero, so
    # autograd's derivative is finite (and equal to the slope above) at ``e = 0``.
    return e / torch.sqrt(torch.sqrt(e * e + eps * eps) + eps)


def huber(outputs: Tensor, targets: Tensor, delta: float = 1.0) -> Tensor:
    """Residuals whose squares are twice the Huber loss with threshold ``delta``.

    Inside ``|e| ≤ delta`` the residual is ``e`` itself (a plain least-squares fit);
    outside it is ``sign(e)·sqrt(2·delta·|e| - delta²)``, which grows like ``sqrt(|e|)``
    so outliers pull linearly rather than quadratically.  ``r`` is continuous with a
    continuous first derivative at ``|e| = delta``.
    """
    e = outputs - _matching_targets("huber", outputs, targets)
    a = e.abs()
    inside = a <= delta
    # Evaluate the outer branch only where it is used: elsewhere feed it ``delta`` so the
    # root stays positive and its derivative finite (torch.where passes gradients to
    # both branches, and a NaN in the unused one would poison the selected one).
    a_out = torch.where(inside, torch.full_like(a, delta), a)
    outer = torch.sign(e) * torch.sqrt(2.0 * delta * a_out - delta * delta)
    return torch.where(inside, e, outer)


def cross_entropy(logits: Tensor, targets: Tensor, eps: float = 1e-12) -> Tensor:
    """Square-root residuals of the softmax cross-entropy, one per sample.

    ``logits`` has shape ``(batch, classes, ...)``; ``targets`` holds class indices of
    shape ``(batch, ...)`` or class probabilities of the logits' shape.  The residual of
    a sample is ``sqrt(CE + eps)``, so ``mean(r²)`` is the mean cross-entropy.
    """
    if targets is None or not isinstance(targets, Tensor):
        raise TypeError(
            "cross_entropy: targets must be a tensor of class indices or probabilities, got "
            f"{type(targets).__name__}"
        )
    if logits.ndim < 2:
        raise ValueError(
            f"cross_entropy: logits must have shape (batch, classes, ...), got "
            f"{tuple(logits.shape)}"
        )
    indices_shape = logits.shape[:1] + logits.shape[2:]
    if targets.is_floating_point():
        if targets.shape != logits.shape:
            raise ValueError(
                f"cross_entropy: probability targets of shape {tuple(targets.shape)} must have "
                f"the logits' shape {tuple(logits.shape)}"
            )
        targets = targets.to(logits.dtype)
    elif targets.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        if targets.shape != indices_shape:
            raise ValueError(
                f"cross_entropy: class-index targets of shape {tuple(targets.shape)} must have "
                f"shape {tuple(indices_shape)} for logits of shape {tuple(logits.shape)}"
            )
        targets = targets.long()
    else:
        raise TypeError(
            f"cross_entropy: targets must hold class indices (integers) or probabilities "
            f"(floating point), got dtype {targets.dtype}"
        )
    ce = F.cross_entropy(logits, targets, reduction="none")
    return torch.sqrt(ce + eps)


def binary_cross_entropy(logits: Tensor, targets: Tensor, eps: float = 1e-12) -> Tensor:
    """Square-root residuals of the binary cross-entropy with logits, one per entry.

    ``r = sqrt(BCE(logits, targets) + eps)``; ``mean(r²)`` is the mean binary
    cross-entropy.  ``targets`` are probabilities in ``[0, 1]``.
    """
    t = _matching_targets("binary_cross_entropy", logits, targets)
    bce = F.binary_cross_entropy_with_logits(logits, t, reduction="none")
    return torch.sqrt(bce + eps)


@dataclass(frozen=True)
class ModelResidual:
    """A residual that needs the model itself, not only ``model(inputs)``.

    ``fn(model, inputs, targets)`` receives ``model`` as a plain function of its
    inputs, evaluated at the parameters the optimizer is currently trying, and returns
    a 1-D (or any-shape) tensor of residuals.  Derivatives of the network with respect
    to its inputs must be taken with :mod:`torch.func` (``torch.func.grad``,
    ``jacrev``, ``hessian``, ``vmap``), which compose with the optimizer's own
    differentiation; ``torch.autograd.grad`` does not.

    Because such a residual may couple samples (boundary terms, a regulariser appended
    to the residual vector), the optimizer differentiates it as a whole: the batch is
    not sliced, and the Jacobian strategy is whole-batch forward or reverse mode.

    Example, a 1-D Poisson problem ``u'' = f`` with ``u(0) = u(1) = 0``::

        def poisson(model, x, f):
            u = lambda s: model(s.reshape(1, 1)).reshape(())
            u_xx = torch.func.vmap(torch.func.hessian(u))(x[:, 0])
            interior = u_xx - f
            boundary = model(torch.tensor([[0.0], [1.0]], dtype=x.dtype)).reshape(-1)
            return torch.cat([interior, 10.0 * boundary])

        opt = so.LevenbergMarquardt(net, so.residuals.ModelResidual(poisson))
        opt.step(x, f)
    """

    fn: Callable[[Callable[[Tensor], Tensor], Tensor, Tensor | None], Tensor]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"ModelResidual: fn must be callable, got {self.fn!r}")
