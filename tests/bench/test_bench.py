"""The benchmark suite on its tiny configuration: structure and honesty, never timings."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import bench


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_bench_parser(sub)
    return parser.parse_args(
        [
            "bench",
            "--tiny",
            "--floor-reps",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--json",
            str(tmp_path / "bench.json"),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    pytest.importorskip("sklearn")  # digits ships with scikit-learn
    tmp = tmp_path_factory.mktemp("bench")
    args = _args(tmp, "--problems", "sinc", "digits_mlp", "--methods", "lm", "adam", "scipy")
    assert bench.run_bench(args) == 0
    return {"json": json.loads((tmp / "bench.json").read_text()), "dir": tmp}


def test_json_structure(tiny_run: dict[str, object]) -> None:
    data = tiny_run["json"]
    assert isinstance(data, dict)
    assert data["mode"] == "tiny"
    assert {"cpu", "threads", "torch"} <= set(data["machine"])
    assert data["command"].startswith("python -m benchmarks.bench --tiny")
    problems = data["problems"]
    assert list(problems) == ["sinc", "digits_mlp"]
    sinc = problems["sinc"]
    names = [m["name"] for m in sinc["methods"]]
    assert names == [
        "secondorder LM (defaults)",
        "torch.optim.Adam (lr 0.01)",
        "scipy least_squares (lm)",
        "scipy least_squares (trf)",
    ]
    for problem in problems.values():
        for m in problem["methods"]:
            assert len(m["steps"]) == len(m["seconds"]) == len(m["losses"])
            assert m["seconds"] == sorted(m["seconds"])
            assert m["final_loss"] == m["losses"][-1]
            assert m["median_step_s"] > 0
            assert m["reached_target"] == (m["time_to_target_s"] is not None)
            if problem["kind"] == "classification":
                assert len(m["accuracies"]) == len(m["losses"])
                assert 0.0 <= m["final_accuracy"] <= 1.0
        lm = problem["methods"][0]
        assert {"linearize", "solve_and_trials", "attempts"} <= set(lm["stage_medians_s"])
        (floor,) = problem["floor"]
        for key in ("jacobian_s", "gram_s", "factor_solve_s", "gemm_f32_s", "forward_backward_s"):
            assert floor[key] > 0
        assert floor["gram_solve_over_gemm_f32"] > 0
        assert floor["jacobian_over_forward_backward"] > 0
    # The digits MLP has more parameters than a batch has residuals: the dual form.
    assert problems["digits_mlp"]["floor"][0]["form"] == "dual"
    assert "dual" in problems["digits_mlp"]["methods"][0]["settings"]


def test_report_and_plots_written(tiny_run: dict[str, object]) -> None:
    tmp = tiny_run["dir"]
    assert isinstance(tmp, Path)
    report = (tmp / "out" / "bench.md").read_text()
    assert "## sinc:" in report and "## digits_mlp:" in report
    assert "(Gram+solve)/GEMM f32" in report
    assert (tmp / "out" / "bench_sinc.png").stat().st_size > 0
    assert (tmp / "out" / "bench_digits_mlp.png").stat().st_size > 0


def test_losses_match_a_direct_evaluation() -> None:
    sinc = bench.build_problems(tiny=True, keys=["sinc"])["sinc"]
    result = bench.run_problem(
        sinc, methods=("lm", "adam", "scipy"), floor_reps=1, log=lambda s: None
    )
    for m in result.methods:
        assert m.final_state is not None, m.name
        model = sinc.make_model()
        model.load_state_dict(m.final_state)
        with torch.no_grad():
            x, y = sinc.train
            direct = float(((model(x) - y).double() ** 2).mean())
        # The curve's last point is the weights the method ended with (scipy's curve is
        # its own float64 evaluation; the final weights are stored in float32).
        tol = 1e-3 if m.name.startswith("scipy") else 1e-6
        assert math.isclose(m.losses[-1], direct, rel_tol=tol), m.name
    lm, _, sp_lm, _ = result.methods
    # Full batch: the loss LM reports after its step is the loss of its final weights.
    assert math.isclose(lm.reported_loss, lm.losses[-1], rel_tol=1e-4)
    # scipy works in float64; its best loss, re-evaluated in float32, agrees closely.
    assert math.isclose(sp_lm.reported_loss, sp_lm.losses[-1], rel_tol=1e-3)
    assert sp_lm.losses == sorted(sp_lm.losses, reverse=True)


def test_tlm_is_skipped_or_runs() -> None:
    problem = bench.build_problems(tiny=True, keys=["sinc"])["sinc"]
    result = bench.run_tlm(problem)
    try:
        import torch_levenberg_marquardt  # noqa: F401
    except ImportError:
        assert result.status == "skipped"
        assert "pip install" in result.note
    else:
        assert result.status == "ok"
        assert len(result.losses) == len(result.steps) >= 2


def test_bad_threads_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(tmp_path, "--threads", "0")
    assert bench.run_bench(args) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_unknown_problem_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Unknown problems \['nope'\]; valid choices are"):
        bench.build_problems(tiny=True, keys=["nope"])


def _result(name: str, step_s: float, curve: list[tuple[float, float]]) -> bench.MethodResult:
    r = bench.MethodResult(name, "test")
    r.step_seconds = [step_s, step_s]
    for k, (t, loss) in enumerate(curve):
        r.add(k, t, loss, None)
    return r


def test_comparisons_with_peers_are_computed_from_the_curves() -> None:
    problems = bench.build_problems(tiny=True, keys=["sinc", "sinc_large"])
    sinc, large = problems["sinc"], problems["sinc_large"]  # target: MSE <= 1e-6
    ours = _result("secondorder LM (defaults)", 0.1, [(0.0, 1.0), (1.0, 1e-7)])
    never = _result("secondorder LM (fastest)", 0.2, [(0.0, 1.0), (3.0, 1e-3)])
    tlm = _result("torch-levenberg-marquardt 1.2.3", 0.3, [(0.0, 1.0), (20.0, 5e-7)])
    adam = _result("torch.optim.Adam (lr 0.01)", 0.01, [(0.0, 1.0), (5.0, 1e-6)])
    pr = bench.ProblemResult(sinc, [ours, never, tlm, adam], [])
    first, second = pr.comparisons()
    assert first["step_speedup_vs_tlm"] == pytest.approx(3.0)
    assert first["time_to_target_speedup"] == pytest.approx(5.0)  # Adam at 5 s, ours at 1 s
    assert first["peers_reaching_target"] == sorted([adam.name, tlm.name])
    assert second["step_speedup_vs_tlm"] == pytest.approx(1.5)
    assert second["time_to_target_s"] is None and second["time_to_target_speedup"] is None
    report = bench.markdown([pr], "# t")
    assert "torch-levenberg-marquardt's s/step over this config's: 3.00" in report
    assert "fastest peer's time to target over this config's: 5.00" in report

    big = _result("secondorder LM (defaults)", 4.0, [(0.0, 1.0)])
    rows = bench.flop_scaling([pr, bench.ProblemResult(large, [big], [])])
    m1, n1 = sinc.train[0].shape[0], sinc.num_parameters
    m2, n2 = large.train[0].shape[0], large.num_parameters
    factor = (m2 * n2**2) / (m1 * n1**2)
    (row,) = rows
    assert row["flops_factor"] == pytest.approx(factor)
    assert row["ratio"] == pytest.approx(4.0 / (0.1 * factor))
    assert bench.flop_scaling([pr]) == []


def test_json_holds_comparisons(tiny_run: dict[str, object]) -> None:
    data = tiny_run["json"]
    assert isinstance(data, dict)
    for problem in data["problems"].values():
        configs = [c["config"] for c in problem["comparisons"]]
        assert configs == ["secondorder LM (defaults)"]
        # torch-levenberg-marquardt did not run in this fixture.
        assert problem["comparisons"][0]["step_speedup_vs_tlm"] is None
    assert data["flop_scaling"] == []


def test_json_names_the_device(tiny_run: dict[str, object]) -> None:
    data = tiny_run["json"]
    assert isinstance(data, dict)
    assert data["machine"]["device"] == "cpu"
    assert "--device" not in data["command"]


@pytest.mark.parametrize(
    ("device", "why"),
    [("gpu", "not a device torch knows"), ("meta", "runs on cpu or cuda")],
)
def test_bad_device_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], device: str, why: str
) -> None:
    assert bench.run_bench(_args(tmp_path, "--device", device)) == 2
    assert why in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cuda_without_a_gpu_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert bench.run_bench(_args(tmp_path, "--device", "cuda")) == 2
    assert "sees no CUDA GPU; use --device cpu" in capsys.readouterr().err


def test_a_problem_moved_to_its_own_device_is_itself() -> None:
    problem = bench.build_problems(tiny=True, keys=["sinc"])["sinc"]
    assert problem.on("cpu") is problem


def test_settled_heap_freezes_the_harness_only_while_a_method_runs():
    import gc

    from benchmarks.core import settled_heap

    assert gc.get_freeze_count() == 0
    with settled_heap():
        assert gc.get_freeze_count() > 0  # everything alive before the method
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), settled_heap():
        raise RuntimeError("a method that fails")
    assert gc.get_freeze_count() == 0  # handed back to the collector all the same
