"""What a pass over one batch needs to know of it: :class:`BatchWalk`.

:class:`~secondorder.lm.problem.ModelProblem` walks the batch to linearise it; two
other passes walk the same slices with the same replicas and reduce through the same
reducer: the geodesic acceleration's second directional derivative
(:mod:`.geodesic`) and the K-FAC statistics of CG's preconditioner (:mod:`.kfac_cg`).
They read the problem through this protocol, so they depend on what a walk needs and
not on the problem's module, which calls them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torch import Tensor

from ..distributed import Reducer
from ..distributed.devices import DeviceGroup
from .model import ModelEvaluator, ModelFunction

__all__ = ["BatchWalk"]


class BatchWalk(Protocol):
    """One batch's slices, the replicas that evaluate them and the ranks' reducer."""

    function: ModelFunction
    #: Whether J's rows stay with the participant that computed them.
    rows_sharded: bool
    #: Residuals of each slice at the last linearisation (this rank's).
    slice_counts: list[int] | None

    @property
    def names(self) -> list[str]:
        """The parameters' names, in the order of x."""
        ...

    @property
    def n(self) -> int:
        """The number of unknowns (x's length)."""
        ...

    @property
    def reducer(self) -> Reducer:
        """The ranks' reducer: every collective of a walk goes through it."""
        ...

    @property
    def group(self) -> DeviceGroup:
        """The devices of this process that share the slices."""
        ...

    @property
    def replicas(self) -> list[ModelEvaluator]:
        """One model evaluator per device of :attr:`group`."""
        ...

    def unflatten(self, x: Tensor) -> dict[str, Tensor]:
        """X as the model's parameters, by name."""
        ...

    def slices(self) -> Iterator[tuple[Any, Any]]:
        """The batch's ``(inputs, targets)`` slices, in order."""
        ...
