"""Shampoo on ``fully_shard`` (FSDP2) parameters on 2 and 4 gloo ranks equals one process.

Each rank steps the blocks of its own shard of every DTensor parameter (blocks cut
inside the shard, so none crosses a shard boundary).  The single-process reference is
therefore Shampoo on the same model with each parameter held as its row shards
(``torch.chunk`` along dimension 0, as ``fully_shard`` cuts them), concatenated in the
forward: the same blocks, trained on the concatenated batch.  It runs in the parent
process; every scenario of one world size runs inside one launch.

Bitwise: with the same batch on every rank of two, the reduce-scatter's average of two
equal gradients is exact, and a reference that batches each rank's blocks apart (one
parameter group per rank) runs the kernels on the same stacks: the parameters agree
bit for bit.  Otherwise the gradients' reduction order differs and the runs agree to
1e-10 in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from secondorder.shampoo import (
    AdamPreconditionerConfig,
    EigenConfig,
    FullyShardDistributedConfig,
    Shampoo,
)
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed

STEPS = 4
OPTIONS: dict[str, Any] = dict(
    lr=0.05,
    betas=(0.9, 0.99),
    epsilon=1e-10,
    grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
    weight_decay=1e-3,
    momentum=0.5,
    max_preconditioner_dim=4,
    precondition_frequency=2,
)
#: SOAP refreshes its basis every step here: a thin block's factor is rank deficient in
#: the first steps, and a second moment gathered in one basis and read in a later one
#: whose null space rounding picks (any basis of it is exact) differs by O(1) between
#: runs whose gradients differ in the last bit, in one process as well.  For the same
#: reason its null-space cutoff is set well above rounding: at the default (the
#: rounding level, n·eps) a coordinate of noise can fall either side of it in two runs
#: whose gradients differ in the last bit (the reduce-scatter's order), and it then
#: moves the parameters by noise / epsilon (1e-6 here), in one process as well.
SCENARIOS: dict[str, dict[str, Any]] = {
    "root_inverse": {},
    "eigenvalue_corrected": {
        "preconditioner": "eigenvalue_corrected",
        "precondition_frequency": 1,
        "root_inv_config": EigenConfig(rank_rtol=1e-12),
    },
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 10), nn.Tanh(), nn.Linear(10, 5)).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 7, generator=g, dtype=torch.float64)
    return x, torch.randn(16, 5, generator=g, dtype=torch.float64)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


class RowShards(nn.Module):
    """``model`` with each parameter held as its ``world`` row shards (empty ones dropped)."""

    def __init__(self, model: nn.Module, world: int) -> None:
        super().__init__()
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.pieces = nn.ParameterList()
        self.by_rank: list[list[nn.Parameter]] = [[] for _ in range(world)]
        self.counts = []
        for _, p in model.named_parameters():
            chunks = p.detach().chunk(world, dim=0)
            self.counts.append(len(chunks))
            for r, c in enumerate(chunks):
                piece = nn.Parameter(c.clone())
                self.pieces.append(piece)
                self.by_rank[r].append(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params, at = {}, 0
        for name, n in zip(self.names, self.counts, strict=True):
            params[name] = torch.cat(list(self.pieces[at : at + n]))
            at += n
        return functional_call(self.model, params, (x,))

    def full(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.pieces])


def reference(world: int, scenario: str, replicated: bool) -> dict:
    """One process on the concatenated batch; ``replicated``: batched as the ranks do."""
    net = RowShards(_model(), world)
    kw = {**OPTIONS, **SCENARIOS[scenario]}
    groups = [{"params": ps} for ps in net.by_rank if ps] if replicated else net.parameters()
    opt = Shampoo(groups, **kw)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(net, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": net.full(), "losses": losses}


def _sharded_model(mesh: Any = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: nn.Module, world: int) -> torch.Tensor:
    """The parameters as the reference holds them: every rank's row shards in order."""
    pieces = []
    for p in model.parameters():
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, p.to_local().detach().clone())
        pieces += [c.reshape(-1) for c in gathered if c.numel()]
    return torch.cat(pieces)


def _run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    xs: torch.Tensor,
    ys: torch.Tensor,
    steps: int,
    accumulate: int = 1,
) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(xs.chunk(accumulate), ys.chunk(accumulate), strict=True):
            loss = _loss(model, xm, ym) / accumulate
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def _mean_over_ranks(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def rank_job(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out: dict[str, Any] = {}
    x, y = _data()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    for name, extra in SCENARIOS.items():
        kw = {**OPTIONS, **extra}
        # the concatenated batch split over the ranks
        model = _sharded_model()
        opt = Shampoo(model.parameters(), **kw)
        losses = _mean_over_ranks(_run(model, opt, xs, ys, STEPS))
        out[f"{name}/split"] = {"params": _full(model, world), "losses": losses}
        # the same batch on every rank
        model = _sharded_model()
        opt = Shampoo(model.parameters(), **kw, distributed_config=FullyShardDistributedConfig())
        losses = _run(model, opt, x, y, STEPS)
        out[f"{name}/replicated"] = {"params": _full(model, world), "losses": losses}
    # gradient accumulation: two micro-batches per rank and step
    model = _sharded_model()
    opt = Shampoo(model.parameters(), **OPTIONS)
    losses = _mean_over_ranks(_run(model, opt, xs, ys, STEPS, accumulate=2))
    out["accumulate"] = {"params": _full(model, world), "losses": losses}
    # a torch.compile'd sharded model
    model = _sharded_model()
    opt = Shampoo(model.parameters(), **OPTIONS)
    compiled = torch.compile(model)
    losses = _mean_over_ranks(_run(compiled, opt, xs, ys, STEPS))
    out["compiled"] = {"params": _full(model, world), "losses": losses}
    # torch.distributed.checkpoint: save after 2 steps, go on; resume a fresh run from it
    model = _sharded_model()
    opt = Shampoo(model.parameters(), **OPTIONS)
    _run(model, opt, xs, ys, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    _run(model, opt, xs, ys, 2)
    fresh = _sharded_model()
    opt2 = Shampoo(fresh.parameters(), **OPTIONS)
    msd2, osd2 = get_state_dict(fresh, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(fresh, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _run(fresh, opt2, xs, ys, 2)
    out["checkpoint"] = {"continued": _full(model, world), "resumed": _full(fresh, world)}
    # a failed step on one rank: every rank raises and nothing changes anywhere
    model = _sharded_model()
    opt = Shampoo(model.parameters(), **OPTIONS)
    _run(model, opt, xs, ys, 1)
    before = _full(model, world)
    saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    opt.zero_grad()
    _loss(model, xs, ys).backward()
    if rank == world - 1:
        model[0].weight.grad.to_local().fill_(float("nan"))
    try:
        opt.step()
        raised = "nothing"
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    after = opt.state_dict()["state"][0]
    out["fault"] = {
        "raised": raised,
        "unchanged": torch.equal(before, _full(model, world))
        and all(torch.equal(v, after[k]) for k, v in saved.items()),
    }
    if world == 4:  # HSDP: two replicas of a model sharded over two ranks
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _sharded_model(mesh)
        opt = Shampoo(model.parameters(), **OPTIONS)
        losses = _mean_over_ranks(_run(model, opt, xs, ys, STEPS))
        local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
        out["hsdp"] = {"local": local, "losses": losses}
    else:  # the FSDP1 wrapper's flat parameters are refused
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(_model(), device_id=torch.device("cpu"))
        try:
            Shampoo(wrapped.parameters(), **OPTIONS)
            out["fsdp1"] = "accepted"
        except ValueError as exc:
            out["fsdp1"] = str(exc)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    folder = tmp_path_factory.mktemp(f"dcp{world}")
    results = run_ranks(rank_job, world, args=(str(folder),), deadline_s=400.0)
    return world, {r: res.value for r, res in results.items()}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fully_shard_equals_one_process_on_the_concatenated_batch(ranks: Any, name: str) -> None:
    world, out = ranks
    want = reference(world, name, replicated=False)
    for r in range(world):
        got = out[r][f"{name}/split"]
        torch.testing.assert_close(got["params"], want["params"], rtol=0, atol=1e-10)
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-10
        )


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fully_shard_is_bitwise_where_the_gradients_are(ranks: Any, name: str) -> None:
    world, out = ranks
    want = reference(world, name, replicated=True)
    got = out[0][f"{name}/replicated"]
    if world == 2:  # the average of two equal gradients is exact
        assert torch.equal(got["params"], want["params"])
        assert got["losses"] == want["losses"]
    else:  # four: the reduce-scatter's sum of four rounds
        torch.testing.assert_close(got["params"], want["params"], rtol=0, atol=1e-10)


def test_gradient_accumulation_equals_one_process(ranks: Any) -> None:
    world, out = ranks
    want = reference(world, "root_inverse", replicated=False)
    got = out[0]["accumulate"]
    torch.testing.assert_close(got["params"], want["params"], rtol=0, atol=1e-10)
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=0, atol=1e-10
    )


def test_a_compiled_sharded_model_equals_one_process(ranks: Any) -> None:
    world, out = ranks
    want = reference(world, "root_inverse", replicated=False)
    torch.testing.assert_close(out[0]["compiled"]["params"], want["params"], rtol=0, atol=1e-10)


def test_a_distributed_checkpoint_resumes_bitwise(ranks: Any) -> None:
    world, out = ranks
    for r in range(world):
        assert torch.equal(out[r]["checkpoint"]["continued"], out[r]["checkpoint"]["resumed"])


def test_a_failed_rank_makes_every_rank_refuse_and_change_nothing(ranks: Any) -> None:
    world, out = ranks
    for r in range(world):
        fault = out[r]["fault"]
        assert fault["unchanged"], f"rank {r} changed its parameters or state"
        if r == world - 1:
            assert fault["raised"].startswith("FloatingPointError: non-finite gradient")
        else:
            assert fault["raised"].startswith(f"RankFailedError: rank(s) [{world - 1}] of {world}")


def test_hybrid_sharding_equals_one_process(ranks: Any) -> None:
    world, out = ranks
    if world != 4:
        pytest.skip("HSDP runs on the 4-rank launch (2 replicas x 2 shards)")
    want = reference(2, "root_inverse", replicated=False)
    # ranks 0 and 1 hold the two shards of the first replica, ranks 2 and 3 of the second
    for replica in (0, 1):
        shards = [out[2 * replica + s]["hsdp"]["local"] for s in (0, 1)]
        torch.testing.assert_close(
            _interleave(shards, _model()), want["params"], rtol=0, atol=1e-10
        )


def _interleave(shards: list[torch.Tensor], model: nn.Module) -> torch.Tensor:
    """Each rank's flat local shards, reordered parameter by parameter as the reference's."""
    sizes = [[c.numel() for c in p.detach().chunk(len(shards))] for p in model.parameters()]
    at = [0] * len(shards)
    pieces = []
    for per_rank in sizes:
        for r, n in enumerate(per_rank):
            pieces.append(shards[r][at[r] : at[r] + n])
            at[r] += n
    return torch.cat(pieces)


def test_the_fsdp1_wrapper_is_refused_with_the_way_out(ranks: Any) -> None:
    world, out = ranks
    if world != 2:
        pytest.skip("checked on the 2-rank launch")
    assert "flattened parameters of FullyShardedDataParallel (FSDP1)" in out[0]["fsdp1"]
    assert "torch.distributed.fsdp.fully_shard (FSDP2)" in out[0]["fsdp1"]
