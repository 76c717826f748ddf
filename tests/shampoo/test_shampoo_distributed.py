"""Data-parallel Shampoo on 2 and 4 gloo ranks equals one process.

Every scenario runs inside one launch per world size (a module-scoped fixture): each
rank trains with ``Shampoo`` over the process group and, in the same process with the
same thread count, single-process ``Shampoo`` runs on the whole batch; the parent
compares them, and the ranks with each other.

Which single process is bitwise equal: a rank stacks only the blocks it owns, so its
batches hold fewer blocks than one process's.  Batched kernels (``bmm``, ``eigh``, a
norm over a stack) need not round a matrix the same way in batches of different
sizes: on an AMD EPYC CPU they differ by 1 ulp where this test was written on an Intel
one.  So the bitwise reference is one process that batches every block as the rank
owning it does (:class:`RankGroupedShampoo`), and the plain one-process run is held to
a tolerance of a few ulps of the parameters' scale.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from secondorder.distributed import LocalReducer
from secondorder.shampoo import AdamGraftingConfig, Shampoo
from secondorder.shampoo.blocks import Batch, Block, group_batches
from secondorder.shampoo.distributor import assign_blocks, block_cost
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed

STEPS = 5

SCENARIOS: dict[str, dict[str, Any]] = {
    "root_inverse_f32": dict(dtype=torch.float32, data="replicated", kw={}),
    "root_inverse_f64": dict(dtype=torch.float64, data="replicated", kw={}),
    "eigenvalue_corrected_f32": dict(
        dtype=torch.float32, data="replicated", kw=dict(preconditioner="eigenvalue_corrected")
    ),
    "momentum_wd_freq2_f64": dict(
        dtype=torch.float64,
        data="replicated",
        kw=dict(momentum=0.9, weight_decay=0.01, precondition_frequency=2),
    ),
    "sharded_f64": dict(dtype=torch.float64, data="sharded", kw={}),
    "ddp_sharded_f64": dict(dtype=torch.float64, data="ddp", kw={}),
    "bf16_communication_f32": dict(
        dtype=torch.float32, data="replicated", kw={}, comm=torch.bfloat16
    ),
    "tiny_model_f32": dict(dtype=torch.float32, data="replicated", kw={}, tiny=True),
}


class RankGroupedShampoo(Shampoo):
    """One process whose blocks are batched as the ranks of a ``world``-rank run batch them.

    The same blocks, the same owners (:func:`assign_blocks`), one batch per owner and
    shape: every kernel sees the inputs of the same shapes as on the owning rank, so
    the result is that of the distributed run on any CPU, bit for bit.
    """

    def __init__(self, params: Any, world: int, **kw: Any) -> None:
        self.world = world
        super().__init__(params, reducer=LocalReducer(), **kw)

    def _group_batches(self, blocks: list[Block]) -> list[Batch]:
        owners = assign_blocks([block_cost(b.spec.shape) for b in blocks], self.world)
        return [
            batch
            for r in range(self.world)
            for batch in group_batches(
                [b for b, o in zip(blocks, owners, strict=True) if o == r], 0
            )
        ]


def _model(dtype: torch.dtype, tiny: bool) -> nn.Module:
    torch.manual_seed(0)
    if tiny:  # two blocks: with 4 ranks, two ranks own nothing
        return nn.Linear(3, 2).to(dtype)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).to(dtype)


def _data(dtype: torch.dtype, tiny: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n_in, n_out = (3, 2) if tiny else (6, 3)
    return torch.randn(24, n_in, generator=g, dtype=dtype), torch.randn(
        24, n_out, generator=g, dtype=dtype
    )


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    allreduce: bool = False,
) -> None:
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if allreduce:  # the user's gradient average, as DDP would do
            world = dist.get_world_size()
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()


def _options(sc: dict[str, Any]) -> dict[str, Any]:
    return dict(
        lr=0.05,
        betas=(0.9, 0.999),
        epsilon=1e-6,
        grafting_config=AdamGraftingConfig(),
        max_preconditioner_dim=4,
        **sc["kw"],
    )


def rank_job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, sc in SCENARIOS.items():
        dtype, tiny = sc["dtype"], sc.get("tiny", False)
        x, y = _data(dtype, tiny)
        # One process on the whole batch: batched as one process does, and as the ranks do.
        ref = _model(dtype, tiny)
        _train(ref, Shampoo(ref.parameters(), **_options(sc), reducer=LocalReducer()), x, y, STEPS)
        grouped = _model(dtype, tiny)
        opt_g = RankGroupedShampoo(grouped.parameters(), world, **_options(sc))
        _train(grouped, opt_g, x, y, STEPS)
        model = _model(dtype, tiny)
        if sc["data"] == "replicated":
            xs, ys = x, y
        else:
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        net: nn.Module = model
        if sc["data"] == "ddp":
            net = nn.parallel.DistributedDataParallel(model)
        opt = Shampoo(net.parameters(), **_options(sc), communication_dtype=sc.get("comm"))
        _train(net, opt, xs, ys, STEPS, allreduce=sc["data"] == "sharded")
        out[name] = {
            "params": _flat(model),
            "ref": _flat(ref),
            "grouped": _flat(grouped),
            "owned": sum(len(b.blocks) for b in opt._batches),
            "batches": {tuple(blk.gid for blk in b.blocks) for b in opt._batches},
            "grouped_batches": {tuple(blk.gid for blk in b.blocks) for b in opt_g._batches},
            "total": len(opt._blocks),
        }
    # Save each rank's own state mid-run, keep going, then resume from the files.
    x, y = _data(torch.float32, False)
    a = _model(torch.float32, False)
    oa = Shampoo(a.parameters(), **_options({"kw": {}}))
    _train(a, oa, x, y, 3)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    _train(a, oa, x, y, 3)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b = _model(torch.float32, False)
    b.load_state_dict(ckpt["model"])
    ob = Shampoo(b.parameters(), **_options({"kw": {}}))
    ob.load_state_dict(ckpt["opt"])
    _train(b, ob, x, y, 3)
    out["resume"] = {"continued": _flat(a), "resumed": _flat(b)}
    # A mismatched configuration is named, on every rank, before any step.
    m = _model(torch.float32, False)
    try:
        Shampoo(m.parameters(), lr=0.1, max_preconditioner_dim=4 + rank)._build()
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
    world = request.param
    results = run_ranks(rank_job, world, deadline_s=240.0)
    return world, {r: res.value for r, res in results.items()}


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s["data"] == "replicated"])
def test_replicated_data_is_bitwise_one_process(
    ranks: tuple[int, dict[int, Any]], name: str
) -> None:
    world, out = ranks
    grouped, ref = out[0][name]["grouped"], out[0][name]["ref"]
    for r in range(world):
        got = out[r][name]["params"]
        assert torch.equal(got, out[0][name]["params"]), f"rank {r} differs from rank 0"
        if SCENARIOS[name].get("comm") is None:
            assert torch.equal(got, grouped), (got - grouped).abs().max()
    if SCENARIOS[name].get("comm") is None:
        # Batched as one process does: the same math, each block's kernels rounding as
        # its batch's size makes them round (1 ulp per step on some CPUs; none here).
        # Five steps with epsilon 1e-6 amplify that far less than 2^6.
        eps = torch.finfo(ref.dtype).eps
        atol = 2**6 * eps * float(ref.abs().max())
        torch.testing.assert_close(out[0][name]["params"], ref, rtol=0, atol=atol)
    if SCENARIOS[name].get("comm") is torch.bfloat16:
        # Directions rounded to bfloat16 (8 significant bits) for the all-gather: a
        # relative error of 2^-8 per step in the update, not in the parameters.
        torch.testing.assert_close(
            out[0][name]["params"], grouped, rtol=0, atol=0.05 * 2**-8 * STEPS
        )
        assert not torch.equal(out[0][name]["params"], grouped)


def test_the_bitwise_reference_batches_blocks_as_the_ranks_do(
    ranks: tuple[int, dict[int, Any]],
) -> None:
    world, out = ranks
    for name in SCENARIOS:
        on_ranks = set().union(*(out[r][name]["batches"] for r in range(world)))
        assert on_ranks == out[0][name]["grouped_batches"], name
    # ...which is not how one process batches them: two 4x4 blocks share a batch there.
    assert any(len(b) == 1 for b in out[0]["root_inverse_f64"]["batches"])


@pytest.mark.parametrize("name", ["sharded_f64", "ddp_sharded_f64"])
def test_sharded_data_equals_one_process(ranks: tuple[int, dict[int, Any]], name: str) -> None:
    world, out = ranks
    for r in range(world):
        assert torch.equal(out[r][name]["params"], out[0][name]["params"])
    # The averaged gradient differs from the whole-batch mean only by the summation
    # order (about 1e-16 relative); five Shampoo steps with epsilon 1e-6 amplify that
    # by at most the factors' condition numbers, far below 1e-9.
    torch.testing.assert_close(out[0][name]["params"], out[0][name]["ref"], rtol=0, atol=1e-9)


def test_blocks_are_divided_and_idle_ranks_still_step(ranks: tuple[int, dict[int, Any]]) -> None:
    world, out = ranks
    for name in SCENARIOS:
        owned = [out[r][name]["owned"] for r in range(world)]
        assert sum(owned) == out[0][name]["total"], (name, owned)
    tiny = [out[r]["tiny_model_f32"]["owned"] for r in range(world)]
    if world == 4:
        assert sorted(tiny) == [0, 0, 1, 1]  # the two idle ranks got the right parameters
    big = [out[r]["root_inverse_f32"]["owned"] for r in range(world)]
    assert all(n > 0 for n in big)


def test_per_rank_state_dicts_resume_bitwise(ranks: tuple[int, dict[int, Any]]) -> None:
    world, out = ranks
    for r in range(world):
        assert torch.equal(out[r]["resume"]["continued"], out[r]["resume"]["resumed"])


def test_mismatched_configuration_is_named(ranks: tuple[int, dict[int, Any]]) -> None:
    world, out = ranks
    for r in range(world):
        assert "the Shampoo configuration must be the same on all" in out[r]["mismatch"]
        assert "param_groups differs" in out[r]["mismatch"]
