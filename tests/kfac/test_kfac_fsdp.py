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

pytestmark = pytest.mark.distributed

DT = torch.float64
N = 8  # global batch
STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(7, 4)
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.fc1 = nn.Linear(6 * 5, 9)
        self.fc2 = nn.Linear(9, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(self.emb(idx).transpose(1, 2))).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h)))


def data(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + 10 * step + micro)
    return torch.randint(0, 7, (N, 5), generator=g), torch.randn(N, 3, generator=g, dtype=DT)


SETTINGS: dict[str, Any] = {
    "damping": 0.05,
    "kl_clip": 1e-2,
    "lr": 0.1,
    "inv_update_steps": 2,
    "inv_dtype": DT,
}

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
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    b = N // world
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            x, y = data(step, m)
            x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
            loss = 0.5 * ((net(x) - y) ** 2).sum(1).mean() / micro
            loss.backward()
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


@pytest.fixture(scope="module", params=[2, 4])
def launched(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    results = run_ranks(job, world, deadline_s=300, timeout_s=150)
    return world, {r: res.unwrap() for r, res in results.items()}


COMPILE_WARNINGS = (
    # torch.compile's first use imports modules that torch 2.13 deprecates, and Dynamo,
    # tracing around the hooks, reads a non-leaf's .grad (its own warning)
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning",
)


def check(world: int, results: dict[int, Any], name: str) -> None:
    ref = train(name, 0, 1)
    got = results[0][name]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for r in range(1, world):
        assert torch.equal(results[r][name], got), f"rank {r}"


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
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        (0.5 * ((net(x) - y) ** 2).sum(1).mean()).backward()
        k.step()
        opt.step()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, train("eigen", 0, 1), rtol=1e-10, atol=1e-12)


def test_the_comparison_sees_a_preconditioner_left_out() -> None:
    # plain SGD differs from K-FAC at far above the tolerance: the test can fail
    model = Net().to(DT)
    ref = train("eigen", 0, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum(1).mean()).backward()
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
