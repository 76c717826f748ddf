"""Many small independent fits in one call, on any torch device.

:func:`curve_fit_batch` and :func:`least_squares_batch` run scipy's ``curve_fit`` and
``least_squares`` on a batch of fits at once: one model call per attempt for every
fit, each fit with its own λ, status and covariance.  Modules: :mod:`.api` (the two
functions), :mod:`.arguments` (checking and converting their arguments),
:mod:`.driver` (chunks, compaction and host reads), :mod:`.compiled` (``compile=True``:
refilled slots), :mod:`.engine` (one masked attempt), :mod:`.rule` (the trust-region
decisions), :mod:`.problem` (residuals, Jacobians, objectives), :mod:`.small_linalg`
and :mod:`.covariance`.
"""

from .api import BATCH_MESSAGES, ESTIMATORS, BatchResult, curve_fit_batch, least_squares_batch
from .rule import BatchTrustRegion, RuleState

__all__ = [
    "BATCH_MESSAGES",
    "ESTIMATORS",
    "BatchResult",
    "BatchTrustRegion",
    "RuleState",
    "curve_fit_batch",
    "least_squares_batch",
]
