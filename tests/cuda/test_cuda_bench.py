"""The benchmark harness on the device: ``python -m benchmarks.bench --device cuda``."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import bench

pytestmark = pytest.mark.cuda


def _run(tmp_path: Path, device: torch.device) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    bench.add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["bench", "--tiny", "--floor-reps", "1", "--out", str(tmp_path / "out"),
         "--json", str(tmp_path / "bench.json"), "--device", str(device),
         "--problems", "sinc", "digits_mlp", "--methods", "lm", "adam", "scipy"]
    )  # fmt: skip
    assert bench.run_bench(args) == 0
    data: dict[str, object] = json.loads((tmp_path / "bench.json").read_text())
    return data


def test_tiny_run_on_the_device(tmp_path: Path, device: torch.device) -> None:
    pytest.importorskip("sklearn")  # digits ships with scikit-learn
    data = _run(tmp_path, device)
    machine = data["machine"]
    assert isinstance(machine, dict) and machine["device"] == str(device)
    problems = data["problems"]
    assert isinstance(problems, dict)
    for problem in problems.values():
        by_name = {m["name"]: m for m in problem["methods"]}
        for name in ("secondorder LM (defaults)", "torch.optim.Adam (lr 0.01)"):
            assert by_name[name]["status"] == "ok", by_name[name]
            assert by_name[name]["median_step_s"] > 0
            assert all(math.isfinite(v) for v in by_name[name]["losses"])
        (floor,) = problem["floor"]
        assert floor["gemm_f32_s"] > 0
        # torch has no symmetric rank-k product on a GPU; scipy's ssyrk is the CPU's.
        assert (floor["syrk_f32_s"] is None) == (device.type == "cuda")
    scipy_rows = [m for m in problems["sinc"]["methods"] if m["name"].startswith("scipy")]
    expected = "skipped" if device.type == "cuda" else "ok"
    assert [m["status"] for m in scipy_rows] == [expected, expected], scipy_rows


def test_a_problem_on_the_device_starts_from_the_cpu_weights(device: torch.device) -> None:
    problem = bench.build_problems(tiny=True, keys=["sinc"])["sinc"]
    moved = problem.on(str(device))
    assert moved.train[0].device == device and moved.device == str(device)
    for a, b in zip(
        problem.make_model().parameters(), moved.make_model().parameters(), strict=True
    ):
        assert b.device == device
        torch.testing.assert_close(a, b.cpu(), rtol=0, atol=0)
