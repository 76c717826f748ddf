"""What the reported loss is a mean over: the residual count, or torch's weighted count.

The optimizer reports ``Σr² / count``, the mean over residual entries, which is the
familiar loss for every adapter in :mod:`~secondorder.lm.residuals` but one:
:func:`torch.nn.functional.cross_entropy` with class-index targets divides its sum by
the weight of the targets it counts, ``Σᵢ w[yᵢ]`` over the samples whose target is not
``ignore_index`` (the count of those samples without ``weight``).  :class:`LossMean`
computes that denominator for the :func:`~secondorder.lm.residuals.cross_entropy`
adapter (called directly, through :func:`functools.partial`, or mapped from
``torch.nn.CrossEntropyLoss(weight=..., ignore_index=...)``), so the reported loss is
torch's on the same batch.  The denominator is a sum over samples: slices and ranks add
theirs, and the mean is taken once, over the whole batch.  Only the report changes;
the minimiser and every decision are those of ``½‖r‖²``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .residuals import LossResidual, cross_entropy

__all__ = ["LossMean"]


@dataclass
class LossMean:
    """The denominator of cross-entropy's mean: ``Σ w[yᵢ]`` over targets not ignored.

    Built once per optimizer (:class:`~secondorder.lm.model.ModelFunction`), so the
    weights are copied to a device once: later steps (a captured one too) only read them.

    Attributes:
        weight: the class weights (``None``: every class weighs 1).
        ignore_index: the target value that is not counted.
    """

    weight: Tensor | None
    ignore_index: int
    _placed: dict[torch.device, Tensor] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def of(residual_fn: Any) -> LossMean | None:
        """The mean of ``residual_fn``'s loss, or ``None`` for a mean over its residuals.

        Unwraps :class:`~secondorder.lm.residuals.LossResidual` and
        :func:`functools.partial` (the outer keywords win, as in a call) down to
        :func:`~secondorder.lm.residuals.cross_entropy`.
        """
        options: dict[str, Any] = {}
        fn = residual_fn
        while isinstance(fn, (functools.partial, LossResidual)):
            if isinstance(fn, LossResidual):
                options = {**fn.options, **options}
                fn = fn.adapter
            else:
                options = {**fn.keywords, **options}
                fn = fn.func
        if fn is not cross_entropy:
            return None
        weight = options.get("weight")
        return LossMean(
            weight=weight.detach() if isinstance(weight, Tensor) else None,
            ignore_index=int(options.get("ignore_index", -100)),
        )

    def total(self, targets: Any, count: int, device: torch.device) -> Tensor:
        """The denominator of this batch's mean, a 0-d float64 tensor on ``device``.

        ``count``: the batch's residual entries, the denominator of probability targets
        (torch's mean over them whatever the weights).  Stays on the device: no read.
        """
        wide = torch.float64
        if not isinstance(targets, Tensor) or targets.is_floating_point():
            return torch.full((), float(count), dtype=wide, device=device)
        labels = targets.long()
        kept = labels != self.ignore_index
        if self.weight is None:
            return kept.sum(dtype=wide).to(device)
        weight = self._placed.get(labels.device)
        if weight is None:
            weight = self._placed[labels.device] = self.weight.to(labels.device, wide)
        # An ignored target may lie outside the classes: look up class 0 for it, weighed 0.
        picked = weight[torch.where(kept, labels, 0)]
        return torch.where(kept, picked, 0.0).sum().to(device)
