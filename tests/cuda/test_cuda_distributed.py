"""LM across processes with CUDA tensors, compared with one process.

Two launches (:func:`secondorder.testing.run_ranks`), each running every scenario:

* NCCL with one rank on the device: the optimizer takes the process-group path
  (a ``ProcessGroupReducer`` on the NCCL group) and must take the steps of a run
  without ``torch.distributed``;
* gloo with two ranks sharing the device, CUDA tensors in every collective (NCCL
  refuses two ranks on one GPU): the ranks, each on its shard, must take the steps
  of one process on the concatenated batch, and agree with each other bit for bit.

A rank that fails names the collective that failed (``CollectiveError``).  The rank
functions are module-level so that the spawned processes can import them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from cuda_cases import RTOL, assert_close_params, flat
from torch import nn

import secondorder as so
from secondorder.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

STEPS = 4
#: name -> (options, global batch size): m > n = 16 in the primal form, m < n in the dual.
SCENARIOS: dict[str, tuple[dict[str, Any], int]] = {
    "primal-cholesky": ({"form": "primal", "solver": "cholesky"}, 61),
    "primal-qr": ({"form": "primal", "solver": "qr"}, 61),
    "primal-cg": ({"solver": "cg", "cg_rtol": 1e-12}, 61),
    "dual-cholesky": ({"form": "dual", "solver": "cholesky"}, 11),
}


def model_for(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1)).double()


def shard(n: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of the global batch (unequal parts, in rank order)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(2 * x)
    return torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]


def train(opt: so.LevenbergMarquardt, model: nn.Module, x: Any, y: Any) -> list[torch.Tensor]:
    params = []
    for _ in range(STEPS):
        opt.step(x, y)
        params.append(flat(model))
    return params


def job(rank: int, world: int, device_name: str) -> dict[str, Any]:
    """Every scenario on this rank's shard, on ``device_name``; parameters on the CPU."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The group itself carries a sum: it is alive and of the expected backend.
    probe = torch.tensor([float(rank + 1)], dtype=torch.float64, device=device)
    dist.all_reduce(probe)
    out: dict[str, Any] = {"backend": str(dist.get_backend()), "probe": float(probe)}
    for name, (options, n) in SCENARIOS.items():
        # Each rank starts from its own weights: construction gives them rank 0's.
        model = model_for(seed=rank).to(device)
        opt = so.LevenbergMarquardt(model, **options)
        x, y = (t.to(device) for t in shard(n, rank, world))
        out[name] = {"params": train(opt, model, x, y), "reducer": repr(opt.reducer)}
    return out


def single_process(device: torch.device) -> dict[str, list[torch.Tensor]]:
    """Each scenario without torch.distributed, on the whole batch, on ``device``."""
    out = {}
    for name, (options, n) in SCENARIOS.items():
        model = model_for(seed=0).to(device)
        x, y = (t.to(device) for t in shard(n, 0, 1))
        out[name] = train(so.LevenbergMarquardt(model, **options), model, x, y)
    return out


def compare(results: dict[int, Any], world: int, backend: str, device: torch.device) -> None:
    ref = single_process(device)
    ranks = [results[r] for r in range(world)]
    assert [r["backend"] for r in ranks] == [backend] * world, ranks
    assert [r["probe"] for r in ranks] == [world * (world + 1) / 2] * world, ranks
    for name in SCENARIOS:
        what = f"{name}, {world} {backend} rank(s) on {device}"
        assert ranks[0][name]["reducer"] == (
            f"ProcessGroupReducer(backend={backend!r}, rank=0, world_size={world})"
        ), what
        for step in range(STEPS):
            got = ranks[0][name]["params"][step]
            for r in range(1, world):
                # Every rank applies rank 0's step: the same bits everywhere.
                other = ranks[r][name]["params"][step]
                assert torch.equal(other, got), f"{what}: rank {r} differs at step {step}"
            assert_close_params(got, ref[name][step], RTOL, f"{what}: step {step}")


def test_nccl_at_world_size_one_equals_one_process(cuda_only: torch.device) -> None:
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL backend")
    results = run_ranks(
        job, 1, args=(str(cuda_only),), backend="nccl", deadline_s=240, timeout_s=120
    )
    compare({r: res.unwrap() for r, res in results.items()}, 1, "nccl", cuda_only)


def test_two_gloo_ranks_on_one_device_equal_one_process(device: torch.device) -> None:
    results = run_ranks(job, 2, args=(str(device),), deadline_s=240, timeout_s=120)
    compare({r: res.unwrap() for r, res in results.items()}, 2, "gloo", device)
