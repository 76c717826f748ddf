"""What the step's helpers read and write of a K-FAC preconditioner: :class:`KFACParts`.

The broadcasts (:mod:`.exchange`), the checkpoint loader (:mod:`.loading`) and the
step's snapshot (:mod:`.transaction`) each work on the preconditioner's layers,
configuration, work assignment and counters. They take it through this protocol,
which :class:`~secondorder.kfac.KFAC` satisfies, so the preconditioner imports them
and none of them imports it back.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..distributed import Reducer
from .assignment import WorkAssignment
from .config import KFACConfig
from .hooks import StatsCapture
from .layers import KFACLayer

__all__ = ["KFACParts"]


class KFACParts(Protocol):
    """The preconditioner's state that the step's helpers share."""

    config: KFACConfig
    reducer: Reducer
    layers: dict[str, KFACLayer]
    assignment: WorkAssignment
    #: Steps taken, the damping a checkpoint fixed, factor updates skipped as non-finite.
    steps: int
    damping_override: float | None
    skipped_factor_updates: int
    #: The forward/backward statistics capture, and the reducers of each layer's
    #: workers and of its receivers (split from ``reducer`` by the assignment).
    _capture: StatsCapture
    _workers: Reducer
    _receivers: Reducer
    #: where the ranks' agreement tables live.
    _device: torch.device
