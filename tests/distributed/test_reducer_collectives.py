"""The collectives K-FAC added to the reducers: broadcast from any rank, sub-groups."""

from __future__ import annotations

import pytest
import torch

from secondorder.distributed import LocalReducer, ProcessGroupReducer
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed


def job(rank: int, world: int) -> dict[str, object]:
    red = ProcessGroupReducer()
    out: dict[str, object] = {}
    # broadcast from the last rank, two dtypes in one call (two packed buckets)
    a = torch.full((3,), float(rank))
    b = torch.full((2, 2), rank, dtype=torch.float64).mT  # not contiguous
    red.broadcast_from_([a, b], world - 1)
    out["whole"] = (a.tolist(), b.tolist())
    blocks = red.split([[0, 1], [2, 3]])
    cols = red.split([[0, 2], [1, 3]])
    out["ranks"] = (blocks.rank, blocks.world_size, cols.rank, cols.world_size)
    t = torch.tensor([10.0 * rank])
    blocks.broadcast_from_([t], 1)  # from global rank 1 in block 0, rank 3 in block 1
    out["block"] = float(t)
    s = torch.tensor([float(rank)])
    cols.sum_([s])
    out["col_sum"] = float(s)
    try:
        red.broadcast_from_([t], world)
    except ValueError as exc:
        out["error"] = str(exc)
    assert red.split([list(range(world))]) is red
    return out


def test_broadcast_from_any_rank_and_subgroups_on_four_ranks() -> None:
    results = {r: res.unwrap() for r, res in run_ranks(job, 4).items()}
    for r, out in results.items():
        assert out["whole"] == ([3.0] * 3, [[3.0, 3.0], [3.0, 3.0]])
        assert out["ranks"] == (r % 2, 2, r // 2, 2)
        assert out["block"] == (10.0 if r < 2 else 30.0)
        assert out["col_sum"] == (0.0 + 2.0 if r % 2 == 0 else 1.0 + 3.0)
        assert out["error"] == "Invalid src=4: must be a rank of this group, in range(4)."


def test_local_reducer_collectives() -> None:
    r = LocalReducer()
    t = torch.ones(2)
    r.broadcast_from_([t], 0)
    assert torch.equal(t, torch.ones(2))
    assert r.split([[0]]) is r
    with pytest.raises(ValueError, match=r"Invalid src=2: a single process has only participant 0"):
        r.broadcast_from_([t], 2)
