"""Host reads of a Shampoo step, counted as LM's are (:mod:`secondorder.testing.syncs`).

On a GPU every host read of a device value waits for the queue to drain.  A step that
refreshes no root decides both of its refusals (a non-finite gradient, a finite one
that would overflow the state) on one stacked transfer: one device read.  The step
counter is read as well, but it is a CPU tensor whatever the parameters' device (as
``torch.optim``'s is), so that read never waits for a device.  A refresh adds, per
stack of factors, a read of their finiteness and one of eigh's result; Shampoo's
roots add one more, of which blocks failed (SOAP knows that on the host).
With several ranks the step's only communication stays one exchange.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from secondorder.shampoo import AdamGraftingConfig, Shampoo
from secondorder.testing import run_ranks
from secondorder.testing.syncs import SyncCounter

FREQUENCY = 3


class _Reads(SyncCounter):
    """A :class:`SyncCounter` that also keeps the tensor each read was of."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[Any] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        before = len(self.sites)
        out = super().__torch_function__(func, types, args, kwargs)
        if len(self.sites) > before:
            self.tensors.append(args[0] if args else None)
        return out


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # With max_preconditioner_dim=8 the blocks are (4, 8), (4,), (3, 4) and (3,): four
    # batches holding 2 + 1 + 2 + 1 = 6 stacks of factors.
    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3))


FACTOR_STACKS = 6


def _grad(model: nn.Sequential, layer: int, name: str) -> Tensor:
    grad = getattr(model[layer], name).grad
    assert isinstance(grad, Tensor)
    return grad


def _shampoo(model: nn.Module, preconditioner: str, **kw: Any) -> Shampoo:
    return Shampoo(
        model.parameters(),
        lr=1e-2,
        betas=(0.9, 0.999),
        weight_decay=1e-4,
        max_preconditioner_dim=8,
        precondition_frequency=FREQUENCY,
        preconditioner=preconditioner,
        grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
        **kw,
    )


def _backward(model: nn.Module, opt: Shampoo, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def _counters(opt: Shampoo) -> dict[int, Tensor]:
    """The step counters of ``opt``'s state now (a step replaces them), by identity."""
    return {id(s["step"]): s["step"] for s in opt.state.values()}


def _split(reads: _Reads, counters: dict[int, Tensor]) -> tuple[list[str], list[Tensor]]:
    """The reads' sites other than of a step counter, and the step counters read."""
    sites, steps = [], []
    for site, t in zip(reads.functions, reads.tensors, strict=True):
        if id(t) in counters:
            steps.append(counters[id(t)])
        else:
            sites.append(site)
    return sites, steps


@pytest.mark.parametrize("preconditioner", ["root_inverse", "eigenvalue_corrected"])
def test_a_plain_step_reads_the_device_once(preconditioner: str) -> None:
    model = _model()
    opt = _shampoo(model, preconditioner)
    _backward(model, opt, 1)
    opt.step()  # builds the state
    for t in range(2, 2 * FREQUENCY + 2):
        _backward(model, opt, t)
        counters = _counters(opt)
        reads = _Reads()
        with reads:
            opt.step()
        sites, steps = _split(reads, counters)
        assert len(steps) == 1 and steps[0].device.type == "cpu"
        assert steps[0].dtype == torch.int64
        if t % FREQUENCY:
            assert sites == ["checks.py:check_step"], (t, reads.sites)
        else:  # a root (SOAP: eigenbasis) refresh
            # Per stack of factors: their finiteness, eigh's result and (Shampoo) the
            # roots' finiteness, which decides which blocks keep their previous root.
            per_stack = 3 if preconditioner == "root_inverse" else 2
            assert sites[0] == "checks.py:check_step"
            assert len(sites) == 1 + per_stack * FACTOR_STACKS, reads.sites
            assert {s.split(":")[0] for s in sites[1:]} == {"preconditioner.py", "root_inverse.py"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_step_counter_stays_on_the_cpu_through_a_checkpoint() -> None:
    model = _model().cuda()
    opt = _shampoo(model, "root_inverse")
    _backward_on(model, opt, 1)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    other = _shampoo(model, "root_inverse")
    other.load_state_dict(torch.load(buf, weights_only=True, map_location="cuda"))
    assert all(s["step"].device.type == "cpu" for s in other.state.values())
    _backward_on(model, other, 2)
    counters = _counters(other)
    reads = _Reads()
    with reads:
        other.step()
    sites, steps = _split(reads, counters)
    assert sites == ["checks.py:check_step"] and len(steps) == 1


def _backward_on(model: nn.Module, opt: Shampoo, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    opt.zero_grad()
    device = next(model.parameters()).device
    ((model(x.to(device)) - y.to(device)) ** 2).mean().backward()


def _snapshot(model: nn.Module, opt: Shampoo) -> tuple[list[Tensor], dict[str, Any]]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("preconditioner", ["root_inverse", "eigenvalue_corrected"])
def test_a_non_finite_gradient_is_refused_before_an_overflowing_one(
    preconditioner: str, decoupled: bool
) -> None:
    # One gradient NaN, another finite but beyond what the factors hold: the one read
    # must still refuse the non-finite one first, naming it alone, and change nothing.
    # With L2 decay G is not the gradient, so the gradients' own extremes decide.
    model = _model()
    opt = _shampoo(model, preconditioner, use_decoupled_weight_decay=decoupled)
    for t in range(1, FREQUENCY + 2):
        _backward(model, opt, t)
        opt.step()
    before = _snapshot(model, opt)
    _backward(model, opt, 9)
    _grad(model, 0, "bias")[1] = float("nan")
    _grad(model, 2, "weight").fill_(1e30)
    with pytest.raises(FloatingPointError, match=r"non-finite gradient .* in .*\(shape \(4,\)\);"):
        opt.step()
    assert _same(before, _snapshot(model, opt))
    _grad(model, 0, "bias").zero_()
    with pytest.raises(FloatingPointError, match=r"\(shape \(3, 4\)\) is finite but would"):
        opt.step()
    assert _same(before, _snapshot(model, opt))


def test_a_finite_gradient_that_l2_decay_makes_infinite_is_refused_as_too_large() -> None:
    # G = g + wd·W overflows float32 though g and W are finite: the gradient is not
    # called non-finite; the step is refused as one that would overflow the state.
    model = nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        model.weight.fill_(3e38)
    opt = Shampoo(model.parameters(), weight_decay=1.0, use_decoupled_weight_decay=False)
    model.weight.grad = torch.full((2, 3), -3e38)  # G = 0: a step that fits
    opt.step()
    before = _snapshot(model, opt)
    model.weight.grad = torch.full((2, 3), 3e38)
    with pytest.raises(FloatingPointError, match=r"\(shape \(2, 3\)\) is finite but would"):
        opt.step()
    assert _same(before, _snapshot(model, opt))


def _counting_collectives(calls: list[str]) -> None:
    """Record each torch.distributed collective this process makes (and still make it)."""
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier"):
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(dist, name, counted)


def reads_job(rank: int, world: int) -> dict[str, Any]:
    """Plain steps, then a NaN on this rank alone: collectives and reads per step."""
    model = _model()
    opt = _shampoo(model, "root_inverse")
    _backward(model, opt, 1)
    opt.step()  # builds the state (the ranks agree on it once, here)
    calls: list[str] = []
    _counting_collectives(calls)
    out: dict[str, Any] = {"plain": []}
    for t in (2, 4):  # no refresh at either
        _backward(model, opt, t)
        calls.clear()
        counters = _counters(opt)
        reads = _Reads()
        with reads:
            opt.step()
        sites, _ = _split(reads, counters)
        out["plain"].append((list(calls), sites))
    before = _snapshot(model, opt)
    _backward(model, opt, 5)
    if rank == 0:
        _grad(model, 2, "bias")[0] = float("inf")
    calls.clear()
    try:
        opt.step()
        out["refused"] = ""
    except Exception as exc:  # every rank must raise
        out["refused"] = f"{type(exc).__name__}: {exc}"
    out["refused_calls"] = list(calls)
    out["unchanged"] = _same(before, _snapshot(model, opt))
    # One (4, 16) weight cut into two (4, 8) blocks, one per rank; the same NaN on
    # every rank, in the block rank 1 owns: rank 0 must see it in the gradient too.
    torch.manual_seed(1)
    wide = nn.Linear(16, 4, bias=False)
    split = Shampoo(wide.parameters(), lr=1e-2, max_preconditioner_dim=8)
    wide.weight.grad = torch.ones(4, 16)
    split.step()
    before = _snapshot(wide, split)
    wide.weight.grad = torch.ones(4, 16)
    wide.weight.grad[0, 12] = float("nan")
    try:
        split.step()
        out["split"] = ""
    except Exception as exc:  # every rank must raise
        out["split"] = f"{type(exc).__name__}: {exc}"
    out["split_unchanged"] = _same(before, _snapshot(wide, split))
    out["split_blocks"] = sorted(k for k in split.state[wide.weight] if k.endswith("factor0"))
    return out


@pytest.mark.distributed
def test_ranks_refuse_together_with_one_exchange_per_step() -> None:
    got = {r: res.value for r, res in run_ranks(reads_job, 2, deadline_s=180.0).items()}
    for rank in range(2):
        # The step's one exchange: gather_rows' all_reduce of the row counts and its
        # all_gather of the tallies and directions; the flags ride in the tallies.
        for calls, sites in got[rank]["plain"]:
            assert calls == ["all_reduce", "all_gather"]
            assert sites.count("checks.py:check_step") == 1
        assert got[rank]["refused_calls"] == ["all_reduce", "all_gather"]
        assert got[rank]["unchanged"]
    assert got[0]["refused"].startswith("FloatingPointError: non-finite gradient")
    assert got[1]["refused"].startswith("RankFailedError: rank(s) [0] of 2 refused")
    # Each rank holds the state of its own block of the split weight, and both refuse
    # the NaN themselves, the rank that does not own its block included.
    assert [got[r]["split_blocks"] for r in range(2)] == [["block0.factor0"], ["block1.factor0"]]
    for rank in range(2):
        assert got[rank]["split"].startswith("FloatingPointError: non-finite gradient")
        assert got[rank]["split_unchanged"]
