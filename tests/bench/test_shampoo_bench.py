"""The Shampoo family of the benchmark on tiny configurations: structure and honesty.

Honesty: a row of the report is the optimizer it names, run on the batches every other
row sees (the runner's Shampoo and AdamW equal a hand loop bitwise, with the stage
timers in place), and the bytes a real 2-rank gloo run hands to its all-gather equal
the count from the LPT block ownership.  Timings are never asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Any

import pytest
import torch

from benchmarks import bench, shampoo_methods, shampoo_scaling
from benchmarks.core import batches, run_method
from benchmarks.scaling import Traffic, launch_ranks
from benchmarks.shampoo_methods import (
    STAGES,
    make_problem,
    methods_for,
    shampoo_method,
    shampoo_options,
    stage_timing,
)
from benchmarks.shampoo_scaling import Config, blocks_of, gather_bytes, paper_table
from secondorder.shampoo import Shampoo
from secondorder.shampoo.agreement import header_bytes

OURS = ("shampoo", "shampoo_f100", "soap", "shampoo_adamw")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One torch thread: on a loaded 2-core machine a 2-thread eigh spins for seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits_problem() -> Any:
    pytest.importorskip("sklearn")
    return make_problem("shampoo_digits_mlp", "tiny")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("sklearn")
    tmp = tmp_path_factory.mktemp("shampoo_bench")
    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            *("bench", "--tiny", "--threads", "1", "--problems", "shampoo_digits_mlp"),
            *("--methods", *OURS, "--out", str(tmp / "out"), "--json", str(tmp / "b.json")),
        ]
    )
    assert bench.run_bench(args) == 0
    return {"json": json.loads((tmp / "b.json").read_text()), "dir": tmp}


def test_family_is_in_the_suite_with_distinct_keys() -> None:
    assert set(shampoo_methods.PROBLEMS) <= set(bench.PROBLEMS)
    assert set(shampoo_methods.METHODS) <= set(bench.METHODS)
    assert len(bench.PROBLEMS) == len(set(bench.PROBLEMS))
    assert len(bench.METHODS) == len(set(bench.METHODS))


def test_json_structure(tiny_run: dict[str, Any]) -> None:
    data = tiny_run["json"]
    assert data["mode"] == "tiny" and data["machine"]["threads"] == 1
    assert {"pytorch_optimizer", "heavyball", "mnist1d"} <= set(data["machine"])
    assert data["shampoo_scaling"] is None  # the gloo measurement runs on quick/full only
    p = data["problems"]["shampoo_digits_mlp"]
    names = [m["name"] for m in p["methods"]]
    assert names == [
        "secondorder Shampoo (freq 1)",
        "secondorder Shampoo (freq 4)",
        "secondorder SOAP (freq 4)",
        "torch.optim.AdamW (lr 0.003)",
    ]
    steps = {m["name"]: m["steps"][-1] for m in p["methods"]}
    assert steps["secondorder Shampoo (freq 1)"] == 6  # freq1_steps
    assert steps["torch.optim.AdamW (lr 0.003)"] == 12
    for m in p["methods"]:
        assert m["status"] == "ok"
        assert len(m["stages"]["step"]) == len(m["step_seconds"])
        # step() is part of the timed iteration
        assert all(s <= it for s, it in zip(m["stages"]["step"], m["step_seconds"], strict=True))
        if m["name"].startswith("secondorder"):
            assert set(STAGES) | {"step"} == set(m["stages"])
            for i, total in enumerate(m["stages"]["step"]):
                named = sum(m["stages"][s][i] for s in STAGES)
                assert named == pytest.approx(total, rel=1e-9, abs=1e-12)
        else:
            assert set(m["stages"]) == {"step"}
    ratios = {r["method"]: r for r in p["shampoo_ratios"]}
    assert set(ratios) == set(names[:3])
    for r in ratios.values():
        assert r["step_ratio"] > 0 and r["iteration_ratio"] > 0
        assert r["reference_step_ratio"] is None  # the issue measured the MNIST-1D CNN only


def test_report_and_plot(tiny_run: dict[str, Any]) -> None:
    md = (tiny_run["dir"] / "out" / "bench.md").read_text()
    assert "x AdamW step" in md and "Shampoo factor / root / precond / graft / other" in md
    assert (tiny_run["dir"] / "out" / "bench_shampoo_digits_mlp.png").stat().st_size > 0


def _hand_loop(problem: Any, make_opt: Any, steps: int) -> dict[str, torch.Tensor]:
    model = problem.make_model()
    opt = make_opt(list(model.parameters()))
    k, epoch = 0, 0
    while k < steps:
        for x, y in batches(problem, epoch):
            opt.zero_grad(set_to_none=True)
            problem.loss(model(x), y).backward()
            opt.step()
            k += 1
            if k == steps:
                break
        epoch += 1
    return model.state_dict()


@pytest.mark.parametrize("corrected", [False, True], ids=["shampoo", "soap"])
def test_runner_equals_a_hand_loop_of_so_shampoo_bitwise(digits_problem: Any, corrected: bool):
    """The runner, its batches and the stage timers change nothing: same bits."""
    method = shampoo_method(digits_problem, 4, corrected)
    result = run_method(digits_problem, method)
    assert result.steps[-1] == 12 and result.final_state is not None
    options = shampoo_options(digits_problem, 4, corrected)
    ref = _hand_loop(digits_problem, lambda ps: Shampoo(ps, **options), 12)
    start = digits_problem.make_model().state_dict()
    for k, v in ref.items():
        assert torch.equal(result.final_state[k], v), k
        assert not torch.equal(v, start[k]), k  # it trained


def test_runner_equals_a_hand_loop_of_adamw_bitwise(digits_problem: Any) -> None:
    (method,) = methods_for(digits_problem, ["shampoo_adamw"])
    result = run_method(digits_problem, method)
    ref = _hand_loop(
        digits_problem, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=1e-4), 12
    )
    assert result.final_state is not None
    for k, v in ref.items():
        assert torch.equal(result.final_state[k], v), k


def test_stage_timing_sees_every_stage_and_restores_the_functions() -> None:
    from secondorder.shampoo import preconditioner as pc
    from secondorder.shampoo import update as opt_mod

    before = (pc.Preconditioner.amortize, opt_mod.updated_grafting)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4))
    opt = Shampoo([w], **shampoo_options(_P(), 1, False))
    spent: dict[str, float] = {}
    with stage_timing(spent):
        w.grad = torch.randn(6, 4)
        opt.step()
    assert {"factor", "root", "precondition", "grafting"} <= set(spent)
    assert all(v > 0 for v in spent.values())
    assert (pc.Preconditioner.amortize, opt_mod.updated_grafting) == before


class _P:
    """A stand-in problem for :func:`shampoo_options` (it reads one setting)."""

    def setting(self, name: str, default: Any = None) -> Any:
        return default


def test_other_families_problems_get_no_shampoo_rows() -> None:
    lm_problem = bench.build_problems(tiny=True, keys=["sinc"])["sinc"]
    assert methods_for(lm_problem) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key": "mnist1d"}, "Unknown Shampoo problem key='mnist1d'; valid choices"),
        ({"key": "shampoo_digits_mlp", "mode": "fast"}, "Unknown mode='fast'; valid choices"),
    ],
)
def test_bad_problem_arguments(kwargs: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_problem(**kwargs)


def test_full_cnn_is_the_issues_network() -> None:
    shapes = [tuple(p.shape) for p in shampoo_methods.mnist1d_cnn()().parameters()]
    assert shapes == [(32, 1, 5), (32,), (32, 32, 3), (32,), (256, 1280), (256,), (10, 256), (10,)]
    assert sum(math.prod(s) for s in shapes) == 333_802


# -- the all-gather of directions: counted on 2 gloo ranks against the formula ----------------

TINY = Config(channels=4, hidden=16, batch=32, steps=3, samples=250, frequency=1)
TINY_BF16 = Config(
    channels=4,
    hidden=16,
    batch=32,
    steps=3,
    samples=250,
    frequency=2,
    communication_dtype="bfloat16",
)
CNN_SHAPES = [(32, 1, 5), (32,), (32, 32, 3), (32,), (256, 1280), (256,), (10, 256), (10,)]


def both_configs(rank: int, world: int) -> list[dict[str, Any]]:
    """One launch, two configurations (each launch costs seconds)."""
    return [shampoo_scaling.rank_job(rank, world, c) for c in (TINY, TINY_BF16)]


@functools.cache
def two_ranks() -> dict[int, list[dict[str, Any]]]:
    pytest.importorskip("mnist1d")
    return launch_ranks(both_configs, 2, deadline_s=180)


def test_blocks_of_the_cnn_by_hand() -> None:
    # conv1 (32,1,5) -> (160,); conv2 (32,32,3) -> (32, 96); Linear(1280, 256) cut at 1024
    assert blocks_of(CNN_SHAPES) == [
        (160,), (32,), (32, 96), (32,), (256, 1024), (256, 256), (256,), (10, 256), (10,)
    ]  # fmt: skip


def test_gather_formula_by_hand() -> None:
    # LPT: the (256, 1024) block outweighs every other block together, so it is rank 0's alone
    assert gather_bytes(CNN_SHAPES, 2, 4) == [256 * 1024 * 4, (333_802 - 256 * 1024) * 4]
    for p in (1, 8, 64):
        assert sum(gather_bytes(CNN_SHAPES, p, 2)) == 333_802 * 2


def test_paper_model_rows() -> None:
    rows = paper_table([("cnn", CNN_SHAPES)], bench.scaling_module.ModelAssumptions())
    assert sorted((r["ranks"], r["frequency"], r["dtype_bytes"]) for r in rows) == sorted(
        (p, f, b) for p in (1, 8, 64) for f in (1, 100) for b in ((4,) if p == 1 else (4, 2))
    )
    for r in rows:
        p, b = r["ranks"], r["dtype_bytes"]
        assert r["received_balanced"] == pytest.approx((p - 1) / p * 333_802 * b)
        assert r["received_padded"] == (p - 1) * max(gather_bytes(CNN_SHAPES, p, b))
        assert r["received_padded"] >= r["received_balanced"]
        assert 0 < r["balance"] <= 1 + 1e-12
        assert (r["comm_s"] == 0) == (p == 1)


@pytest.mark.distributed
@pytest.mark.parametrize("which", [0, 1], ids=["float32_freq1", "bfloat16_freq2"])
def test_counted_gather_bytes_equal_the_formula_on_two_ranks(which: int) -> None:
    config = (TINY, TINY_BF16)[which]
    results = two_ranks()
    itemsize = 2 if config.communication_dtype == "bfloat16" else 4
    recs = [results[r][which] for r in (0, 1)]
    formula = gather_bytes(recs[0]["shapes"], 2, itemsize)
    n = sum(math.prod(s) for s in recs[0]["shapes"])
    assert sum(formula) == n * itemsize
    for rank, rec in enumerate(recs):
        assert len(rec["traffic"]) == config.steps
        header = header_bytes(len(recs[0]["shapes"]), 1)
        for step, t in enumerate(rec["traffic"]):
            # one all-gather of directions (with the ranks' tally: failure flag and
            # settings), and gather_rows' exchange of row counts; building the state
            # at the first step adds one all-reduce of the ranks' refusal flags
            expected = Traffic(
                allgather=formula[rank] + header,
                allgather_calls=1,
                allreduce=2 * 2 * 8 + (2 * 8 if step == 0 else 0),
                allreduce_calls=2 if step == 0 else 1,
            )
            assert Traffic(**t) == expected, f"rank {rank} step {step}"
        grads = n * 4  # float32 gradients all-reduced, as DDP does
        assert all(t["allreduce"] == grads for t in rec["grad_traffic"])
    assert recs[0]["params"] == recs[1]["params"]  # every rank applies the same update


@pytest.mark.slow
def test_peers_run_or_say_why() -> None:
    problem = make_problem("shampoo_digits_mlp", "tiny")
    rows = methods_for(problem, ["shampoo_peers"])
    assert [m.name.split(" (")[0] for m in rows][-1].startswith("heavyball")
    for m in rows:
        r = run_method(problem, m)
        assert r.status in ("ok", "skipped"), (m.name, r.status)
        assert r.status == "ok" or r.note


@pytest.mark.slow
def test_mnist1d_split() -> None:
    pytest.importorskip("mnist1d")
    (x, y), (xt, _) = shampoo_methods.mnist1d(5000)
    assert x.shape == (4000, 40) and xt.shape == (1000, 40)
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))


def test_entry_point_arguments() -> None:
    from benchmarks.shampoo_bench import argv_for

    args = argv_for(["--quick"])
    assert args[:4] == ["--quick", "--problems", *shampoo_methods.PROBLEMS]
    assert args[args.index("--threads") + 1] == "1" and "--no-scaling" in args
    assert argv_for(["--threads", "2", "--methods", "soap"]).count("--threads") == 1
    assert argv_for(["--methods", "soap"]).count("--methods") == 1
