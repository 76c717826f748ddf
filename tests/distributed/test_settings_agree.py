"""Per-step settings must agree across ranks: an lr changed on one rank is refused.

Each rank's ``param_groups[0]["lr"]`` travels with the batch check's all-reduce; a
difference makes every rank raise the same error before anything changes, where it
used to make the ranks' parameters diverge silently.  References: the parameters
before the refused step (bitwise), and one process on the concatenated batch for the
steps that go on (an lr changed on every rank alike is honoured).  One launch of two
gloo ranks runs every scenario.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lm_cases import N_PRIMAL, RTOL, flat, global_batch, model_for, shard

import secondorder as so
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2


def attempt(opt: so.LevenbergMarquardt, x: Any, y: Any) -> str | None:
    """The step's error as ``"Type: message"``, or None when it stepped."""
    try:
        opt.step(x, y)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def job_settings(rank: int, world: int) -> dict[str, Any]:
    x, y = shard(N_PRIMAL, rank, world)
    out: dict[str, Any] = {}
    # An lr changed on rank 1 only, then set back: the step is refused, then goes on.
    model = model_for(seed=0)
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    before = flat(model)
    if rank == 1:
        opt.param_groups[0]["lr"] = 0.5
    out["one-rank", "error"] = attempt(opt, x, y)
    out["one-rank", "unchanged"] = torch.equal(flat(model), before)
    out["one-rank", "damping"] = opt.damping
    opt.param_groups[0]["lr"] = 1.0
    out["one-rank", "next"] = attempt(opt, x, y)
    out["one-rank", "params"] = flat(model)
    # The same new lr on every rank (a scheduler stepped everywhere) is honoured.
    model = model_for(seed=0)
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    opt.param_groups[0]["lr"] = 0.5
    out["all-ranks", "error"] = attempt(opt, x, y)
    out["all-ranks", "params"] = flat(model)
    # An invalid lr on rank 0 only: rank 0 says why, rank 1 that rank 0 refused.
    model = model_for(seed=0)
    opt = so.LevenbergMarquardt(model)
    before = flat(model)
    if rank == 0:
        opt.param_groups[0]["lr"] = float("inf")
    out["invalid", "error"] = attempt(opt, x, y)
    out["invalid", "unchanged"] = torch.equal(flat(model), before)
    # 1 and 1.0 are the same learning rate.
    model = model_for(seed=0)
    opt = so.LevenbergMarquardt(model)
    opt.param_groups[0]["lr"] = 1 if rank == 0 else 1.0
    out["int-and-float", "error"] = attempt(opt, x, y)
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    results = run_ranks(job_settings, WORLD, timeout_s=120.0, deadline_s=300.0)
    return {r: res.value for r, res in results.items()}


def single_process(lrs: list[float]) -> torch.Tensor:
    """One process on the concatenated batch, one step per lr."""
    x, y = global_batch(N_PRIMAL)
    model = model_for(seed=0)
    opt = so.LevenbergMarquardt(model)
    for lr in lrs:
        opt.param_groups[0]["lr"] = lr
        opt.step(x, y)
    return flat(model)


def test_an_lr_changed_on_one_rank_is_refused_on_every_rank_with_one_message(ranks) -> None:
    message = (
        "ValueError: param_groups[0]['lr'] differs across ranks (rank 0: 1.0, rank 1: 0.5); "
        "every rank takes the same step, so the ranks' parameters would diverge. Set the "
        "same lr on every rank (change it, or step a scheduler, in code that runs on all "
        "ranks). No rank changed its parameters."
    )
    for r in range(WORLD):
        assert ranks[r]["one-rank", "error"] == message
        assert ranks[r]["one-rank", "unchanged"]
        assert ranks[r]["one-rank", "next"] is None
    assert ranks[0]["one-rank", "damping"] == ranks[1]["one-rank", "damping"]
    # The refused step left no trace: two steps at lr=1, as one process takes them.
    assert torch.equal(ranks[0]["one-rank", "params"], ranks[1]["one-rank", "params"])
    ref = single_process([1.0, 1.0])
    torch.testing.assert_close(ranks[0]["one-rank", "params"], ref, rtol=RTOL, atol=0)


def test_the_same_lr_changed_on_every_rank_is_honoured(ranks) -> None:
    assert ranks[0]["all-ranks", "error"] is None and ranks[1]["all-ranks", "error"] is None
    assert torch.equal(ranks[0]["all-ranks", "params"], ranks[1]["all-ranks", "params"])
    ref = single_process([1.0, 0.5])
    torch.testing.assert_close(ranks[0]["all-ranks", "params"], ref, rtol=RTOL, atol=0)
    # And lr=0.5 is not lr=1: the reference tells them apart.
    assert not torch.allclose(ref, single_process([1.0, 1.0]), rtol=1e-6, atol=0)


def test_an_invalid_lr_on_one_rank_makes_every_rank_raise(ranks) -> None:
    assert ranks[0]["invalid", "error"] == (
        "ValueError: Invalid lr=inf in param_groups[0]: must be a finite number > 0."
    )
    assert ranks[1]["invalid", "error"] == (
        "ValueError: step() rejected the batch on rank(s) [0] of 2; see the error raised "
        "there. No rank changed its parameters."
    )
    assert ranks[0]["invalid", "unchanged"] and ranks[1]["invalid", "unchanged"]


def test_an_int_and_a_float_of_the_same_value_agree(ranks) -> None:
    assert ranks[0]["int-and-float", "error"] is None
    assert ranks[1]["int-and-float", "error"] is None
