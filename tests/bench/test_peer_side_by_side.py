"""The side-by-side benchmarks against kfac-pytorch and DistributedShampoo, run tiny.

What they report is checked, never how fast: ours is timed with or without the peer,
AdamW beside Shampoo at precondition_frequency 100, and a device torch cannot see is
refused.  ``gpu_check`` installs the peers from wheels: checked with a wheel built here.
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check, kfac_peer, shampoo_side_by_side
from benchmarks.shampoo_overhead import adamw_like


@pytest.mark.parametrize("main", [kfac_peer.main, shampoo_side_by_side.main])
def test_the_side_by_sides_refuse_cuda_without_a_gpu(
    main: object, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SystemExit):
        main(["--device", "cuda", "--tiny"])  # type: ignore[operator]
    assert "Invalid --device=cuda: torch sees no CUDA device" in capsys.readouterr().err


def test_adamw_takes_the_shampoo_configurations_hyperparameters() -> None:
    import secondorder.compat.distributed_shampoo as ds

    options = shampoo_side_by_side.CONFIGS["cnn_shampoo_f100"].options(ds)
    opt = adamw_like(options, torch.nn.Linear(3, 2))
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    # lr and decay from Shampoo's arguments, β₁ from its betas, β₂ and ε from Adam grafting
    assert (group["lr"], group["weight_decay"]) == (3e-3, 1e-4)
    assert (group["betas"], group["eps"]) == ((0.9, 0.999), 1e-8)


def test_shampoo_rounds_time_ours_and_adamw_without_the_peer() -> None:
    config = shampoo_side_by_side.tiny(shampoo_side_by_side.CONFIGS["cnn_shampoo_f100"])
    res = shampoo_side_by_side.run_config(config, rounds=3, steps=2, warmup=1)
    assert not res["peer"] and "ratios" not in res
    assert res["clock"] == "CPU" and res["ours_s"] > 0 and math.isfinite(res["loss_ours"])
    overhead = res["overhead"]
    assert set(overhead) == {"adamw_step_s", "adamw_iteration_s", "ours_step", "ours_iteration"}
    assert len(overhead["ours_step"]) == len(overhead["ours_iteration"]) == 3
    # an iteration holds the step: AdamW's is longer than its step alone
    assert overhead["adamw_iteration_s"] > overhead["adamw_step_s"] > 0


def test_shampoo_overhead_is_only_measured_at_frequency_100() -> None:
    flagged = {k for k, c in shampoo_side_by_side.CONFIGS.items() if c.overhead}
    assert flagged == {"cnn_shampoo_f100", "block1024_f100"}
    import secondorder.compat.distributed_shampoo as ds

    for key in flagged:
        assert shampoo_side_by_side.CONFIGS[key].options(ds)["precondition_frequency"] == 100


def test_kfac_times_ours_alone_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kfac_peer, "import_kaisa", lambda: None)  # as where it is missing
    assert kfac_peer.run(keys=["cnn_eigen_every10"], toy=True) == {
        "skipped": "kfac-pytorch is not importable: run `make bench-peers`."
    }
    data = kfac_peer.run(keys=["cnn_eigen_every10", "block512_eigen_every1"], toy=True, alone=True)
    assert [r["key"] for r in data["configs"]] == ["cnn_eigen_every10", "block512_eigen_every1"]
    assert all("ref_s" not in r and r["ours_s"] > 0 for r in data["configs"])
    text = "\n".join(kfac_peer.markdown(data))
    assert "kfac-pytorch (KAISA) is not installed" in text
    assert "| MNIST-1D CNN, batch 128, eigen, every 10 [2] |" in text
    assert "| cnn_eigen_every10 | ours |" in text and "| KAISA |" not in text


def _wheel(folder: Path, module: str) -> Path:
    """A one-module pure-Python wheel, as ``pip wheel`` would name it."""
    dist = f"{module}-1.0.dist-info"
    path = folder / f"{module}-1.0-py3-none-any.whl"
    files = {
        f"{module}/__init__.py": "VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def test_gpu_check_installs_the_wheel_of_a_missing_peer_only(tmp_path: Path) -> None:
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_test_peer")
    _wheel(wheels, "json")  # an importable peer's wheel must not shadow it
    peers = [
        ("gpu_check_test_peer", "gpu_check_test_peer"),
        ("json", "json"),
        ("gpu_check_absent_peer", "gpu_check_absent_peer"),
    ]
    report = gpu_check._wheels(site, wheels, peers)
    assert report.split(", ") == [
        "gpu_check_test_peer: from wheels/gpu_check_test_peer-1.0-py3-none-any.whl",
        "json: installed",
        "gpu_check_absent_peer: not installed (no gpu_check_absent_peer wheel in wheels/)",
    ]
    assert (site / "gpu_check_test_peer" / "__init__.py").read_text() == "VALUE = 42\n"
    assert not (site / "json").exists()


def test_the_op_counter_counts_each_dispatched_operation() -> None:
    from benchmarks.ops import count_ops

    # ones, add_ and mul_: three aten operations, the warm-up calls not counted
    assert count_ops(lambda: torch.ones(3).add_(1).mul_(2), warm=2, steps=3) == 3


def test_shampoo_ops_table_counts_a_step_of_each_side(capsys: pytest.CaptureFixture[str]) -> None:
    shampoo_side_by_side.main(["--ops", "--tiny", "--configs", "cnn_shampoo_f100"])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    ours, adamw = int(cells[1]), int(cells[3])
    # Shampoo's step does AdamW's grafting and more: at least as many operations
    assert ours > adamw > 0
    try:
        import distributed_shampoo  # noqa: F401
    except ImportError:
        assert cells[2] == "not installed"
    else:
        assert int(cells[2]) > 0
