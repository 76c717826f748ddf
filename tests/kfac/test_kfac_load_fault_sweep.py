"""A Ctrl-C at any point of one rank's checkpoint load: every rank refuses it.

On 2 real gloo ranks (a 30 s collective timeout), each load is tried once per torch
call rank 0 makes in it (:class:`~tests.kfac.faults.Sweep`) and once per line of its
assignments (:class:`~tests.kfac.faults.LineSweep`), with a ``KeyboardInterrupt``
raised there on rank 0 only.  Rank 0 must raise the
interrupt, rank 1 :class:`~secondorder.distributed.RankFailedError`, and both ranks'
state must be bitwise as before.  A clean load then runs and must equal the same load
into an object that never failed.  :meth:`KFAC.load_state_dict` (recomputing the
decompositions), :meth:`KFACOptimizer.load_state_dict` and KAISA's drop-in (with its
hyperparameters).  Before, the ranks agreed and then assigned: a rank interrupted
while assigning put its state back and raised while the others kept the loaded one.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from secondorder.compat.kfac import KAISAConventionWarning, KFACPreconditioner
from secondorder.kfac import KFAC, KFACOptimizer
from secondorder.testing import run_ranks
from tests.kfac.faults import LineSweep, Sweep, backprop, interrupt_each_call, same, state_of

pytestmark = pytest.mark.distributed

DT = torch.float64


def build(kind: str, net: nn.Module) -> Any:
    if kind == "KFAC":
        return KFAC(net, damping=0.1, inv_dtype=DT, grad_worker_fraction="mem-opt")
    if kind == "KFACOptimizer":
        return KFACOptimizer(net, lr=0.1, damping=0.1, inv_dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KAISAConventionWarning)
        return KFACPreconditioner(net, damping=0.1, inv_dtype=DT, lr=0.2)


def everything(obj: Any, net: nn.Module) -> dict[str, Any]:
    kfac = obj if isinstance(obj, KFAC) else obj.kfac
    out = state_of(kfac, net)
    if isinstance(obj, KFACOptimizer):
        out["sgd"] = copy.deepcopy(torch.optim.SGD.state_dict(obj))
    if isinstance(obj, KFACPreconditioner):
        out["compat"] = {k: v for k, v in vars(obj).items() if k.startswith("_") and k != "_at"}
    return out


def trained(kind: str, rank: int, world: int, steps: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    obj = build(kind, net)
    for i in range(steps):
        backprop(net, i, rank, world)
        obj.step()
    return net, obj


def sweep(rank: int, world: int, kind: str, mode: str) -> dict[str, Any]:
    _, source = trained(kind, rank, world, 3)
    state = source.state_dict()
    if kind == "KFACPreconditioner":
        state["damping"] = 0.05  # a hyperparameter the load sets too
    net, obj = trained(kind, rank, world, 1)
    ref_net, ref = trained(kind, rank, world, 1)

    def load(target: Any) -> Callable[[], None]:
        # the copy is made before the sweep: only the load's own calls are counted
        own = copy.deepcopy(state)
        if kind == "KFAC":
            return lambda: target.load_state_dict(own, recompute=True)
        return lambda: target.load_state_dict(own)

    counter = MODES[mode]()
    clean = load(ref)
    with counter:
        clean()
    n = torch.tensor([float(counter.calls)], dtype=DT)
    dist.broadcast(n, 0)
    wrong = interrupt_each_call(
        int(n), rank, MODES[mode], lambda: load(obj), lambda: everything(obj, net), "loaded"
    )
    if not wrong:
        load(obj)()
    return {
        "calls": int(n),
        "wrong": wrong,
        "clean load equals": not wrong and same(everything(obj, net), everything(ref, ref_net)),
    }


KINDS = ["KFAC", "KFACOptimizer", "KFACPreconditioner"]
#: every torch call of the load; every line of its assignments (which call no torch function)
MODES: dict[str, Any] = {
    "torch calls": Sweep,
    "commit lines": lambda at=None: LineSweep(at, within=("_assign", "after")),
}


def job(rank: int, world: int) -> dict[str, Any]:
    return {(kind, mode): sweep(rank, world, kind, mode) for kind in KINDS for mode in MODES}


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    out = run_ranks(job, 2, timeout_s=30, deadline_s=600)
    return {r: res.unwrap() for r, res in out.items()}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_an_interrupt_at_any_point_of_one_ranks_load_is_refused_by_every_rank(
    results: dict[int, Any], kind: str, mode: str
) -> None:
    for rank in (0, 1):
        r = results[rank][kind, mode]
        assert r["calls"] > 20
        assert r["wrong"] == [], (rank, r["wrong"])
        assert r["clean load equals"]
