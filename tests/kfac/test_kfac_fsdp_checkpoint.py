"""K-FAC under FSDP2 through ``torch.distributed.checkpoint``: a resumed run equals one
that never stopped, and one process on the concatenated batch.

On 2 gloo ranks a ``fully_shard``-ed model, its SGD (momentum) and K-FAC train two
steps, are saved with ``dcp.save`` (the model's and optimizer's DTensor state from
``get_state_dict``, K-FAC's plain, replicated tensors beside them), and a fresh
model, optimizer and K-FAC, built as at the start, are loaded with ``dcp.load`` into
their own state dicts as templates and train two more steps.  The references: the
same ranks' uninterrupted run (bitwise) and one process on the whole batch (float64,
the tolerance of ``test_kfac_fsdp``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from secondorder.kfac import KFAC
from secondorder.testing import run_ranks
from tests.kfac.test_kfac_fsdp import DT, SETTINGS, N, Net, data

pytestmark = pytest.mark.distributed

STEPS = 4
SAVE_AT = 2  # K-FAC's inv_update_steps=2 recomputes the decompositions at step 2


def build(world: int) -> tuple[torch.nn.Module, KFAC, torch.optim.Optimizer]:
    model = Net().to(DT)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    k = KFAC(model, **{**SETTINGS, "grad_worker_fraction": "mem-opt"})
    return model, k, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def steps(model: Any, k: KFAC, opt: Any, rank: int, world: int, which: range) -> None:
    b = N // world
    for step in which:
        x, y = data(step)
        x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        opt.zero_grad()
        (0.5 * ((model(x) - y) ** 2).sum(1).mean()).backward()
        k.step()
        opt.step()


def whole(model: torch.nn.Module) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        full = getattr(p, "full_tensor", None)
        parts.append((full() if full is not None else p).detach().reshape(-1).clone())
    return torch.cat(parts)


def job(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, k, opt = build(world)
    steps(model, k, opt, rank, world, range(SAVE_AT))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "kfac": k.state_dict()}, checkpoint_id=path)
    steps(model, k, opt, rank, world, range(SAVE_AT, STEPS))

    model2, k2, opt2 = build(world)
    msd2, osd2 = get_state_dict(model2, opt2)
    template = {"model": msd2, "optim": osd2, "kfac": k2.state_dict()}
    dcp.load(template, checkpoint_id=path)
    set_state_dict(
        model2, opt2, model_state_dict=template["model"], optim_state_dict=template["optim"]
    )
    k2.load_state_dict(template["kfac"])
    loaded_steps = k2.steps
    steps(model2, k2, opt2, rank, world, range(SAVE_AT, STEPS))
    return {"uninterrupted": whole(model), "resumed": whole(model2), "steps": loaded_steps}


def test_a_run_resumed_from_a_distributed_checkpoint_equals_one_that_never_stopped(
    tmp_path: Path,
) -> None:
    out = run_ranks(job, 2, args=(str(tmp_path / "ckpt"),), deadline_s=300, timeout_s=120)
    results = {r: res.unwrap() for r, res in out.items()}
    model, k, opt = build(1)
    steps(model, k, opt, 0, 1, range(STEPS))
    ref = whole(model)
    for r in (0, 1):
        assert results[r]["steps"] == SAVE_AT
        assert torch.equal(results[r]["resumed"], results[r]["uninterrupted"]), r
        torch.testing.assert_close(results[r]["resumed"], ref, rtol=1e-10, atol=1e-12)
