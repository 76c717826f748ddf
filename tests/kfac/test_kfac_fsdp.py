"""K-FAC on a model sharded by FSDP2 (``fully_shard``) equals one process on the whole batch.

Also HSDP (a 2 × 2 mesh), gradient accumulation, per-layer sharding and a compiled
model; the older FullyShardedDataParallel wrapper is refused.

Each of 2 and 4 gloo ranks trains its share of the batch on a model whose parameters
(and gradients) are DTensors; K-FAC gathers the gradients, preconditions whole
matrices and writes back each rank's rows.  After a few steps the gathered parameters
must equal one process that trains the plain model on the concatenated batch (float64;
tolerance as in test_kfac_distributed: reduction order ~1e-16, amplified by the damped
solve), and every rank must hold the same parameters.  Sizes are uneven on purpose:
4 ranks shard fc2's 3 output rows as 1, 1, 1 and none.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from secondorder.kfac import KFAC
from secondorder.testing import run_ranks
from tests.kfac.kfac_ranks import (
    DT,
    SETTINGS,
    STEPS,
    N,
    assert_ranks_match,
    batch,
    launcher,
    loss,
    momentum_sgd,
    shard,
)
from tests.kfac.kfac_ranks import Net as _Net

pytestmark = pytest.mark.distributed

__all__ = ["DT", "SETTINGS", "N", "Net", "data"]  # test_kfac_fsdp_checkpoint builds on them


class Net(_Net):
    """Zero-padded convolution, tanh; 3 outputs (fc2's rows shard unevenly on 4 ranks)."""

    def __init__(self) -> None:
        super().__init__(seed=3, vocab=7, conv={"padding": 1}, hidden=9, out=3, act=torch.tanh)


def data(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(500 + 10 * step + micro, vocab=7, out=3)


SCENARIOS: dict[str, dict[str, Any]] = {
    "eigen": {},
    "inverse": {"compute_method": "inverse"},
    "mem-opt": {"grad_worker_fraction": "mem-opt"},
    "accumulate": {"accumulation_steps": 2},
    "layers": {"shard_layers": True},
    # HSDP: 2 replicas of 2 shards (4 ranks only); placements (Replicate, Shard(0))
    "hsdp": {"mesh": (2, 2)},
    # a compiled model (its K-FAC hooks run eagerly between the compiled pieces)
    "compiled": {"compile": True},
}
#: Scenarios that need a particular number of ranks; compiling is slow (see below).
ONLY_ON = {"hsdp": 4, "compiled": 2}


def train(name: str, rank: int, world: int) -> torch.Tensor:
    """``STEPS`` steps of K-FAC + SGD; the whole parameters, flattened."""
    kw = dict(SCENARIOS[name])
    per_layer = kw.pop("shard_layers", False)
    shape = kw.pop("mesh", None)
    compiled = kw.pop("compile", False)
    micro = kw.get("accumulation_steps", 1)
    model = Net().to(DT)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        names = ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names) if shape else None
        if per_layer:
            for child in (model.conv, model.fc1, model.fc2):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
    k = KFAC(model, **{**SETTINGS, **kw})
    net = torch.compile(model) if compiled else model
    opt = momentum_sgd(model)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            x, y = shard(*data(step, m), rank, world)
            (loss(net(x), y) / micro).backward()
        k.step()
        opt.step()
    return torch.cat([_whole(p).reshape(-1) for p in model.parameters()])


def _whole(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if full is not None else p).detach().clone()


def scenarios(world: int, compiled: bool = False) -> list[str]:
    names = [n for n in SCENARIOS if ONLY_ON.get(n, world) == world]
    return [n for n in names if (n == "compiled") == compiled]


def job(rank: int, world: int, compiled: bool = False) -> dict[str, torch.Tensor]:
    return {name: train(name, rank, world) for name in scenarios(world, compiled)}


launched = launcher(job, deadline_s=300, timeout_s=150)


COMPILE_WARNINGS = (
    # torch.compile's first use imports modules that torch 2.13 deprecates, and Dynamo,
    # tracing around the hooks, reads a non-leaf's .grad (its own warning)
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning",
)


def check(world: int, results: dict[int, Any], name: str) -> None:
    assert_ranks_match([results[r][name] for r in range(world)], train(name, 0, 1), name)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "compiled"])
def test_fully_shard_equals_one_process(launched: tuple[int, dict[int, Any]], name: str) -> None:
    world, results = launched
    if name not in results[0]:
        pytest.skip(f"{name} runs on {ONLY_ON[name]} ranks")
    check(world, results, name)


@pytest.mark.slow
@pytest.mark.filterwarnings(COMPILE_WARNINGS[0])
@pytest.mark.filterwarnings(COMPILE_WARNINGS[1])
def test_a_compiled_sharded_model_equals_one_process() -> None:
    # torch.compile of the model on each rank takes a minute or two on a loaded CPU
    results = run_ranks(job, 2, args=(True,), deadline_s=600, timeout_s=300)
    check(2, {r: res.unwrap() for r, res in results.items()}, "compiled")


@pytest.mark.filterwarnings(COMPILE_WARNINGS[0])
@pytest.mark.filterwarnings(COMPILE_WARNINGS[1])
def test_a_compiled_model_equals_the_model() -> None:
    model = Net().to(DT)
    k = KFAC(model, **SETTINGS)
    net = torch.compile(model)
    opt = momentum_sgd(model)
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        loss(net(x), y).backward()
        k.step()
        opt.step()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, train("eigen", 0, 1), rtol=1e-10, atol=1e-12)


def test_the_comparison_sees_a_preconditioner_left_out() -> None:
    # plain SGD differs from K-FAC at far above the tolerance: the test can fail
    model = Net().to(DT)
    ref = train("eigen", 0, 1)
    opt = momentum_sgd(model)
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    sgd = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.allclose(sgd, ref, rtol=1e-6, atol=1e-8)


def test_the_flat_parameter_wrapper_is_refused() -> None:
    # FullyShardedDataParallel refuses to build without an accelerator; the refusal
    # reads only the wrapper's type, so an instance that skipped its __init__ (and its
    # process group) is enough to show the message
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    model = nn.Sequential(nn.Linear(2, 2), wrapper)
    with pytest.raises(
        TypeError,
        match=r"^so\.KFAC does not support the FullyShardedDataParallel wrapper \(submodule "
        r"'1' is one\): it flattens each wrapped module's parameters into one buffer, so "
        r"K-FAC cannot read a layer's weight gradient\. Shard the model with "
        r"torch\.distributed\.fsdp\.fully_shard \(FSDP2\) instead, or use DDP\.$",
    ):
        KFAC(model)
    assert not model[0]._forward_hooks and not model[0]._backward_hooks
