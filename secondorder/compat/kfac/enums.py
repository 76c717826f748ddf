"""kfac-pytorch's ``kfac.enums``: the same members as :mod:`secondorder.kfac.enums`."""

from __future__ import annotations

from ...kfac.enums import (
    AllreduceMethod,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    parse,
)

__all__ = [
    "AllreduceMethod",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "parse",
]
