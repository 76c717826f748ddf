"""On real gloo ranks, what one rank refuses or is interrupted in, every rank refuses.

A Ctrl-C in one rank's eigendecomposition, a damaged checkpoint on one rank (for
:class:`KFAC` and :class:`KFACOptimizer`), an interrupt while one rank recomputes the
loaded decompositions, a closure of adaptive damping that raises on one rank
(before and after the update), a Ctrl-C in one rank's SGD update and a plain closure
that raises on one rank: every rank raises (the failing one its own error, the
others :class:`~secondorder.distributed.RankFailedError`), none hangs, and every
rank's state is bitwise what it was.  2 ranks, a 30 s collective timeout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from secondorder.distributed import RankFailedError
from secondorder.kfac import KFAC, KFACOptimizer
from tests.kfac.faults import Fault, same, state_of

pytestmark = pytest.mark.distributed

DT = torch.float64


def make(**kw: Any) -> tuple[nn.Sequential, KFAC]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    settings: dict[str, Any] = {"damping": 0.1, "kl_clip": 1e-2, "inv_dtype": DT}
    settings.update(kw)
    return net, KFAC(net, **settings)


def batch(i: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 4, generator=g, dtype=DT), torch.randn(8, 3, generator=g, dtype=DT)
    b = 8 // world
    return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]


def backprop(net: nn.Module, i: int, rank: int, world: int) -> None:
    x, y = batch(i, rank, world)
    net.zero_grad()
    (0.5 * (net(x) - y).pow(2).sum(1).mean()).backward()
    for p in net.parameters():
        if p.grad is not None and world > 1:
            dist.all_reduce(p.grad)
            p.grad /= world


def attempt(fn: Callable[[], Any]) -> tuple[str, str, bool]:
    """What ``fn`` raised: its class name, message, and whether it is a RankFailedError."""
    try:
        fn()
    except BaseException as exc:  # a KeyboardInterrupt is an outcome here
        return type(exc).__name__, str(exc), isinstance(exc, RankFailedError)
    return "returned", "", False


def interrupted_step(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 gets a Ctrl-C in its second eigendecomposition of the second step."""
    net, k = make()
    ref_net, ref = make()
    for m, kfac in ((net, k), (ref_net, ref)):
        backprop(m, 0, rank, world)
        kfac.step()
        backprop(m, 1, rank, world)
    before = state_of(k, net)

    def step() -> None:
        if rank == 0:
            with Fault(torch.linalg.eigh, KeyboardInterrupt("Ctrl-C on rank 0"), at=2):
                k.step()
        else:
            k.step()

    out: dict[str, Any] = {"outcome": attempt(step), "unchanged": same(state_of(k, net), before)}
    k.step()  # the retry
    ref.step()
    out["retry_equals_clean"] = same(state_of(k, net), state_of(ref, ref_net))
    return out


def damaged(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with layer '0''s A indefinite, its diagonal intact."""
    a = state["layers"]["0"]["A"].clone()
    d = a[0].diagonal()
    a[0, 0, 1] = a[0, 1, 0] = 5 * (d[0] * d[1]).sqrt()
    layers = {**state["layers"], "0": {**state["layers"]["0"], "A": a}}
    return {**state, "layers": layers}


def bad_checkpoint(rank: int, world: int) -> dict[str, Any]:
    """Each rank loads its own copy of a checkpoint; rank 1's is damaged."""
    src_net, src = make()
    for i in range(2):
        backprop(src_net, i, rank, world)
        src.step()
    state = src.state_dict()
    net, k = make()
    backprop(net, 0, rank, world)
    k.step()
    before = state_of(k, net)
    mine = damaged(state) if rank == 1 else state
    out: dict[str, Any] = {"outcome": attempt(lambda: k.load_state_dict(mine))}
    out["unchanged"] = same(state_of(k, net), before)
    # rank 1's recompute is interrupted in its third eigendecomposition
    if rank == 1:
        with Fault(torch.linalg.eigh, KeyboardInterrupt("Ctrl-C on rank 1"), at=3):
            out["interrupted"] = attempt(lambda: k.load_state_dict(state, recompute=True))
    else:
        out["interrupted"] = attempt(lambda: k.load_state_dict(state, recompute=True))
    out["unchanged after interrupt"] = same(state_of(k, net), before)
    k.load_state_dict(state, recompute=True)  # and the good load goes through
    out["loaded"] = k.steps == 2
    return out


def optimizer(rank: int, world: int, **kw: Any) -> tuple[nn.Sequential, KFACOptimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    return net, KFACOptimizer(net, lr=0.1, damping=0.1, inv_dtype=DT, **kw)


def optimizer_state(net: nn.Module, opt: KFACOptimizer) -> dict[str, Any]:
    return {"kfac": state_of(opt.kfac, net), "sgd": copy.deepcopy(torch.optim.SGD.state_dict(opt))}


def optimizer_checkpoint(rank: int, world: int) -> dict[str, Any]:
    """KFACOptimizer.load_state_dict where rank 0's K-FAC part is damaged."""
    src_net, src = optimizer(rank, world)
    for i in range(2):
        backprop(src_net, i, rank, world)
        src.step()
    state = src.state_dict()
    net, opt = optimizer(rank, world)
    backprop(net, 0, rank, world)
    opt.step()
    before = optimizer_state(net, opt)
    mine = {**state, "kfac": damaged(state["kfac"])} if rank == 0 else state
    out: dict[str, Any] = {"outcome": attempt(lambda: opt.load_state_dict(mine))}
    out["unchanged"] = same(optimizer_state(net, opt), before)
    return out


def failing(net: nn.Module, x: torch.Tensor, y: torch.Tensor, at: int | None) -> Any:
    """The batch's loss as a closure that raises at its ``at``-th call (never if None)."""
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError(f"closure failed at call {at}")
        return 0.5 * (net(x) - y).pow(2).sum(1).mean()

    return closure


def closures(rank: int, world: int) -> dict[str, Any]:
    """Adaptive damping whose closure raises on rank 1, at its first or second call."""
    net, opt = optimizer(rank, world, adaptive_damping=True, damping_adaptation_interval=1)
    backprop(net, 0, rank, world)
    opt.step(lambda: 0.0)
    out: dict[str, Any] = {}
    for at in (1, 2):
        backprop(net, 1, rank, world)
        before = optimizer_state(net, opt)
        x, y = batch(1, rank, world)
        closure = failing(net, x, y, at if rank == 1 else None)
        out[at] = {
            "outcome": attempt(lambda c=closure: opt.step(c)),
            "unchanged": same(optimizer_state(net, opt), before),
        }
    return out


def plain_steps(rank: int, world: int) -> dict[str, Any]:
    """KFACOptimizer without adaptive damping: a Ctrl-C in rank 1's SGD update, then a
    closure that raises on rank 0."""
    net, opt = optimizer(rank, world, momentum=0.9)
    backprop(net, 0, rank, world)
    opt.step()
    backprop(net, 1, rank, world)
    before = optimizer_state(net, opt)

    def step() -> None:
        if rank == 1:
            # SGD's update of the second parameter, the first one updated
            when = lambda a: any(a[0] is p for p in net.parameters())  # noqa: E731
            with Fault(torch.Tensor.add_, KeyboardInterrupt("Ctrl-C on rank 1"), 2, when):
                opt.step()
        else:
            opt.step()

    out: dict[str, Any] = {"sgd": attempt(step)}
    out["sgd unchanged"] = same(optimizer_state(net, opt), before)

    def closure() -> torch.Tensor:
        if rank == 0:
            raise RuntimeError("closure failed on rank 0")
        x, y = batch(1, rank, world)
        return 0.5 * (net(x) - y).pow(2).sum(1).mean()

    out["closure"] = attempt(lambda: opt.step(closure))
    # rank 1's closure ran its forward (which the hooks count): the rest is as before
    after = optimizer_state(net, opt)
    for state in (after, before):
        del state["kfac"]["stats"], state["kfac"]["capture"]
    out["closure unchanged"] = same(after, before)
    return out


def job(rank: int, world: int) -> dict[str, Any]:
    return {
        "plain steps": plain_steps(rank, world),
        "interrupted step": interrupted_step(rank, world),
        "bad checkpoint": bad_checkpoint(rank, world),
        "optimizer checkpoint": optimizer_checkpoint(rank, world),
        "closures": closures(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    from secondorder.testing import run_ranks

    out = run_ranks(job, 2, timeout_s=30, deadline_s=240)
    return {r: res.unwrap() for r, res in out.items()}


def test_a_ctrl_c_on_one_rank_makes_every_rank_refuse_the_step(results: dict[int, Any]) -> None:
    # before: rank 0's KeyboardInterrupt escaped while rank 1 went on into the
    # factor all-reduce; their next collectives no longer paired up
    r0, r1 = results[0]["interrupted step"], results[1]["interrupted step"]
    assert r0["outcome"] == ("KeyboardInterrupt", "Ctrl-C on rank 0", False)
    kind, message, failed = r1["outcome"]
    assert kind == "OtherRankError" and failed, r1["outcome"]
    assert "K-FAC step 1 failed on rank(s) [0] of 2" in message
    for r in (r0, r1):
        assert r["unchanged"] and r["retry_equals_clean"]


def test_a_checkpoint_refused_on_one_rank_is_refused_on_every_rank(
    results: dict[int, Any],
) -> None:
    # before: rank 1 refused its damaged copy, rank 0 loaded its own (no collective)
    r0, r1 = results[0]["bad checkpoint"], results[1]["bad checkpoint"]
    kind, message, _ = r1["outcome"]
    assert kind == "ValueError" and "layer '0' factor A is not a covariance" in message
    kind, message, failed = r0["outcome"]
    assert kind == "OtherRankError" and failed
    assert "K-FAC load_state_dict failed on rank(s) [1] of 2" in message
    assert r0["interrupted"][0] == "OtherRankError"
    assert r1["interrupted"] == ("KeyboardInterrupt", "Ctrl-C on rank 1", False)
    for r in (r0, r1):
        assert r["unchanged"] and r["unchanged after interrupt"] and r["loaded"]


def test_an_optimizer_checkpoint_refused_on_one_rank_changes_no_rank(
    results: dict[int, Any],
) -> None:
    r0, r1 = results[0]["optimizer checkpoint"], results[1]["optimizer checkpoint"]
    assert r0["outcome"][0] == "ValueError" and "is not a covariance" in r0["outcome"][1]
    kind, message, failed = r1["outcome"]
    assert kind == "OtherRankError" and failed
    assert "KFACOptimizer load_state_dict failed on rank(s) [0] of 2" in message
    assert r0["unchanged"] and r1["unchanged"]


@pytest.mark.parametrize("at", [1, 2])
def test_a_closure_that_raises_on_one_rank_is_raised_on_every_rank(
    results: dict[int, Any], at: int
) -> None:
    # before: rank 0 waited in the loss all-reduce for rank 1, which had raised
    r0, r1 = results[0]["closures"][at], results[1]["closures"][at]
    assert r1["outcome"] == ("RuntimeError", f"closure failed at call {at}", False)
    kind, message, failed = r0["outcome"]
    assert kind == "OtherRankError" and failed
    assert "closure raised on 1 of 2 ranks" in message
    assert r0["unchanged"] and r1["unchanged"]


def test_a_plain_step_that_fails_on_one_rank_is_refused_on_every_rank(
    results: dict[int, Any],
) -> None:
    # before: K-FAC's step was committed before SGD's; rank 1's Ctrl-C in SGD's update
    # left its step half taken while rank 0 went on (and the closure was never called)
    r0, r1 = results[0]["plain steps"], results[1]["plain steps"]
    assert r1["sgd"] == ("KeyboardInterrupt", "Ctrl-C on rank 1", False)
    kind, message, failed = r0["sgd"]
    assert kind == "OtherRankError" and failed
    assert "KFACOptimizer step failed on rank(s) [1] of 2" in message
    assert r0["closure"] == ("RuntimeError", "closure failed on rank 0", False)
    kind, message, failed = r1["closure"]
    assert kind == "OtherRankError" and failed
    assert "K-FAC step 1 failed on rank(s) [0] of 2" in message
    for r in (r0, r1):
        assert r["sgd unchanged"] and r["closure unchanged"]
