"""A drop-in for kfac-pytorch (KAISA) users: one changed import.

``from kfac.preconditioner import KFACPreconditioner`` becomes
``from secondorder.compat.kfac.preconditioner import KFACPreconditioner``, and ``import
kfac`` becomes ``import secondorder.compat.kfac as kfac`` (``kfac.preconditioner``,
``kfac.enums``, ``kfac.scheduler``, ``kfac.hyperparams`` keep their names).  See
:mod:`.preconditioner` for what is converted and what differs.
"""

from __future__ import annotations

from . import enums, hyperparams, preconditioner, scheduler
from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy
from .preconditioner import KAISAConventionWarning, KFACPreconditioner
from .scheduler import LambdaParamScheduler

__all__ = [
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "KAISAConventionWarning",
    "KFACPreconditioner",
    "LambdaParamScheduler",
    "enums",
    "hyperparams",
    "preconditioner",
    "scheduler",
]
