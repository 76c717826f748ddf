"""The two :class:`~secondorder.training.TrainingStep` adapters and the rule that picks one.

* :class:`LMStep` drives :class:`~secondorder.lm.LevenbergMarquardt`, whose
  ``step(inputs, targets)`` evaluates the model and its residuals itself.
* :class:`TorchStep` drives any ``torch.optim.Optimizer`` (SGD, AdamW, LBFGS, Shampoo):
  it runs the loop users otherwise write by hand, ``zero_grad``, forward, ``loss_fn``,
  ``backward``, an optional preconditioner that rewrites ``.grad`` (K-FAC), then
  ``optimizer.step``, all inside the closure LBFGS needs and the others accept.

:func:`as_training_step` picks the adapter from the optimizer's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..lm import LevenbergMarquardt, ModelResidual
from ..lm.loss_mean import LossMean
from .data import batch_size
from .history import StepRecord
from .protocol import StepResult, TrainingStep

__all__ = ["LMStep", "TorchStep", "as_training_step"]


class LMStep:
    """Levenberg-Marquardt as a training step: ``optimizer.step(inputs, targets)``.

    The record's ``details`` hold λ, attempts, acceptance, stage timings and CG
    iterations; callbacks receive the optimizer's :class:`~secondorder.lm.StepInfo`.
    """

    loss_label = "loss (mean r²)"

    def __init__(self, optimizer: LevenbergMarquardt) -> None:
        self.optimizer = optimizer
        self.model: nn.Module = optimizer.model
        #: A :class:`~secondorder.lm.ModelResidual` may couple samples: validation data
        #: is then checked on whole batches, never on their first samples.
        self.couples_samples = isinstance(optimizer.residual_fn, ModelResidual)
        self._mean = LossMean.of(optimizer.residual_fn)

    def step(self, inputs: Any, targets: Any) -> StepResult:
        """One LM step (λ retries included) on the batch."""
        info = self.optimizer.step(inputs, targets)
        details = {
            "damping": info.damping,
            "attempts": info.attempts,
            "accepted": info.accepted,
            "timings": dict(info.timings),
            "cg_iterations": info.cg_iterations,
        }
        return StepResult(
            loss=float(info.loss),
            loss_before=float(info.loss_before),
            terminated=info.terminated,
            reason=info.reason,
            details=details,
            info=info,
        )

    def batch_loss(self, inputs: Any, targets: Any) -> tuple[float, float]:
        """``(Σ r², number of residuals)``: the validation loss is ``mean(r²)``.

        For cross-entropy the count is torch's, the weight of the targets not ignored
        (:mod:`~secondorder.lm.loss_mean`), so the loss is torch's mean over the data.
        """
        residual_fn = self.optimizer.residual_fn
        if isinstance(residual_fn, ModelResidual):
            r = residual_fn.fn(self.model, inputs, targets)
        else:
            with torch.no_grad():
                r = residual_fn(self.model(inputs), targets)
        r = r.detach().reshape(-1).to(torch.float64)  # sum in float64 over many batches
        if self._mean is not None:
            return float(torch.dot(r, r)), float(self._mean.total(targets, r.numel(), r.device))
        return float(torch.dot(r, r)), r.numel()

    def describe(self, record: StepRecord) -> str:
        """Loss, λ and attempts."""
        return f"loss {record.loss:.3e}  λ {record.damping:.1e}  attempts {record.attempts}"


def _hook(preconditioner: Any) -> Callable[[], Any] | None:
    if preconditioner is None:
        return None
    step = getattr(preconditioner, "step", None)
    if callable(step):
        return step
    if callable(preconditioner):
        return preconditioner
    raise TypeError(
        "preconditioner must have a step() method (as K-FAC preconditioners do) or be a "
        f"function of no arguments, got {type(preconditioner).__name__}: {preconditioner!r}"
    )


class TorchStep:
    """A ``torch.optim.Optimizer`` as a training step, with ``loss_fn(model(inputs), targets)``.

    One step is the hand-written loop, run as the optimizer's closure::

        optimizer.zero_grad(); loss = loss_fn(model(inputs), targets); loss.backward()
        preconditioner.step()   # if given: rewrites each .grad (K-FAC)
        optimizer.step()        # LBFGS calls the closure again as it searches

    so the parameters equal those of that loop bitwise.  ``loss`` is the first
    evaluation's (before the update); ``details`` hold ``lr`` (a float, or a tuple with
    several parameter groups) and ``evaluations`` (closure calls: 1, or more for LBFGS).

    Args:
        optimizer: the optimizer, built over (some of) ``model``'s parameters.
        model: the module whose forward pass gives the outputs.
        loss_fn: ``(outputs, targets) -> scalar loss``, averaged over the batch
            (``reduction="mean"``, torch's default), so validation averages over samples.
        preconditioner: an object with ``step()`` or a function of no arguments, called
            after ``backward`` and before ``optimizer.step``.
    """

    loss_label = "loss"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], Tensor],
        preconditioner: Any = None,
    ) -> None:
        self.optimizer = optimizer
        self.model = model
        self.loss_fn = loss_fn
        self._precondition = _hook(preconditioner)

    def _loss(self, inputs: Any, targets: Any) -> Tensor:
        loss = self.loss_fn(self.model(inputs), targets)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {shape}; reduce over the batch "
                "(e.g. reduction='mean')"
            )
        return loss

    def step(self, inputs: Any, targets: Any) -> StepResult:
        """One optimizer step on the batch: the closure computes loss and gradients."""
        losses: list[Tensor] = []

        def closure() -> Tensor:
            self.optimizer.zero_grad()
            loss = self._loss(inputs, targets)
            loss.backward()
            if self._precondition is not None:
                self._precondition()
            losses.append(loss.detach())
            return loss

        self.optimizer.step(closure)  # type: ignore[arg-type]  # torch types it as -> float
        if not losses:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}.step(closure) never called the closure; fit "
                "computes the loss and gradients there, so the optimizer must call it"
            )
        lrs = tuple(float(g["lr"]) for g in self.optimizer.param_groups if "lr" in g)
        details: dict[str, Any] = {"evaluations": len(losses)}
        if lrs:
            details["lr"] = lrs[0] if len(lrs) == 1 else lrs
        return StepResult(loss=float(losses[0]), details=details)

    def batch_loss(self, inputs: Any, targets: Any) -> tuple[float, int]:
        """``(loss × batch size, batch size)``: the validation loss is a per-sample mean."""
        with torch.no_grad():
            loss = self._loss(inputs, targets)
        size = batch_size(inputs, targets)
        return float(loss) * size, size

    def describe(self, record: StepRecord) -> str:
        """Loss, and the learning rate with one parameter group."""
        lr = record.details.get("lr")
        return f"loss {record.loss:.3e}" + (f"  lr {lr:.1e}" if isinstance(lr, float) else "")


def _unused(name: str, value: Any, owner: str) -> None:
    if value is not None:
        raise ValueError(
            f"{name}= is for torch.optim optimizers; {owner} brings its own model, loss and "
            f"update, so leave {name}=None (got {name}={value!r})"
        )


def _torch_step(
    optimizer: torch.optim.Optimizer, model: Any, loss_fn: Any, preconditioner: Any
) -> TorchStep:
    name = type(optimizer).__name__
    missing = [f"{n}=" for n, v in (("model", model), ("loss_fn", loss_fn)) if v is None]
    if missing:
        raise TypeError(
            f"fit needs {' and '.join(missing)} to train {name}, a torch.optim optimizer: "
            "model= is the module whose forward pass gives the outputs, loss_fn= maps "
            "(outputs, targets) to a scalar loss. Without them, optimizer must be a "
            f"secondorder.LevenbergMarquardt, got {name}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (outputs, targets) -> loss, got {loss_fn!r}")
    owned = {id(p) for p in model.parameters()}
    updated = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(id(p) in owned for p in updated):
        raise ValueError(
            f"model holds none of the parameters {name} updates; pass the module the "
            "optimizer was built from"
        )
    return TorchStep(optimizer, model, loss_fn, preconditioner)


def as_training_step(
    optimizer: Any, *, model: Any = None, loss_fn: Any = None, preconditioner: Any = None
) -> TrainingStep:
    """The :class:`~secondorder.training.TrainingStep` that drives ``optimizer``.

    A :class:`~secondorder.lm.LevenbergMarquardt` (or the cuPyLMA ``LMA`` wrapping one)
    becomes an :class:`LMStep`; a ``TrainingStep`` is used as is; a
    ``torch.optim.Optimizer`` becomes a :class:`TorchStep` over ``model`` and
    ``loss_fn``, which it then needs (the other kinds carry their own model and loss;
    passing ``model`` is allowed where it is the optimizer's own).
    """
    lm = optimizer if isinstance(optimizer, LevenbergMarquardt) else None
    wrapped = getattr(optimizer, "optimizer", None)
    custom = isinstance(optimizer, TrainingStep)
    if lm is None and not custom and isinstance(wrapped, LevenbergMarquardt):
        lm = wrapped  # the cuPyLMA drop-in wraps one
    if lm is not None or custom:
        step: TrainingStep = LMStep(lm) if lm is not None else optimizer
        owner = type(lm if lm is not None else optimizer).__name__
        if model is not None and model is not step.model:
            raise ValueError(
                f"model= is not the module this {owner} trains; leave model=None (fit "
                "trains the optimizer's own model)"
            )
        _unused("loss_fn", loss_fn, owner)
        _unused("preconditioner", preconditioner, owner)
        return step
    if isinstance(optimizer, torch.optim.Optimizer):
        return _torch_step(optimizer, model, loss_fn, preconditioner)
    raise TypeError(
        "optimizer must be a secondorder.LevenbergMarquardt, a torch.optim.Optimizer or a "
        f"secondorder.training.TrainingStep, got {type(optimizer).__name__}"
    )
