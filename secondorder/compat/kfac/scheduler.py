"""kfac-pytorch's ``LambdaParamScheduler``: multiply hyperparameters by a factor per step."""

from __future__ import annotations

from collections.abc import Callable

from .arguments import check_scheduled
from .preconditioner import KFACPreconditioner

__all__ = ["LambdaParamScheduler"]

_NAMES = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")
_INTEGER = ("factor_update_steps", "inv_update_steps")


class LambdaParamScheduler:
    """At each :meth:`step`, multiply each scheduled hyperparameter by ``lambda(step)``.

    ``<name>_lambda`` (for ``factor_update_steps``, ``inv_update_steps``, ``damping``,
    ``factor_decay``, ``kl_clip``, ``lr``) returns the factor for the preconditioner's
    step count (or the ``step`` passed to :meth:`step`); the update intervals are
    truncated to integers, as in kfac-pytorch.  A hyperparameter that is already a
    callable cannot also be scheduled here.  Call :meth:`step` after the
    preconditioner's.
    """

    def __init__(
        self,
        preconditioner: KFACPreconditioner,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        given = {
            "factor_update_steps": factor_update_steps_lambda,
            "inv_update_steps": inv_update_steps_lambda,
            "damping": damping_lambda,
            "factor_decay": factor_decay_lambda,
            "kl_clip": kl_clip_lambda,
            "lr": lr_lambda,
        }
        for name, fn in given.items():
            if fn is not None and callable(getattr(preconditioner, "_" + name)):
                raise ValueError(
                    f"Invalid {name}_lambda: preconditioner.{name} is already a callable, so "
                    "it cannot also be scheduled; pass a number to the preconditioner or drop "
                    f"{name}_lambda."
                )
        self._preconditioner = preconditioner
        self._lambdas = {k: v for k, v in given.items() if v is not None}

    def step(self, step: int | None = None) -> None:
        """Apply every lambda once, at ``step`` (default: the preconditioner's step count)."""
        p = self._preconditioner
        at = p.steps if step is None else step
        new = {}
        for name, fn in self._lambdas.items():
            value = getattr(p, "_" + name) * fn(at)
            new[name] = int(value) if name in _INTEGER else value
        # every new value checked before any is set: a refused one changes nothing
        for name, value in new.items():
            try:
                check_scheduled(name, value)
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f"{exc} (from {name}_lambda at step {at}; no hyperparameter was changed)"
                ) from exc
        for name, value in new.items():
            setattr(p, "_" + name, value)
