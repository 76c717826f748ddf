"""The K-FAC family in the benchmark, checked against references on tiny configurations.

* The ``kfac`` row through the harness's runner equals a hand loop of
  :class:`secondorder.KFACOptimizer` on the same batches, bitwise (the timing wrappers
  and the split of ``step`` into K-FAC and SGD change nothing).
* Bytes counted on a real 2-rank gloo launch equal :func:`kfac_scaling.step_traffic`
  on every step and rank, for COMM-OPT, MEM-OPT and HYBRID-OPT, and the ranks end
  bitwise equal.
* The traffic formula against hand counts of a two-layer network; the paper model's
  shape; the workloads and the suite's structure.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict
from typing import Any

import pytest
import torch

from benchmarks import bench, kfac_methods, kfac_scaling
from benchmarks.core import batches, run_method, run_problem
from benchmarks.kfac_scaling import LayerSpec, linear_spec, step_traffic
from benchmarks.scaling import Traffic
from secondorder import KFACOptimizer

gloo = pytest.mark.distributed


@functools.cache
def _problem(key: str) -> Any:
    return kfac_methods.make_problem(key, "tiny")


def test_runner_kfac_row_equals_a_hand_loop_of_kfac_optimizer_bitwise() -> None:
    problem = _problem("mnist1d_cnn")  # Conv1d and Linear layers
    # the wrapper the suite's rows use; updates on every other step
    method = kfac_methods.guarded(kfac_methods.kfac_method(problem, 2))
    result = run_method(problem, method)
    assert result.status == "ok" and result.steps[-1] == problem.max_steps

    model = problem.make_model()
    opt = KFACOptimizer(model, **kfac_methods.kfac_options(problem, 2))
    k, epoch = 0, 0
    while k < problem.max_steps:
        for xb, yb in batches(problem, epoch):
            opt.zero_grad(set_to_none=True)
            problem.loss(model(xb), yb).backward()
            opt.step()
            k += 1
            if k == problem.max_steps:
                break
        epoch += 1
    assert result.final_state is not None
    for name, value in model.state_dict().items():
        assert torch.equal(result.final_state[name], value), name
    # every step reports its phases, and they sum to at most the step's time
    for phase in kfac_methods.PHASES:
        assert len(result.stages[phase]) == problem.max_steps
    total = [sum(result.stages[p][i] for p in kfac_methods.PHASES) for i in range(3)]
    assert all(t <= s * 1.0001 for t, s in zip(total, result.step_seconds, strict=False))


def test_tiny_suite_structure_and_ratio_section() -> None:
    problem = _problem("mnist1d_cnn")
    fam = kfac_methods.family()
    methods = kfac_methods.methods_for(problem, ("kfac", "kfac_every1", "sgd"))
    assert [m.name for m in methods] == [
        "K-FAC+SGD every 10 (lr 0.1)",
        "K-FAC+SGD every step (lr 0.1)",
        "SGD (lr 0.1)",
    ]
    pr = run_problem(problem, methods, fam.sections, log=lambda _: None)
    rows = kfac_methods.ratios(pr)
    assert [r["method"] for r in rows] == [m.name for m in methods[:2]]
    sgd_mean = sum(pr.methods[2].step_seconds[1:]) / (len(pr.methods[2].step_seconds) - 1)
    for r, m in zip(rows, pr.methods, strict=False):
        mean = sum(m.step_seconds[1:]) / (len(m.step_seconds) - 1)
        assert math.isclose(r["ratio_vs_sgd"], mean / sgd_mean)
        assert set(r["phases_s"]) == set(kfac_methods.PHASES)
    assert pr.methods[1].steps[-1] == problem.setting("every1_steps")
    text = "\n".join(kfac_methods.ratio_lines(pr))
    assert "| K-FAC+SGD every 10 (lr 0.1) |" in text and "x SGD" in text
    # the methods table shows K-FAC's phase column and '-' for SGD
    assert kfac_methods.phase_cell(pr.methods[2]) == "-"
    assert kfac_methods.phase_cell(pr.methods[0]).count(" / ") == len(kfac_methods.PHASES) - 1


def test_family_methods_stay_on_its_problems_and_bench_routes_by_owner() -> None:
    lm_problem = bench.build_problems(tiny=True, keys=["sinc"])["sinc"]
    assert kfac_methods.methods_for(lm_problem) == []
    assert set(bench.FAMILY_PROBLEMS["kfac"]) == set(kfac_methods.PROBLEMS)
    assert set(kfac_methods.METHODS) <= set(bench.METHODS)
    # the LM suite's default problems are unchanged by the new family
    assert bench.FAMILY_PROBLEMS["lm"] == ("sinc", "sinc_large", "digits_mlp", "digits_cnn",
                                          "wide_dual", "wide_cg")  # fmt: skip


def test_unknown_problem_and_mode_are_named() -> None:
    with pytest.raises(ValueError, match="Unknown K-FAC problem key='nope'"):
        kfac_methods.make_problem("nope")
    with pytest.raises(ValueError, match="Unknown mode='huge'"):
        kfac_methods.make_problem("autoencoder", "huge")
    with pytest.raises(ValueError, match="Unknown strategy='FAST'"):
        kfac_scaling.grad_workers("FAST", 2)
    with pytest.raises(ValueError, match="Unknown network='vgg'"):
        kfac_scaling.ScalingProblem(network="vgg").model()


def test_workloads_shapes_and_the_issue_network() -> None:
    from benchmarks.workloads import autoencoder, mnist1d, mnist1d_cnn

    (x, y), (xt, _) = mnist1d(250)
    assert x.shape == (200, 40) and xt.shape == (50, 40)
    assert y.dtype == torch.int64 and int(y.max()) <= 9
    net = mnist1d_cnn()()
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(1280, 256), (256, 10)]
    assert net(x[:3]).shape == (3, 10)
    ae = autoencoder([64, 32, 8, 32, 64])()
    kinds = [type(m).__name__ for m in ae]
    # a linear code: no activation after the layer into the code
    assert kinds == ["Linear", "Sigmoid", "Linear", "Linear", "Sigmoid", "Linear", "Sigmoid"]


def test_step_traffic_by_hand_for_two_linear_layers() -> None:
    a, b = linear_spec("a", 3, 4), linear_spec("b", 4, 2)  # A 4x4, G 4x4; A 5x5, G 2x2
    layers = [a, b]
    params = 4 * 4 + 2 * 5
    assert step_traffic(layers, 1, 1, 0, factor_update=True, inverse_update=True) == Traffic()
    # COMM-OPT on 2 ranks with a on rank 1 and b on rank 0: full factors, then packed
    # the agreement tables: 2 ranks × (1 + 9) and 2 × 1 float64 numbers, in two calls
    agree = 8 * 2 * (10 + 1)
    assert kfac_scaling.agreement_traffic(2, 2) == Traffic(allreduce=agree, allreduce_calls=2)
    t = step_traffic(
        layers, 2, 2, 0, factor_update=True, inverse_update=True, assignment={"a": 1, "b": 0}
    )
    assert t == Traffic(
        allreduce=4 * params + 4 * (16 + 16 + 25 + 4) + 16 * 2 + agree,
        allreduce_calls=4,
        broadcast=4 * ((16 + 16) + (25 + 4)),
        broadcast_calls=2,
    )
    factors = (4 * 5 // 2 + 4 * 5 // 2) + (5 * 6 // 2 + 2 * 3 // 2)
    t = step_traffic(
        layers, 2, 2, 0, factor_update=True, inverse_update=True, packed=True,
        assignment={"a": 1, "b": 0},
    )  # fmt: skip
    assert t == Traffic(
        allreduce=4 * params + 4 * factors + 16 * 2 + agree,
        allreduce_calls=4,
        broadcast=4 * ((16 + 16) + (25 + 4)),
        broadcast_calls=2,
    )
    # MEM-OPT: no decompositions travel; every preconditioned gradient does, one call per
    # owning rank; without a factor update only the gradients move.
    t = step_traffic(
        layers, 2, 1, 1, factor_update=False, inverse_update=True, assignment={"a": 1, "b": 0}
    )
    assert t == Traffic(
        allreduce=4 * params + agree, allreduce_calls=3, broadcast=4 * params, broadcast_calls=2
    )
    # eigen sends the spectra too
    assert LayerSpec("c", 1, 5, 2, 10).inverse_numbers("eigen") == 25 + 4 + 5 + 2


def test_paper_table_rows_and_where_strategies_differ() -> None:
    rows = kfac_scaling.paper_table(kfac_scaling.KFACAssumptions())
    assert len(rows) == 2 * 3 * 2
    by = {(r["network"][:5], r["strategy"], r["gpus"]): r for r in rows}
    for gpus in (8, 64):
        comm, mem = by[("BERT-", "COMM-OPT", gpus)], by[("BERT-", "MEM-OPT", gpus)]
        # MEM-OPT sends every preconditioned gradient each step; COMM-OPT only the
        # gradient all-reduce between updates: more bytes per step for MEM-OPT here
        assert mem["bytes_per_step"] > comm["bytes_per_step"]
        assert by[("BERT-", "HYBRID-OPT", gpus)]["k"] == gpus // 2
    for r in rows:
        assert math.isclose(r["total_s"], r["comm_s"] + r["compute_s"])


def _assert_counts_match(raw: dict[int, Any], problem: kfac_scaling.ScalingProblem) -> None:
    for rank, recs in raw.items():
        assert [r["strategy"] for r in recs] == list(kfac_scaling.STRATEGIES)
        for rec in recs:
            layers = [LayerSpec(**d) for d in rec["layers"]]
            for i, counted in enumerate(rec["traffic"]):
                model = step_traffic(
                    layers,
                    2,
                    rec["grad_workers"],
                    rank,
                    factor_update=rec["factor_update"][i],
                    inverse_update=rec["inverse_update"][i],
                    method=problem.method,
                    packed=problem.packed,
                    total_params=rec["params"],
                    assignment=rec["assignment"],
                )
                assert counted == asdict(model), (rank, rec["strategy"], i)


TINY_SCALING = kfac_scaling.ScalingProblem(network="tiny_mlp", batch=8, steps=3, every=2)


@gloo
def test_counted_bytes_on_two_gloo_ranks_equal_the_formula_and_ranks_agree() -> None:
    rows, raw = kfac_scaling.measure(TINY_SCALING, (2,), deadline_s=120)
    _assert_counts_match(raw[2], TINY_SCALING)
    # steps 0 and 2 update factors and inverses, step 1 does not: the formula's two cases
    assert raw[2][0][0]["factor_update"] == [True, False, True]
    for r in rows:
        assert r["ranks_agree_bitwise"] and r["bytes_per_step"] == r["model_bytes_per_step"]
    by = {r["strategy"]: r for r in rows}
    assert by["COMM-OPT"]["grad_workers"] == 2 and by["MEM-OPT"]["grad_workers"] == 1
    # on 2 ranks HYBRID-OPT's k = round(2 * 0.5) = 1: MEM-OPT's traffic
    assert by["HYBRID-OPT"]["bytes_per_step"] == by["MEM-OPT"]["bytes_per_step"]


@pytest.mark.slow
@gloo
def test_eigen_unpacked_on_four_ranks_hybrid_differs_and_counts_match() -> None:
    problem = kfac_scaling.ScalingProblem(
        network="tiny_mlp", batch=8, steps=2, every=1, method="eigen", packed=False
    )
    rows, raw = kfac_scaling.measure(problem, (4,), deadline_s=300)
    for rank, recs in raw[4].items():
        for rec in recs:
            layers = [LayerSpec(**d) for d in rec["layers"]]
            for counted in rec["traffic"]:
                model = step_traffic(
                    layers, 4, rec["grad_workers"], rank, factor_update=True,
                    inverse_update=True, method="eigen", packed=False,
                    total_params=rec["params"], assignment=rec["assignment"],
                )  # fmt: skip
                assert counted == asdict(model)
    assert {r["strategy"]: r["grad_workers"] for r in rows}["HYBRID-OPT"] == 2


def test_a_failing_step_ends_only_its_row_with_the_error_named() -> None:
    from benchmarks.core import Method, StepReport, torch_optimizer

    problem = _problem("mnist1d_cnn")
    sgd = torch_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))

    def make(problem: Any, model: torch.nn.Module) -> Any:
        inner = sgd(problem, model)
        calls = [0]

        def step(x: torch.Tensor, y: torch.Tensor) -> StepReport:
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("linalg.cholesky: not positive-definite")
            return inner(x, y)

        return step

    result = run_method(problem, kfac_methods.guarded(Method(name="x", family="t", make=make)))
    assert result.status == "failed"
    assert result.note.startswith("step 3 raised RuntimeError: linalg.cholesky")
    assert len(result.step_seconds) == 2 and result.steps[-1] == 2
    # the row's last point is the model after its two good steps, as the plain runner gives
    plain = run_method(problem, Method(name="y", family="t", make=sgd, max_steps=2, eval_every=1))
    assert result.losses[-1] == plain.losses[-1]


def test_bench_cli_runs_the_family_and_writes_its_sections_and_plots(tmp_path: Any) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["bench", "--tiny", "--family", "kfac", "--problems", "mnist1d_cnn", "--methods",
         "kfac", "sgd", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "b.json")]
    )  # fmt: skip
    assert bench.run_bench(args) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["command"].startswith("python -m benchmarks.bench --tiny --family kfac")
    (problem,) = data["problems"].values()
    assert [m["name"] for m in problem["methods"]] == [
        "K-FAC+SGD every 10 (lr 0.1)",
        "SGD (lr 0.1)",
    ]
    assert [r["method"] for r in problem["kfac_iteration"]] == ["K-FAC+SGD every 10 (lr 0.1)"]
    assert (tmp_path / "out" / "bench_mnist1d_cnn_steps.png").exists()
    report = (tmp_path / "out" / "bench.md").read_text()
    assert "x SGD" in report and "| method | steps to target |" in report
