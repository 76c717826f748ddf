"""``make gpu-check`` checked without a GPU: its dry run writes the results file.

The dry run is the real script with the CPU in place of the GPU and tiny sizes; it
runs here in the default suite (no ``cuda`` marker), so a broken step is found
before the minutes a GPU is lent are spent.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import gpu_check


def test_the_dry_run_writes_the_results_file(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS_CUDA.md"
    rc = gpu_check.main(["--dry-run", "--only", "lm-ops", "batch-fits", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "- device: the CPU (a dry run: no GPU measured)" in text
    assert "| secondorder LM, capturable=True |" in text
    assert "| secondorder LM (defaults) |" in text
    # A step whose benchmark is not in the checkout is listed, and skipped.
    assert "Batched fits on CUDA" in text
    assert "CUDA tests" not in text  # not asked for


def test_every_step_measures_the_gpu_in_the_real_run() -> None:
    names = [s.name for s in gpu_check.STEPS]
    assert len(names) == len(set(names))
    for step in gpu_check.STEPS:
        if step.module == "pytest":
            assert "cuda" in step.args and step.dry_env == {"SECONDORDER_TEST_CUDA_DEVICE": "cpu"}
        else:
            assert "cpu" not in step.args and "cpu" in step.dry
    # The budget of the steps fits the 8 minutes a GPU check is given.
    assert sum(s.timeout_s for s in gpu_check.STEPS) <= 8 * 60
