"""K-FAC with KAISA's distribution strategies.

* :class:`KFAC`: the preconditioner (rewrites ``.grad``; any ``torch.optim`` follows).
* :class:`KFACOptimizer`: K-FAC + SGD with momentum, optionally with adaptive damping.
* :func:`~secondorder.kfac.assignment.assign_work`: which rank decomposes which layer.
"""

from __future__ import annotations

from .assignment import WorkAssignment, assign_work
from .config import KFACConfig
from .damping import LMDampingRule
from .discovery import SUPPORTED_MODULES
from .optimizer import KFACOptimizer
from .preconditioner import KFAC

__all__ = [
    "KFAC",
    "SUPPORTED_MODULES",
    "KFACConfig",
    "KFACOptimizer",
    "LMDampingRule",
    "WorkAssignment",
    "assign_work",
]
