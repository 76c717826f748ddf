"""What :func:`fit <secondorder.training.fit>` records, step by step and epoch by epoch.

A :class:`StepRecord` per step and an :class:`EpochRecord` per pass over the data are
gathered in a :class:`History`.

A step record holds what every optimizer reports (step, epoch, batch, time, loss,
terminated, reason) as attributes and what only one family reports in ``details``: λ,
attempts and stage timings for Levenberg-Marquardt; the learning rate and the number of
loss evaluations for a ``torch.optim`` optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EpochRecord", "History", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as :func:`~secondorder.training.fit` saw it.

    Attributes:
        step: 1-based count of steps in this :func:`~secondorder.training.fit` call.
        epoch: 1-based epoch the step belongs to.
        batch: 1-based index of the batch within the epoch.
        time: seconds of training since :func:`~secondorder.training.fit` began,
            validation excluded.
        loss: the loss the optimizer reports for the step.  Levenberg-Marquardt:
            ``mean(r²)`` *after* the step.  A ``torch.optim`` optimizer: the loss of the
            forward pass that gave the gradient, so *before* the update (a hand-written
            loop reports the same number; the loss after would cost another forward pass).
        loss_before: the loss before the step, or ``None`` where it is not measured
            separately (``torch.optim`` optimizers: it is ``loss``).
        terminated: whether the optimizer considers training finished.
        reason: how the step ended (empty where the optimizer does not say).
        details: the optimizer family's own fields.  Levenberg-Marquardt: ``damping``
            (λ after the step), ``attempts`` (λ values tried), ``accepted`` (whether the
            parameters changed), ``timings`` (seconds per stage, see
            :class:`~secondorder.lm.StepInfo`) and ``cg_iterations`` (CG solver only).
            ``torch.optim``: ``lr`` (of each parameter group) and ``evaluations`` (loss
            evaluations in the step: 1, or more for LBFGS).  The Levenberg-Marquardt
            fields are also attributes (``record.damping``), as before ``fit`` drove
            other optimizers.
    """

    step: int
    epoch: int
    batch: int
    time: float
    loss: float
    loss_before: float | None = None
    terminated: bool = False
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def _detail(self, name: str) -> Any:
        if name not in self.details:
            raise AttributeError(
                f"StepRecord.{name} is a Levenberg-Marquardt detail; this step's optimizer "
                f"reported {sorted(self.details)} in record.details"
            )
        return self.details[name]

    @property
    def damping(self) -> float:
        """λ after the step (Levenberg-Marquardt)."""
        return float(self._detail("damping"))

    @property
    def attempts(self) -> int:
        """λ values tried in the step (Levenberg-Marquardt)."""
        return int(self._detail("attempts"))

    @property
    def accepted(self) -> bool:
        """Whether the step changed the parameters (Levenberg-Marquardt)."""
        return bool(self._detail("accepted"))

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per stage of the step (Levenberg-Marquardt)."""
        timings: dict[str, float] = self._detail("timings")
        return timings

    @property
    def cg_iterations(self) -> int:
        """Conjugate-gradient iterations (Levenberg-Marquardt with the CG solver)."""
        return int(self._detail("cg_iterations"))


@dataclass(frozen=True)
class EpochRecord:
    """One pass over the data.

    Attributes:
        epoch: 1-based epoch number.
        step: the last step of the epoch.
        time: seconds of training at the end of the epoch, validation excluded.
        loss: mean of the epoch's step losses.
        validation: the validation metric after the epoch, or ``None``.
    """

    epoch: int
    step: int
    time: float
    loss: float
    validation: float | None = None


@dataclass
class History:
    """What :func:`~secondorder.training.fit` did: every step, every epoch, why it stopped.

    Attributes:
        steps: one :class:`StepRecord` per optimizer step.
        epochs: one :class:`EpochRecord` per completed epoch.
        stop_reason: why training ended.
        metric: the name of the validation metric (``None`` without validation).
        best_validation, best_epoch: the best validation value and its epoch.
        loss_label: what the loss is, as the plot's axis names it.
    """

    steps: list[StepRecord] = field(default_factory=list)
    epochs: list[EpochRecord] = field(default_factory=list)
    stop_reason: str = ""
    metric: str | None = None
    best_validation: float | None = None
    best_epoch: int | None = None
    loss_label: str = "loss (mean r²)"

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def loss(self) -> list[float]:
        """Loss of each step (see :attr:`StepRecord.loss`)."""
        return [s.loss for s in self.steps]

    @property
    def time(self) -> list[float]:
        """Training seconds at the end of each step."""
        return [s.time for s in self.steps]

    @property
    def validation(self) -> list[float | None]:
        """Validation metric after each epoch (``None`` where it was not measured)."""
        return [e.validation for e in self.epochs]

    def plot(
        self,
        x: str = "time",
        *,
        path: str | Path | None = None,
        ax: Any = None,
        label: str | None = None,
        logy: bool = True,
    ) -> Any:
        """Plot the loss, and the validation metric if there is one, against time or steps.

        Needs matplotlib (``pip install 'secondorder[plot]'``), imported only here.

        Args:
            x: ``"time"`` (training seconds) or ``"step"``.
            path: if given, save the figure there (PNG, PDF, SVG, ... by extension).
            ax: draw the loss on this matplotlib ``Axes`` instead of a new figure, for
                example to compare several runs on one plot.
            label: legend label of the loss curve.
            logy: logarithmic loss axis.

        Returns:
            The matplotlib ``Figure``.
        """
        if x not in ("time", "step"):
            raise ValueError(f"Unknown x={x!r}; valid choices are ('time', 'step').")
        if not self.steps:
            raise ValueError("history is empty: fit ran no steps, there is nothing to plot")
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "History.plot needs matplotlib; install it with "
                "`pip install matplotlib` or `pip install 'secondorder[plot]'`"
            ) from exc
        validation = [e for e in self.epochs if e.validation is not None]
        if ax is None:
            ncols = 2 if validation else 1
            fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4), squeeze=False)
            ax, vax = axes[0][0], (axes[0][1] if validation else None)
        else:
            fig, vax = ax.figure, None
        xs: list[float] = [s.time if x == "time" else s.step for s in self.steps]
        ys = self.loss
        before = self.steps[0].loss_before
        if before is not None:  # the curve starts at the loss before the first step
            xs, ys = [0.0 if x == "time" else 0, *xs], [before, *ys]
        xlabel = "training time (s)" if x == "time" else "step"
        (ax.semilogy if logy else ax.plot)(xs, ys, label=label or "training loss")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(self.loss_label)
        ax.grid(True, which="both", alpha=0.3)
        if label is not None:
            ax.legend()
        if vax is not None:
            vx = [e.time if x == "time" else e.step for e in validation]
            vax.plot(vx, [e.validation for e in validation], marker=".", label=self.metric)
            vax.set_xlabel(xlabel)
            vax.set_ylabel(f"validation {self.metric}")
            vax.grid(True, alpha=0.3)
        fig.tight_layout()
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
        return fig
