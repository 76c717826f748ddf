"""Train a PyTorch Lightning ``LightningModule`` with Levenberg-Marquardt.

LM computes its own loss, Jacobian and update inside ``optimizer.step(inputs,
targets)``: there is no ``loss.backward()`` for Lightning to run, so the module uses
Lightning's *manual optimization*.  Two ways to wire it, both needing only that
``configure_optimizers`` returns one :class:`~secondorder.lm.LevenbergMarquardt`:

Put :class:`LevenbergMarquardtMixin` before ``LightningModule`` in the bases; it
switches automatic optimization off and supplies ``training_step``::

    import lightning as L
    import secondorder as so
    from secondorder.integrations.lightning import LevenbergMarquardtMixin

    class Regressor(LevenbergMarquardtMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(),
                                           torch.nn.Linear(32, 1))

        def forward(self, x):
            return self.net(x)

        def configure_optimizers(self):
            return so.LevenbergMarquardt(self.net, so.residuals.mse)

    L.Trainer(max_epochs=50).fit(Regressor(), loader)

Or keep your own ``training_step`` (set ``self.automatic_optimization = False`` in
``__init__``) and call :func:`lm_training_step` from it.  With automatic optimization
left on, Lightning calls ``optimizer.step(closure=...)`` itself and the LM optimizer
refuses it (``unexpected keyword argument 'closure'``): that error means the flag is
missing.

Each call runs one LM iteration on the batch, counts as one optimizer step for the
Trainer (``global_step``, ``max_steps``, step-wise logging and checkpointing), logs
the loss, λ and attempts with ``self.log`` (shown on the progress bar), and sets
``trainer.should_stop`` when the optimizer reports ``terminated``.  Lightning itself
is imported nowhere in this module: ``pip install 'secondorder[lightning]'`` (or an
existing ``lightning`` / ``pytorch_lightning`` install) is needed only to run it.
"""

from __future__ import annotations

from typing import Any

from ..lm.optimizer import LevenbergMarquardt, StepInfo
from ..training.data import split_batch

__all__ = ["LevenbergMarquardtMixin", "lm_training_step"]


def _lm_optimizer(module: Any) -> LevenbergMarquardt:
    if not callable(getattr(module, "optimizers", None)):
        raise TypeError(
            f"module must be a LightningModule (with .optimizers()), got {type(module).__name__}"
        )
    opt = module.optimizers(use_pl_optimizer=False)
    if isinstance(opt, (list, tuple)):
        raise ValueError(
            "configure_optimizers must return exactly one secondorder.LevenbergMarquardt, "
            f"got {len(opt)} optimizers"
        )
    if not isinstance(opt, LevenbergMarquardt):
        raise TypeError(
            "configure_optimizers must return a secondorder.LevenbergMarquardt, got "
            f"{type(opt).__name__}"
        )
    return opt


def lm_training_step(
    module: Any,
    batch: Any,
    *,
    log: bool = True,
    prog_bar: bool = True,
    prefix: str = "",
    stop_on_terminated: bool = True,
) -> StepInfo:
    """Run one LM step for a ``LightningModule`` in manual optimization; return its info.

    Call it from ``training_step``.  The module's ``configure_optimizers`` must return
    one :class:`~secondorder.lm.LevenbergMarquardt`; its ``step`` evaluates the model it
    was built with, so the batch is not passed through ``training_step``'s own forward.

    Args:
        module: the ``LightningModule`` (``self`` in ``training_step``), attached to a
            ``Trainer``, with ``automatic_optimization = False``.
        batch: ``(inputs, targets)`` as the ``DataLoader`` yields it (``targets`` may be
            ``None``), or a bare ``inputs`` tensor for residuals without targets.
        log: log ``loss`` (``mean(r²)`` after the step), ``damping`` (λ) and
            ``attempts`` with ``module.log``, at every step.
        prog_bar: show the logged values on Lightning's progress bar.
        prefix: prefix of the logged names, e.g. ``"train/"``.
        stop_on_terminated: set ``trainer.should_stop`` when the step reports
            ``terminated`` (a convergence test fired, or λ reached its maximum); with
            mini-batches a test can fire on one batch, ``False`` keeps going.

    Returns:
        The optimizer's :class:`~secondorder.lm.StepInfo`.
    """
    opt = _lm_optimizer(module)
    inputs, targets = split_batch(batch, "batch")
    # The wrapper Lightning hands out counts optimizer steps for the Trainer through
    # these two hooks; its own step() would call optimizer.step(closure=...), which an
    # LM step (it needs the batch, not a closure) cannot take.
    wrapper = module.optimizers()
    getattr(wrapper, "_on_before_step", lambda: None)()
    info = opt.step(inputs, targets)
    getattr(wrapper, "_on_after_step", lambda: None)()
    if log:
        size = len(inputs) if hasattr(inputs, "__len__") else None
        module.log_dict(
            {
                f"{prefix}loss": info.loss,
                f"{prefix}damping": info.damping,
                f"{prefix}attempts": float(info.attempts),
            },
            prog_bar=prog_bar,
            on_step=True,
            on_epoch=False,
            batch_size=size,
        )
    if stop_on_terminated and info.terminated:
        module.trainer.should_stop = True
    return info


class LevenbergMarquardtMixin:
    """Mixin that trains a ``LightningModule`` with the LM optimizer it configures.

    List it *before* ``LightningModule`` in the bases.  It turns automatic
    optimization off and provides ``training_step``, which runs one
    :func:`lm_training_step` per batch.  Override ``training_step`` to do more (and
    call :func:`lm_training_step` yourself); set the class attributes to change its
    logging and stopping.

    Attributes:
        lm_log: log loss, λ and attempts every step.
        lm_prog_bar: show them on the progress bar.
        lm_stop_on_terminated: stop the Trainer when the optimizer terminates.
    """

    lm_log: bool = True
    lm_prog_bar: bool = True
    lm_stop_on_terminated: bool = True

    @property
    def automatic_optimization(self) -> bool:
        """Always ``False``: the LM step computes the loss and the update itself."""
        return False

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        if value:
            raise ValueError(
                "LevenbergMarquardtMixin trains with manual optimization; "
                "automatic_optimization cannot be set to True"
            )

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One LM step on the batch (see :func:`lm_training_step`)."""
        lm_training_step(
            self,
            batch,
            log=self.lm_log,
            prog_bar=self.lm_prog_bar,
            stop_on_terminated=self.lm_stop_on_terminated,
        )
