"""Test support shipped with secondorder: run a function on real ``torch.distributed`` ranks.

:func:`run_ranks` starts ``world`` fresh Python processes on this machine, joins them
in a gloo process group (NCCL with ``backend="nccl"``) and calls one importable
function on every rank; it returns what each rank returned, or raises
:class:`RankError` naming the rank that failed.
The LM, K-FAC and Shampoo tests compare these results with a single-process run on
the concatenated batch.  :mod:`secondorder.testing.syncs` counts the host reads a
step makes, for tests that promise a step which does not wait for the device.
"""

from .distributed import RankError, RankResult, run_ranks

__all__ = ["RankError", "RankResult", "run_ranks"]
