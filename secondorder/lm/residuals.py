"""Residual adapters: turn a loss into residuals whose sum of squares is that loss.

Levenberg-Marquardt minimises ``½‖r‖²`` where ``r`` is a vector of residuals.  A
residual function maps ``(outputs, targets)`` to a tensor whose first dimension is the
batch; every entry is one residual.  The optimizer reports ``loss = mean(r²)`` over all
entries, so each adapter below is chosen such that this mean is the familiar loss
(cross-entropy's, as torch's, is divided by the weight of the targets it counts:
:mod:`.loss_mean`).

Losses that are not a sum of squares go through the *square-root trick*: with a
per-sample loss ``ℓᵢ ≥ 0`` we set ``rᵢ = sqrt(ℓᵢ)``, so ``Σ rᵢ² = Σ ℓᵢ``.  The
Gauss-Newton model of ``sqrt(ℓ)`` is a good model where ``ℓ`` is well away from zero;
near a perfect fit the derivative of the square root grows like ``1/sqrt(ℓ)`` and the
model degrades, which is why a tiny ``eps`` is added before taking the root.

Residuals that are not a function of ``model(inputs)`` alone, such as a
physics-informed residual that differentiates the network with respect to its inputs,
are written as a :class:`ModelResidual`.

A torch loss module (``torch.nn.MSELoss()``, ``HuberLoss(delta=2)``,
``CrossEntropyLoss(label_smoothing=0.1)``, ...) passed as ``residual_fn`` is mapped by
:func:`from_torch_loss` onto the adapter of the same loss, with its parameters.  The
optimizer minimises ``½‖r‖²``: for ``reduction="sum"`` that is the torch loss (times
½ for Huber and SmoothL1, times 2 for the others), for ``"mean"`` the same divided by
the count torch divides by, a constant factor that does not move the minimum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._validation import check_number

__all__ = [
    "LossResidual",
    "ModelResidual",
    "ResidualFn",
    "binary_cross_entropy",
    "binary_cross_entropy_probs",
    "cross_entropy",
    "from_torch_loss",
    "huber",
    "l1",
    "mse",
    "smooth_l1",
]

ResidualFn = Callable[[Tensor, Tensor], Tensor]


def describe(value: Any) -> str:
    """A short account of ``value`` for an error message: type, shape and dtype, never data."""
    if isinstance(value, Tensor):
        return f"Tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        kind = f"{type(value).__module__.split('.')[0]}.{type(value).__name__}"
        return f"{kind} of shape {tuple(shape)}, dtype {dtype}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__} of {len(value)} ({inner})"
    if isinstance(value, dict):
        keys = list(value)
        return f"dict with keys {keys[:8]}{' ...' if len(keys) > 8 else ''}"
    text = repr(value)
    return f"{type(value).__name__}: {text if len(text) <= 80 else text[:77] + '...'}"


def _output_tensor(name: str, outputs: Any) -> Tensor:
    """``outputs`` if it is a tensor; a model that returns several values is refused.

    The adapters compare one tensor with the targets; which of several outputs is the
    prediction only the user knows, so the message shows how to pick it.
    """
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, (tuple, list)):
        pick = "out[0]"
    elif isinstance(outputs, dict):
        pick = f"out[{next(iter(outputs), 'key')!r}]"
    else:
        pick = "the prediction tensor of out"
    raise TypeError(
        f"{name}: the model returned a {describe(outputs)}, not one tensor; the residual "
        f"function needs the prediction: pass residual_fn=lambda out, y: "
        f"so.residuals.{name}({pick}, y) (or pick the output inside the model's forward)"
    )


def _matching_targets(name: str, outputs: Tensor, targets: Tensor | None) -> Tensor:
    """``targets`` reshaped to ``outputs.shape`` and cast to its dtype, after checking them.

    Targets match when they have the outputs' shape up to dimensions of size 1
    (``(batch,)`` targets for ``(batch, 1)`` outputs are fine); anything else would
    be silently broadcast, or reshaped into another layout (channels last for
    channels first), or fail deep inside torch, so it is refused here.
    """
    if targets is None:
        raise TypeError(
            f"{name}: targets is None; pass the targets to step(inputs, targets) or use a "
            "residual_fn that needs none"
        )
    if not isinstance(targets, Tensor):
        raise TypeError(f"{name}: targets must be a tensor, got {describe(targets)}")
    batch = outputs.shape[0] if outputs.ndim else 1
    t_batch = targets.shape[0] if targets.ndim else 1
    if t_batch != batch or targets.numel() != outputs.numel():
        raise ValueError(
            f"{name}: targets of shape {tuple(targets.shape)} do not match the model outputs "
            f"of shape {tuple(outputs.shape)}: each sample needs "
            f"{outputs.numel() // max(batch, 1)} target value(s), got "
            f"{targets.numel() // max(t_batch, 1)}"
        )
    if [d for d in targets.shape if d != 1] != [d for d in outputs.shape if d != 1]:
        raise ValueError(
            f"{name}: targets of shape {tuple(targets.shape)} do not match the model outputs "
            f"of shape {tuple(outputs.shape)}: they hold as many values but in another "
            "layout; permute the targets to the outputs' layout (torch's losses refuse "
            "this too)"
        )
    return targets.reshape(outputs.shape).to(outputs.dtype)


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """Plain residuals ``r = outputs - targets``; ``mean(r²)`` is the mean squared error."""
    outputs = _output_tensor("mse", outputs)
    return outputs - _matching_targets("mse", outputs, targets)


def l1(outputs: Tensor, targets: Tensor, eps: float = 1e-6) -> Tensor:
    """Residuals whose squares are a smoothed absolute error.

    ``r = sign(e)·sqrt(sqrt(e² + eps²) - eps)`` with ``e = outputs - targets``, so
    ``r² = sqrt(e² + eps²) - eps ≈ |e|``.  The smoothing keeps ``r`` differentiable at
    ``e = 0`` (slope ``1/sqrt(2·eps)`` there) where the raw ``sqrt(|e|)`` is not.
    """
    outputs = _output_tensor("l1", outputs)
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
    outputs = _output_tensor("huber", outputs)
    check_number("huber delta", delta, above=0)
    e = outputs - _matching_targets("huber", outputs, targets)
    return _huber_residual(e, float(delta))


def _huber_residual(e: Tensor, delta: float) -> Tensor:
    a = e.abs()
    inside = a <= delta
    # Evaluate the outer branch only where it is used: elsewhere feed it ``delta`` so the
    # root stays positive and its derivative finite (torch.where passes gradients to
    # both branches, and a NaN in the unused one would poison the selected one).
    a_out = torch.where(inside, torch.full_like(a, delta), a)
    outer = torch.sign(e) * torch.sqrt(2.0 * delta * a_out - delta * delta)
    return torch.where(inside, e, outer)


def smooth_l1(outputs: Tensor, targets: Tensor, beta: float = 1.0) -> Tensor:
    """Residuals whose squares are twice torch's smooth L1 loss with threshold ``beta``.

    Smooth L1 is the Huber loss divided by ``beta`` (``½e²/β`` inside ``|e| < β``,
    ``|e| - ½β`` outside), so ``r = huber_r(e, β)/sqrt(β)``.  ``beta = 0`` is the plain
    absolute error: :func:`l1`.
    """
    outputs = _output_tensor("smooth_l1", outputs)
    check_number("smooth_l1 beta", beta, at_least=0)
    if beta == 0:
        return l1(outputs, targets)
    e = outputs - _matching_targets("smooth_l1", outputs, targets)
    return _huber_residual(e, float(beta)) / float(beta) ** 0.5


def cross_entropy(
    logits: Tensor,
    targets: Tensor,
    eps: float = 1e-12,
    *,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Square-root residuals of the softmax cross-entropy, one per sample.

    ``logits`` has shape ``(batch, classes, ...)``; ``targets`` holds class indices of
    shape ``(batch, ...)`` or class probabilities of the logits' shape.  The residual of
    a sample is ``sqrt(CE + eps)``.  ``weight``, ``ignore_index`` and
    ``label_smoothing`` mean what they mean for :func:`torch.nn.functional.cross_entropy`;
    an ignored sample's residual is the constant ``sqrt(eps)``.  The optimizer reports
    torch's mean: ``Σr²`` over ``Σ w[yᵢ]`` of the samples not ignored (over the
    sample count for probability targets), see :mod:`.loss_mean`.
    """
    logits = _output_tensor("cross_entropy", logits)
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
    ce = F.cross_entropy(
        logits,
        targets,
        weight=None if weight is None else weight.to(logits),
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return torch.sqrt(ce + eps)


def binary_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    eps: float = 1e-12,
    *,
    weight: Tensor | None = None,
    pos_weight: Tensor | None = None,
) -> Tensor:
    """Square-root residuals of the binary cross-entropy with logits, one per entry.

    ``r = sqrt(BCE(logits, targets) + eps)``; ``mean(r²)`` is the mean binary
    cross-entropy.  ``targets`` are probabilities in ``[0, 1]``; ``weight`` and
    ``pos_weight`` as for :func:`torch.nn.functional.binary_cross_entropy_with_logits`.
    """
    logits = _output_tensor("binary_cross_entropy", logits)
    t = _matching_targets("binary_cross_entropy", logits, targets)
    bce = F.binary_cross_entropy_with_logits(
        logits,
        t,
        weight=None if weight is None else weight.to(logits),
        pos_weight=None if pos_weight is None else pos_weight.to(logits),
        reduction="none",
    )
    return torch.sqrt(bce + eps)


def binary_cross_entropy_probs(
    probs: Tensor, targets: Tensor, eps: float = 1e-12, *, weight: Tensor | None = None
) -> Tensor:
    """Square-root residuals of the binary cross-entropy of probabilities (``nn.BCELoss``).

    For a model that ends in a sigmoid.  ``r = sqrt(BCE(probs, targets) + eps)``, with
    torch's clamp of each log at -100.  Prefer a model that returns logits and
    :func:`binary_cross_entropy`: it is exact where the sigmoid saturates.
    """
    probs = _output_tensor("binary_cross_entropy_probs", probs)
    t = _matching_targets("binary_cross_entropy_probs", probs, targets)
    bce = F.binary_cross_entropy(
        probs, t, weight=None if weight is None else weight.to(probs), reduction="none"
    )
    return torch.sqrt(bce + eps)


@dataclass(frozen=True)
class LossResidual:
    """The residuals of a torch loss module: ``adapter(outputs, targets, **options)``.

    Built by :func:`from_torch_loss`; ``source`` is the loss it stands for (for
    messages and ``repr``).
    """

    adapter: Callable[..., Tensor]
    source: str
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The residuals of one batch."""
        return self.adapter(outputs, targets, **self.options)

    def __repr__(self) -> str:
        return f"LossResidual({self.source} -> so.residuals.{self.adapter.__name__})"


#: torch losses without a residual form, and what to use instead.
_NO_RESIDUAL_FORM = {
    "NLLLoss": "return logits from the model (drop the LogSoftmax) and use "
    "torch.nn.CrossEntropyLoss() or so.residuals.cross_entropy",
    "KLDivLoss": "for a distillation target, use so.residuals.cross_entropy with "
    "probability targets (it differs from KL by the targets' entropy, a constant)",
}


def _buffer(loss: nn.Module, name: str) -> Tensor | None:
    value = getattr(loss, name, None)
    return value.detach().clone() if isinstance(value, Tensor) else None


def from_torch_loss(loss: nn.Module) -> LossResidual:
    """The residual adapter of a torch loss module, with the loss's parameters.

    ===================================  ==================================================
    ``MSELoss``                          :func:`mse`
    ``L1Loss``                           :func:`l1` (smoothed at 0 by ``eps=1e-6``)
    ``HuberLoss(delta)``                 :func:`huber`
    ``SmoothL1Loss(beta)``               :func:`smooth_l1`
    ``CrossEntropyLoss(weight,           :func:`cross_entropy`
    ignore_index, label_smoothing)``
    ``BCEWithLogitsLoss(weight,          :func:`binary_cross_entropy`
    pos_weight)``
    ``BCELoss(weight)``                  :func:`binary_cross_entropy_probs`
    ===================================  ==================================================

    ``reduction`` must be ``"mean"`` or ``"sum"`` (a constant factor on ``½‖r‖²``);
    ``"none"`` returns per-element losses that LM would square again, minimising
    their squares (the fourth power of an error), so it is refused, as is every
    other loss (:class:`ValueError` naming the adapter to use).
    """
    name = type(loss).__name__
    source = f"torch.nn.{name}"
    torch_class = getattr(nn, name, None)
    if torch_class is None or type(loss).forward is not torch_class.forward:
        raise TypeError(
            f"residual_fn={type(loss).__qualname__}() is a torch loss module secondorder "
            "cannot map (its forward is not one of torch's losses); pass a function "
            "(outputs, targets) -> residuals, one row per sample, whose squares sum to "
            "the loss (see secondorder.residuals)"
        )
    reduction = getattr(loss, "reduction", None)
    if name in _NO_RESIDUAL_FORM or name not in _MAPPED:
        hint = _NO_RESIDUAL_FORM.get(
            name,
            "write residual_fn=(outputs, targets) -> residuals whose squares sum to the loss, "
            "e.g. torch.sqrt(per_sample_loss + 1e-12) for a loss >= 0",
        )
        raise ValueError(
            f"residual_fn={source}() has no residual form secondorder maps (it maps "
            f"{', '.join(sorted(_MAPPED))}); {hint}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"residual_fn={source}(reduction={reduction!r}) is refused: LevenbergMarquardt "
            "squares the residuals it is given, so per-element losses would be squared "
            "again (minimising the fourth power of an error); use reduction='mean' or "
            f"'sum' (the same residuals), or residual_fn=so.residuals.{_MAPPED[name].__name__}"
        )
    options: dict[str, Any] = {}
    adapter = _MAPPED[name]
    if name == "HuberLoss":
        options["delta"] = float(getattr(loss, "delta"))  # noqa: B009
    elif name == "SmoothL1Loss":
        options["beta"] = float(getattr(loss, "beta"))  # noqa: B009
    elif name == "CrossEntropyLoss":
        options.update(
            weight=_buffer(loss, "weight"),
            ignore_index=int(getattr(loss, "ignore_index")),  # noqa: B009
            label_smoothing=float(getattr(loss, "label_smoothing")),  # noqa: B009
        )
    elif name == "BCEWithLogitsLoss":
        options.update(weight=_buffer(loss, "weight"), pos_weight=_buffer(loss, "pos_weight"))
    elif name == "BCELoss":
        options["weight"] = _buffer(loss, "weight")
    args = ", ".join(
        f"{k}=<tensor of shape {tuple(v.shape)}>" if isinstance(v, Tensor) else f"{k}={v!r}"
        for k, v in options.items()
        if v is not None
    )
    return LossResidual(adapter, f"{source}({args})", options)


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


#: The torch losses :func:`from_torch_loss` maps, and their adapters.
_MAPPED: dict[str, Callable[..., Tensor]] = {
    "MSELoss": mse,
    "L1Loss": l1,
    "HuberLoss": huber,
    "SmoothL1Loss": smooth_l1,
    "CrossEntropyLoss": cross_entropy,
    "BCEWithLogitsLoss": binary_cross_entropy,
    "BCELoss": binary_cross_entropy_probs,
}
