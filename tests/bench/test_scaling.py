"""The communication model against the bytes a real 2-rank gloo run hands to its reducer.

:class:`~benchmarks.scaling.CountingReducer` is the real ``ProcessGroupReducer`` with
a tally; two spawned ranks train one problem in each form, and every step's tally
must equal :func:`~benchmarks.scaling.step_traffic` for that step's attempts and CG
iterations.  The same launch checks CG with a forcing term across ranks against a
single process on the concatenated batch.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict
from typing import Any

import pytest
import torch

from benchmarks import scaling as scaling_cli
from benchmarks.scaling import (
    FORMS,
    Problem,
    Traffic,
    comm_seconds,
    launch,
    paper_table,
    run_form,
    step_flops,
    step_traffic,
)

gloo = pytest.mark.distributed

#: n = 2·6 + 6 + 6·6 + 6 + 6 + 1 = 67 parameters; 64 residuals (primal, CG) or 16 (dual),
#: split evenly over 2 ranks.
SMALL = Problem(inputs=2, hidden=6, primal_samples=64, dual_samples=16, steps=3, cg_max_iter=500)
#: Options beyond each form's own: the launch also covers CG with a forcing term and
#: the NumPy linear-algebra backend across ranks (neither changes what travels).
EXTRA: dict[str, dict[str, Any]] = {
    "cg": {"cg_forcing": 0.5, "cg_rtol": 1e-10},
    "primal": {"linalg_backend": "numpy"},
    "dual": {"linalg_backend": "numpy", "solver": "eigh"},
}


@functools.cache
def two_ranks() -> dict[int, list[dict[str, Any]]]:
    return launch(2, SMALL, tuple(FORMS), extra=EXTRA, deadline_s=120)


@gloo
@pytest.mark.parametrize("form", list(FORMS))
def test_counted_bytes_equal_the_model_on_every_step_and_rank(form):
    results = two_ranks()
    for rank in (0, 1):
        (rec,) = [r for r in results[rank] if r["form"] == form]
        assert rec["n"] == 67 and rec["rows"] == SMALL.samples(form) // 2
        for step, (counted, a, k) in enumerate(
            zip(rec["traffic"], rec["attempts"], rec["cg_iterations"], strict=True)
        ):
            model = step_traffic(form, rec["n"], rec["rows"], 2, attempts=a, cg_iterations=k)
            assert Traffic(**counted) == model, f"rank {rank} step {step}"
            assert counted["allreduce"] > 0 and counted["broadcast"] > 0
        if form == "primal":
            assert all(t["allreduce"] >= 67 * 67 * 8 for t in rec["traffic"])
        if form == "dual":
            assert all(t["allgather"] == 8 * 68 * 8 for t in rec["traffic"])
        if form == "cg":
            assert all(k >= 1 for k in rec["cg_iterations"])


@gloo
@pytest.mark.parametrize("form", list(FORMS))
def test_two_ranks_equal_one_process_and_agree_bitwise(form):
    """CG with a forcing term (its tolerance comes from summed quantities, so every
    rank stops after the same iteration) and the NumPy backend behind the broadcast."""
    results = two_ranks()
    ranks = [next(r for r in results[k] if r["form"] == form) for k in (0, 1)]
    single = run_form(SMALL, form, 0, 1, None, EXTRA[form])
    for step in range(SMALL.steps):
        assert torch.equal(ranks[0]["params"][step], ranks[1]["params"][step])
        p, q = ranks[0]["params"][step], single["params"][step]
        assert float((p - q).abs().max()) <= 1e-9 * float(q.abs().max()), step
    for key in ("attempts", "cg_iterations", "solver"):
        assert ranks[0][key] == ranks[1][key] == single[key], key
    backend = EXTRA[form].get("linalg_backend", "torch")
    assert ranks[0]["solver"].endswith(f" on {backend}")
    assert single["loss"][-1] < single["loss"][0]


def test_single_process_traffic_is_zero_and_the_unknown_form_is_named():
    assert step_traffic("primal", 100, 10, 1, attempts=3) == Traffic()
    with pytest.raises(ValueError, match=r"Unknown form='svd'; valid choices are \('primal'"):
        step_traffic("svd", 10, 10, 2)
    with pytest.raises(ValueError, match=r"Unknown form='svd'"):
        step_flops("svd", 10, 10, 2)


def test_the_forms_scale_with_n_squared_rows_and_iterations():
    base = step_traffic("primal", 1000, 50, 4).allreduce
    assert step_traffic("primal", 2000, 50, 4).allreduce - base == 8 * (2000**2 - 1000**2) + 16_000
    cg = [step_traffic("cg", 1000, 50, 4, cg_iterations=k).allreduce for k in (0, 10)]
    assert cg[1] - cg[0] == 10 * 1000 * 8
    dual = step_traffic("dual", 1000, 50, 4)
    assert dual.allgather == 50 * 1001 * 8 and dual.allgather_calls == 1


def test_comm_seconds_is_the_ring_formula():
    bw, lat = 10e9, 2e-6
    t = Traffic(allreduce=8_000_000, allreduce_calls=3)
    assert comm_seconds(t, 8, bw, lat) == pytest.approx(2 * 7 / 8 * 8e6 / bw + 3 * 2 * 7 * lat)
    g = Traffic(allgather=1_000_000, allgather_calls=1)
    assert comm_seconds(g, 64, bw, lat) == pytest.approx(63 * 1e6 / bw + 63 * lat)
    b = Traffic(broadcast=4000, broadcast_calls=2)
    assert comm_seconds(b, 8, bw, lat) == pytest.approx(4000 / bw + 3 * 2 * lat)
    assert comm_seconds(t + g + b, 1, bw, lat) == 0.0


def test_paper_table_shows_where_each_form_stops_scaling():
    rows = {(r["problem"][:4], r["form"], r["ranks"]): r for r in paper_table(_assumptions())}
    # The Gram's all-reduce does not shrink with more GPUs (only the agreements grow:
    # a flag, a count and an lr per rank in the batch check, a flag per rank for the
    # memory plan); CG's latency grows.
    primal = [rows["tall", "primal", p]["allreduce_bytes"] for p in (8, 64)]
    assert primal[1] - primal[0] == 8 * (3 + 1) * (64 - 8)
    assert primal[0] > 1e4**2 * 8
    assert rows["tall", "cg", 64]["comm_s"] > rows["tall", "cg", 8]["comm_s"]
    # The dual form gathers all of J: 1e4 rows of 1e6 + 1 float64 numbers.
    assert rows["wide", "dual", 8]["allgather_bytes"] == 10_000 * 1_000_001 * 8
    assert all(r["total_s"] == r["comm_s"] + r["compute_s"] for r in rows.values())


def _assumptions() -> Any:
    from benchmarks.scaling import ModelAssumptions

    return ModelAssumptions()


def test_cli_prints_the_model_and_writes_json(tmp_path, capsys):
    path = tmp_path / "scaling.json"
    assert scaling_cli.main(["--no-measure", "--json", str(path), "--bandwidth", "5e10"]) == 0
    out = capsys.readouterr().out
    assert "| problem | form | GPUs |" in out and "β = 50 GB/s" in out
    payload = json.loads(path.read_text())
    assert payload["model"]["assumptions"]["bandwidth"] == 5e10
    assert len(payload["model"]["rows"]) == 12
    assert all(math.isfinite(r["total_s"]) for r in payload["model"]["rows"])


def test_cli_refuses_a_bad_bandwidth():
    with pytest.raises(SystemExit, match=r"--bandwidth must be a finite number > 0, got -1"):
        scaling_cli.main(["--no-measure", "--bandwidth", "-1"])


@gloo
@pytest.mark.slow
def test_cli_quick_measurement_counts_what_the_model_predicts(tmp_path, capsys):
    path = tmp_path / "scaling.json"
    assert scaling_cli.main(["--quick", "--ranks", "1", "2", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["measured"]
    assert {(r["form"], r["ranks"]) for r in rows} == {(f, w) for f in FORMS for w in (1, 2)}
    for r in rows:
        assert r["bytes_per_step"] == r["model_bytes_per_step"]
        assert (r["bytes_per_step"] > 0) == (r["ranks"] > 1)
        assert r["s_per_step"] > 0
    assert "| form | ranks |" in capsys.readouterr().out


def test_report_without_measurement_is_the_paper_model():
    from benchmarks.scaling import ModelAssumptions, paper_table, report

    a = ModelAssumptions()
    text, out = report(None, (1, 2), a)
    assert "measured" not in out
    assert out["model"]["rows"] == paper_table(a)
    # One markdown row per model row, each naming its problem, form and GPU count.
    rows = [line for line in text.splitlines() if line.startswith(("| tall", "| wide"))]
    assert len(rows) == len(out["model"]["rows"])
    for line, row in zip(rows, out["model"]["rows"], strict=True):
        assert line.startswith(f"| {row['problem']} | {row['form']} | {row['ranks']} |")


def count_one_sum(rank: int, world: int, size: int) -> dict[str, Any]:
    """A family-agnostic per-rank job: one counted all-reduce of ``size`` float64."""
    from dataclasses import asdict

    from benchmarks.scaling import CountingReducer

    reducer = CountingReducer()
    t = torch.full((size,), float(rank + 1), dtype=torch.float64)
    reducer.take()
    reducer.sum_([t])
    return {"value": t, "seconds": [0.0], "traffic": [asdict(reducer.take())]}


@gloo
def test_measure_worlds_runs_any_job_and_counts_its_bytes():
    from benchmarks.scaling import measure_worlds

    out = measure_worlds(count_one_sum, (2,), (10,), deadline_s=120)
    assert sorted(out) == [2] and sorted(out[2]) == [0, 1]
    # The all-reduced value equals the sum a single process computes over the ranks' parts.
    for world, by_rank in out.items():
        expected = torch.full((10,), float(sum(range(1, world + 1))), dtype=torch.float64)
        for rec in by_rank.values():
            assert torch.equal(rec["value"], expected)
    for rank in (0, 1):
        assert out[2][rank]["traffic"] == [asdict(Traffic(allreduce=80, allreduce_calls=1))]


def test_step_summary_leaves_out_the_first_step_and_averages_the_bytes():
    from benchmarks.scaling import step_summary

    traffic = [asdict(Traffic(allreduce=100, broadcast=20)), asdict(Traffic(allgather=40))]
    s = step_summary([9.0, 1.0, 3.0], [*traffic, asdict(Traffic())])
    assert s == {"s_per_step": 2.0, "bytes_per_step": 160 / 3}
    assert step_summary([5.0], traffic[:1])["s_per_step"] == 5.0
