"""The multi-process launcher: real gloo ranks, results by rank, failures named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from secondorder.testing import RankError, run_ranks

pytestmark = pytest.mark.distributed


def job_sum(rank: int, world: int, base: float) -> tuple[int, int, float]:
    t = torch.tensor([base + rank], dtype=torch.float64)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


def job_raise_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def test_every_rank_runs_in_one_group_and_returns_its_value() -> None:
    results = run_ranks(job_sum, 3, args=(10.0,))
    assert sorted(results) == [0, 1, 2]
    for r, res in results.items():
        # 10 + 11 + 12: the all-reduce really joined the three processes.
        assert res.unwrap() == (r, 3, 33.0)


def test_a_rank_that_raises_is_named_with_its_error() -> None:
    with pytest.raises(RankError, match=r"rank 1 of 2 raised ValueError: rank one refuses"):
        run_ranks(job_raise_on_one, 2)
    results = run_ranks(job_raise_on_one, 2, check=False)
    assert results[0].unwrap() == 0
    assert results[1].error_type == "ValueError"
    with pytest.raises(RankError, match="rank 1 raised ValueError"):
        results[1].unwrap()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Invalid world=0: must be an integer >= 1"):
        run_ranks(job_sum, 0)

    def local(rank: int, world: int) -> None:  # pragma: no cover - never spawned
        return None

    with pytest.raises(ValueError, match="module-level function"):
        run_ranks(local, 2)


def test_an_unknown_backend_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[object] = []
    monkeypatch.setattr("multiprocessing.context.SpawnProcess.start", started.append)
    with pytest.raises(
        ValueError, match=r"Invalid backend='mpi': must be one of \('gloo', 'nccl'\); pass"
    ):
        run_ranks(job_sum, 2, args=(1.0,), backend="mpi")
    with pytest.raises(ValueError, match=r"Invalid backend=None: must be one of"):
        run_ranks(job_sum, 2, args=(1.0,), backend=None)  # type: ignore[arg-type]
    assert started == []
