"""The GPU measurement tools: the sinc spread and the CUDA profile, run briefly."""

from __future__ import annotations

import pytest
import torch

from benchmarks import profile_cuda
from benchmarks.experiments import sinc_spread


def test_sinc_spread_row_reports_a_start_that_has_not_reached_the_target() -> None:
    row = sinc_spread.run("cpu", 1e-7, steps=2)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "+1e-07"
    assert cells[1] == "not within 2 steps"  # MSE 1e-6 takes some 200 steps
    assert float(cells[2]) > 1e-6


def test_sinc_spread_refuses_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert sinc_spread.main(["--device", "cuda", "--steps", "1"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_profile_dry_run_on_the_cpu_names_both_optimizers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch_levenberg_marquardt")
    args = ["--device", "cpu", "--problems", "sinc", "--steps", "1", "--warm", "1", "--top", "3"]
    assert profile_cuda.main(args) == 0
    out = capsys.readouterr().out
    assert "### secondorder LM (defaults):" in out
    assert "### torch-levenberg-marquardt" in out
