"""A Ctrl-C at any point of one rank's K-FAC step: every rank refuses the step.

On 2 real gloo ranks (a 30 s collective timeout), a first pass counts the torch calls
rank 0 makes in one step (:class:`~tests.kfac.faults.Sweep`, PyTorch's own dispatch
hook), and the lines of its commit (:class:`~tests.kfac.faults.LineSweep`: the
writes call few torch functions); then the step is tried once per call (or line),
with a ``KeyboardInterrupt`` raised there on rank 0 only.  After each try, rank 0
must have raised the interrupt and rank 1
:class:`~secondorder.distributed.RankFailedError` (not a collective timeout), and both
ranks' K-FAC, parameters and ``.grad`` must be bitwise as before the try.  Finally the
step runs without a fault and must equal the same step of a K-FAC that never failed
(bitwise).  COMM-OPT (the decompositions are broadcast) and MEM-OPT (the
preconditioned gradients are broadcast), with the KL clip on.

Out of reach, and left out of the sweep: calls inside the reducer's collectives
(:mod:`secondorder.distributed` packs tensors there), and the read of an agreement's
all-reduced table: a rank interrupted there has nobody left to tell.  The old step
let rank 1 wait for a broadcast that rank 0 never reached (a fault in allocating a
receive buffer), or commit a step that rank 0 refused (a fault in the KL clip's sum
or while writing ``.grad``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from secondorder.kfac import KFAC
from secondorder.testing import run_ranks
from tests.kfac.faults import LineSweep, Sweep, backprop, interrupt_each_call, same, state_of

pytestmark = pytest.mark.distributed

DT = torch.float64


def make(fraction: Any) -> tuple[nn.Sequential, KFAC]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    kfac = KFAC(net, damping=0.1, kl_clip=1e-2, inv_dtype=DT, grad_worker_fraction=fraction)
    return net, kfac


def sweep(rank: int, world: int, fraction: Any, mode: str) -> dict[str, Any]:
    """Rank 0 is interrupted at each of its calls in turn; what each rank saw."""
    net, kfac = make(fraction)
    ref_net, ref = make(fraction)
    for m, k in ((net, kfac), (ref_net, ref)):
        backprop(m, 0, rank, world)
        k.step()
        backprop(m, 1, rank, world)
    counter = MODES[mode]()
    with counter:
        ref.step()  # the clean step, counted (the same calls as kfac's on rank 0)
    n = torch.tensor([float(counter.calls)], dtype=DT)
    dist.broadcast(n, 0)
    calls = int(n)
    wrong = interrupt_each_call(
        calls, rank, MODES[mode], lambda: kfac.step, lambda: state_of(kfac, net), "stepped"
    )
    if not wrong:
        kfac.step()
    return {
        "calls": calls,
        "wrong": wrong,
        "retry equals clean": not wrong and same(state_of(kfac, net), state_of(ref, ref_net)),
    }


def job(rank: int, world: int) -> dict[str, Any]:
    return {
        (name, mode): sweep(rank, world, fraction, mode)
        for name, fraction in FRACTIONS.items()
        for mode in MODES
    }


FRACTIONS = {"comm-opt": 1.0, "mem-opt": "mem-opt"}
#: every torch call of the step; every line of its commit (which calls few torch functions)
MODES: dict[str, Any] = {
    "torch calls": Sweep,
    "commit lines": lambda at=None: LineSweep(at, within=("_commit",)),
}


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    out = run_ranks(job, 2, timeout_s=30, deadline_s=600)
    return {r: res.unwrap() for r, res in out.items()}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("strategy", list(FRACTIONS))
def test_an_interrupt_at_any_point_of_one_rank_is_refused_by_every_rank(
    results: dict[int, Any], strategy: str, mode: str
) -> None:
    for rank in (0, 1):
        r = results[rank][strategy, mode]
        assert r["calls"] > 100  # the sweep saw the step's work, not an empty step
        assert r["wrong"] == [], (rank, r["wrong"])
        assert r["retry equals clean"]
