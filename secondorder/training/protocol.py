"""The contract between :func:`fit <secondorder.training.fit>` and an optimizer.

``fit`` owns the epochs, the clock, validation, stopping, callbacks and progress; a
:class:`TrainingStep` owns one step on one batch.  Any object with the members below
is driven by ``fit`` as is, so a new optimizer family plugs in by writing one (the
Levenberg-Marquardt and ``torch.optim`` adapters in :mod:`secondorder.training.steps`
are the two examples)::

    class MyStep:
        loss_label = "loss"

        def __init__(self, model, optimizer):
            self.model, self.optimizer = model, optimizer

        def step(self, inputs, targets):
            loss = self.optimizer.my_update(inputs, targets)
            return StepResult(loss=loss, details={"trust_radius": self.optimizer.radius})

        def batch_loss(self, inputs, targets):
            with torch.no_grad():
                return float(my_loss(self.model(inputs), targets)) * len(inputs), len(inputs)

        def describe(self, record):
            return f"loss {record.loss:.3e}"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:
    from .history import StepRecord

__all__ = ["StepResult", "TrainingStep"]


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`TrainingStep.step` reports; ``fit`` adds step, epoch, batch and time.

    Attributes:
        loss: the step's loss (see :attr:`~secondorder.training.StepRecord.loss`).
        loss_before: the loss before the step, where the optimizer measures it.
        terminated: the optimizer considers training finished (``fit`` stops unless
            ``stop_on_terminated=False``).
        reason: how the step ended.
        details: the family's own fields, copied into the record's ``details``.
        info: the optimizer's own report, handed to callbacks as ``info``
            (Levenberg-Marquardt: its :class:`~secondorder.lm.StepInfo`); ``None``
            hands them the :class:`~secondorder.training.StepRecord` instead.
    """

    loss: float
    loss_before: float | None = None
    terminated: bool = False
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    info: Any = None


@runtime_checkable
class TrainingStep(Protocol):
    """One optimizer step per batch, as :func:`~secondorder.training.fit` drives it.

    Attributes:
        model: the module being trained; validation evaluates it and ``restore_best``
            reloads its ``state_dict``.
        optimizer: the object callbacks receive in ``on_train_begin``.
        loss_label: how plots name the loss (e.g. ``"loss (mean r²)"``).
    """

    model: nn.Module
    optimizer: Any
    loss_label: str

    def step(self, inputs: Any, targets: Any) -> StepResult:
        """Update the parameters on one batch and report the step."""
        ...

    def batch_loss(self, inputs: Any, targets: Any) -> tuple[float, float]:
        """``(sum, count)`` of the training loss on a held-out batch, without training.

        ``fit``'s ``metric="loss"`` is the sum over the validation batches divided by
        the count, so the loss is averaged over samples whatever the batch sizes (the
        count may be a weight: torch's weighted cross-entropy divides by one).
        """
        ...

    def describe(self, record: StepRecord) -> str:
        """The progress bar's text for a step, e.g. ``"loss 1.2e-03  λ 1.0e-04"``."""
        ...
