"""LM across processes: real gloo process groups, compared with one process.

Each launch (:func:`secondorder.testing.run_ranks`) spawns 2 or 4 gloo ranks on this
machine.
Every rank trains the same model on its shard of one global batch (shards of
unequal size, in rank order); the parent process runs the single-process reference
on the concatenated batch and compares.  A launch runs every scenario at once, since
starting a Python process with torch costs more than the training itself.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lm_cases import (
    CASE_IDS,
    CASES,
    HIDDEN,
    N_PRIMAL,
    RTOL,
    RTOL_FLOAT32,
    SCENARIOS,
    SCENARIOS_4,
    STEPS,
    flat,
    global_batch,
    info_dict,
    model_for,
    options_of,
    shard,
    train,
)

import secondorder as so
from secondorder.distributed import (
    CollectiveError,
    LocalReducer,
    ProcessGroupReducer,
    resolve_reducer,
)
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed

# -- what each rank runs (module level, so that spawned processes can import it) ------------


def job_train(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"reducer": job_reducer(rank, world)}
    for name in SCENARIOS if world == 2 else SCENARIOS_4:
        options, dtype, n = options_of(name)
        # Each rank starts from different weights: construction gives them rank 0's.
        model = model_for(seed=rank, dtype=dtype)
        opt = so.LevenbergMarquardt(model, **options)
        initial = flat(model)
        x, y = shard(n, rank, world)
        out[name] = train(opt, model, x.to(dtype), y.to(dtype))
        out[name]["initial"] = initial
        out[name]["reducer"] = repr(opt.reducer)
    if world == 2:
        # The error cases share this launch: starting processes costs more than them.
        out["errors"] = job_errors(rank, world)
    if world == 4:
        # Two independent trainings, on the groups {0, 1} and {2, 3}.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        model = model_for(seed=rank)
        opt = so.LevenbergMarquardt(
            model, process_group=groups[rank // 2], **SCENARIOS["primal-cholesky"][0]
        )
        initial = flat(model)
        out["pairs"] = train(opt, model, *shard(N_PRIMAL, rank % 2, 2))
        out["pairs"]["initial"] = initial
        out["pairs"]["reducer"] = repr(opt.reducer)
    return out


def rank_data(rank: int) -> list[torch.Tensor]:
    """Tensors that differ by rank: large and small, two dtypes, a non-contiguous view."""
    g = torch.Generator().manual_seed(100 + rank)
    big = torch.randn(40, 40, generator=g, dtype=torch.float64)
    return [
        big,
        torch.randn(3, generator=g, dtype=torch.float64),
        torch.randn(5, generator=g, dtype=torch.float32),
        torch.randn(4, 6, generator=g, dtype=torch.float64)[:, ::2],
        torch.tensor(float(rank), dtype=torch.float64),
    ]


def job_reducer(rank: int, world: int) -> dict[str, Any]:
    """Each collective of ProcessGroupReducer on known data; tiny buckets force both paths."""
    reducer = ProcessGroupReducer(bucket_bytes=1024)
    summed = rank_data(rank)
    reducer.sum_(summed)
    broadcast = rank_data(rank)
    reducer.broadcast_(broadcast)
    rows = torch.arange(3.0 * (rank + 1)).reshape(rank + 1, 3) + 100 * rank
    gathered = reducer.gather_rows(rows)
    try:
        reducer.gather_rows(torch.zeros(2, 3 + rank))
        width_error = "no error"
    except ValueError as exc:
        width_error = str(exc)
    return {"sum": summed, "broadcast": broadcast, "rows": gathered, "width": width_error}


def job_errors(rank: int, world: int) -> dict[str, Any]:
    """Mismatched settings, then a batch rejected on one rank only."""
    out: dict[str, Any] = {}
    for what, kwargs, hidden in (
        ("rule", {"damping_rule": "multiplicative" if rank == 1 else "nielsen"}, HIDDEN),
        ("shape", {}, HIDDEN + rank),
    ):
        try:
            so.LevenbergMarquardt(model_for(0, hidden), **kwargs)
            out[what] = "no error"
        except ValueError as exc:
            out[what] = str(exc)
    model = model_for(0)
    opt = so.LevenbergMarquardt(model)
    x, y = shard(N_PRIMAL, rank, world)
    before = flat(model)
    try:
        opt.step(x.float() if rank == 1 else x, y)
        out["batch"] = "no error"
    except (TypeError, ValueError) as exc:
        out["batch"] = f"{type(exc).__name__}: {exc}"
    out["unchanged"] = torch.equal(before, flat(model))
    # The ranks are still in step: a good batch trains on all of them.
    out["after"] = info_dict(opt.step(x, y))
    return out


def job_dies(rank: int, world: int, stall: bool = False) -> dict[str, Any]:
    """Rank 1 exits (or stalls) in the middle of its second step; rank 0 must not hang."""
    calls = 0
    armed = False

    def residual(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += armed
        # Second call of the second step: after the Jacobian, in the evaluation of the
        # first trial point (the batch was validated by the first step: no probe call).
        if rank == 1 and calls == 2:
            if stall:
                time.sleep(120)
            os._exit(3)
        return out - target

    model = model_for(0)
    opt = so.LevenbergMarquardt(model, residual, form="primal", jacobian="batch_reverse")
    x, y = shard(N_PRIMAL, rank, world)
    steps = 0
    try:
        for steps in range(50):
            before = flat(model)
            t0 = time.monotonic()
            armed = steps == 1
            opt.step(x, y)
        return {"error": "no error"}
    except CollectiveError as exc:
        return {
            "error": str(exc),
            "seconds": time.monotonic() - t0,
            "steps": steps,
            "unchanged": torch.equal(before, flat(model)),
        }


def job_stalls(rank: int, world: int) -> dict[str, Any]:
    return job_dies(rank, world, stall=True)


# -- the single-process reference ------------------------------------------------------------


def reference(name: str) -> dict[str, Any]:
    options, dtype, n = options_of(name)
    model = model_for(seed=0, dtype=dtype)
    opt = so.LevenbergMarquardt(model, **options)
    assert isinstance(opt.reducer, LocalReducer)
    with warnings.catch_warnings():
        # pyproject's filter, repeated so that a command-line `-W error` (which takes
        # precedence over it) does not fail on torch's own first use of jvp.
        warnings.filterwarnings(
            "ignore", "`torch.jit.script` is deprecated", category=DeprecationWarning
        )
        x, y = global_batch(n)
        return train(opt, model, x.to(dtype), y.to(dtype))


@functools.cache
def trained(world: int) -> dict[int, Any]:
    """Every rank's results of ``job_train`` on ``world`` ranks (one launch per world)."""
    results = run_ranks(job_train, world, timeout_s=30.0, deadline_s=60.0)
    assert sorted(results) == list(range(world))
    return {r: res.value for r, res in results.items()}


@pytest.mark.parametrize(("world", "name"), CASES, ids=CASE_IDS)
def test_equals_single_process_on_the_concatenated_batch(world: int, name: str) -> None:
    results = trained(world)
    ref = reference(name)
    got = results[0][name]
    dtype = options_of(name)[1]
    rtol = RTOL if dtype == torch.float64 else RTOL_FLOAT32
    assert "ProcessGroupReducer(backend='gloo'" in got["reducer"]
    assert torch.equal(got["initial"], flat(model_for(seed=0, dtype=dtype)))
    for step, (p, q, a, b) in enumerate(
        zip(got["params"], ref["params"], got["infos"], ref["infos"], strict=True)
    ):
        scale = float(q.abs().max())
        err = float((p - q).abs().max())
        assert err <= rtol * scale, f"step {step}: max |Δx| = {err:.3g} > {rtol} · {scale:.3g}"
        keys = ("accepted", "attempts", "form", "solver", "jacobian", "status", "terminated")
        for key in (*keys, "gram_dtype"):
            assert a[key] == b[key], f"step {step}: {key} {a[key]!r} != {b[key]!r}"
        for key in ("loss", "loss_before", "damping"):
            assert a[key] == pytest.approx(b[key], rel=rtol * 10), f"step {step}: {key}"
    assert any(info["accepted"] for info in got["infos"])
    assert ref["infos"][-1]["loss"] < 0.5 * ref["infos"][0]["loss_before"]
    if "cg" in name:
        assert all(i["cg_iterations"] > 0 for i in got["infos"] if i["attempts"])
    expected_form = "dual" if name.startswith("dual") else "primal"
    assert got["infos"][0]["form"] == expected_form
    if dtype == torch.float32:
        assert got["infos"][0]["gram_dtype"] == "float32"


@pytest.mark.parametrize(("world", "name"), CASES, ids=CASE_IDS)
def test_parameters_bitwise_identical_and_info_equal_on_every_rank(world: int, name: str) -> None:
    results = trained(world)
    base = results[0][name]
    for r in range(1, world):
        other = results[r][name]
        assert torch.equal(other["initial"], base["initial"]), f"rank {r} initial"
        for step in range(STEPS):
            assert torch.equal(other["params"][step], base["params"][step]), f"rank {r} {step}"
            assert other["infos"][step] == base["infos"][step], f"rank {r} step {step}"


@pytest.mark.parametrize("world", [2, 4])
def test_reducer_collectives_against_their_definition(world: int) -> None:
    results = trained(world)
    data = [rank_data(r) for r in range(world)]
    for r in range(world):
        got = results[r]["reducer"]
        for i, t in enumerate(got["sum"]):
            expected = sum(d[i].to(torch.float64) for d in data)
            assert t.dtype == data[0][i].dtype and t.shape == data[0][i].shape
            torch.testing.assert_close(t.to(torch.float64), expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(t, results[0]["reducer"]["sum"][i])  # same bits on every rank
        for t, root in zip(got["broadcast"], data[0], strict=True):
            assert torch.equal(t, root)
        rows = torch.cat(
            [torch.arange(3.0 * (k + 1)).reshape(k + 1, 3) + 100 * k for k in range(world)]
        )
        assert torch.equal(got["rows"], rows)
        assert got["width"].startswith("gather_rows: ranks hold rows of different sizes [3, 4"), (
            got["width"]
        )


def test_process_groups_other_than_the_default() -> None:
    """Ranks {0, 1} and {2, 3} of four train two models; each pair's root broadcasts."""
    results = trained(4)
    ref = reference("primal-cholesky")
    for r in range(4):
        got = results[r]["pairs"]
        assert got["reducer"] == f"ProcessGroupReducer(backend='gloo', rank={r % 2}, world_size=2)"
        root = 2 * (r // 2)
        assert torch.equal(got["initial"], flat(model_for(seed=root)))
        assert torch.equal(got["params"][-1], results[root]["pairs"]["params"][-1])
        assert got["infos"] == results[root]["pairs"]["infos"]
    # Rank 2's pair started from model_for(seed=2); rank 0's from the reference's weights.
    p, q = results[0]["pairs"]["params"][-1], ref["params"][-1]
    assert float((p - q).abs().max()) <= RTOL * float(q.abs().max())


def test_mismatched_settings_and_rejected_batches_raise_on_every_rank() -> None:
    res = {r: trained(2)[r]["errors"] for r in range(2)}
    for r in range(2):
        assert res[r]["rule"] == (
            "the LevenbergMarquardt settings must be the same on all 2 ranks of the process "
            "group, but damping_rule differs (rank 0: 'nielsen', rank 1: 'multiplicative')"
        )
        assert (
            "parameter shapes differs (rank 0: [(5, 1), (5,), (1, 5), (1,)], " in (res[r]["shape"])
        )
        assert "rank 1: [(6, 1), (6,), (1, 6), (1,)])" in res[r]["shape"]
        assert res[r]["unchanged"] is True
        assert res[r]["after"]["accepted"]
    assert res[1]["batch"].startswith("TypeError: inputs dtype torch.float32 does not match")
    assert res[0]["batch"] == (
        "ValueError: step() rejected the batch on rank(s) [1] of 2; see the error raised "
        "there. No rank changed its parameters."
    )
    assert res[0]["after"] == res[1]["after"]


@pytest.mark.parametrize("job", ["dies", "stalls"])
def test_a_rank_that_dies_or_stalls_mid_step_makes_the_other_fail_fast(job: str) -> None:
    """A dead peer is noticed when its connection drops; a stalled one at the timeout."""
    timeout_s = 2.0
    fn = job_dies if job == "dies" else job_stalls
    results = run_ranks(fn, 2, timeout_s=timeout_s, deadline_s=30.0, wait_for=[0])
    assert 1 not in results  # rank 1 exited, or was killed, without writing anything
    res = results[0].value
    assert "over the gloo process group failed on rank 0 of 2" in res["error"]
    assert "Another rank has probably died" in res["error"]
    assert res["steps"] == 1  # the first step completed on both ranks
    assert res["seconds"] < timeout_s + 5.0
    if job == "stalls":
        assert res["seconds"] >= 0.9 * timeout_s
    assert res["unchanged"] is True


# -- without a process group -------------------------------------------------------------------


def test_reducer_and_process_group_together_are_refused() -> None:
    with pytest.raises(ValueError, match="pass either reducer= or process_group=, not both"):
        resolve_reducer(LocalReducer(), process_group=object())
    with pytest.raises(ValueError, match="pass either reducer= or process_group="):
        so.LevenbergMarquardt(model_for(0), reducer=LocalReducer(), process_group=object())


def test_reducer_must_be_a_reducer() -> None:
    with pytest.raises(TypeError, match=r"reducer must be a secondorder.distributed.Reducer"):
        so.LevenbergMarquardt(model_for(0), reducer="gloo")  # type: ignore[arg-type]


def test_process_group_reducer_needs_an_initialised_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group"):
        ProcessGroupReducer()
    assert isinstance(resolve_reducer(None), LocalReducer)
