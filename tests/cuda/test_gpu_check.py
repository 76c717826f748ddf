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
    steps = ["lm-ops", "batch-fits", "shampoo-peers", "kfac-peers"]
    no_wheels = tmp_path / "no_wheels"
    no_wheels.mkdir()
    args = ["--dry-run", "--only", *steps, "--out", str(out), "--wheels", str(no_wheels)]
    rc = gpu_check.main(args)
    text = out.read_text()
    assert rc == 0, text
    assert "- device: the CPU (a dry run: no GPU measured)" in text
    assert "| secondorder LM, capturable=True |" in text
    assert "| secondorder LM (defaults) |" in text
    # A step whose benchmark is not in the checkout is listed, and skipped.
    assert "Batched fits on CUDA" in text
    assert "CUDA tests" not in text  # not asked for
    # The peers' steps time ours, and AdamW, with or without the peers.
    shampoo = "| MNIST-1D CNN, Shampoo (Adam grafting), precondition_frequency 100 | 1 x 2 |"
    assert text.count(shampoo) == 1
    assert "| ours / AdamW, iteration (target <= 1.1) |" in text
    kfac = "| MNIST-1D CNN, batch 128, eigen, every 10 [2] |"
    assert kfac in text
    # kfac_peer also finds kfac-pytorch in the tree `make bench-peers` unpacks.
    tree = any(gpu_check.ROOT.glob("out/peers/src/kfac-pytorch-*/src/kfac/preconditioner.py"))
    for module, missing, elsewhere in (
        ("distributed_shampoo", "# DistributedShampoo is not installed", False),
        ("kfac", "kfac-pytorch (KAISA) is not installed", tree),
    ):
        installed = gpu_check._available(module)
        assert f"{module}: {'installed' if installed else 'not installed'}" in text
        assert (missing in text) != (installed or elsewhere)


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
