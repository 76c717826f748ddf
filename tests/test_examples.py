"""Every example runs in its fast mode (``--quick``) and reports what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def run(name: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--quick", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_every_example_here_is_covered():
    covered = {
        "sinc_curve_fit.py",
        "digits_classification.py",
        "pinn_poisson.py",
        "curve_fit_report.py",
        "cupylma_migration.py",
    }
    assert covered <= set(SCRIPTS)


def test_sinc_curve_fit(tmp_path):
    pytest.importorskip("matplotlib")
    out = run("sinc_curve_fit.py", "--out", str(tmp_path), cwd=tmp_path)
    lm = float(re.search(r"LM: .* MSE (\S+)", out).group(1))
    assert lm < 1e-2
    assert (tmp_path / "sinc_curve_fit.png").read_bytes()[:4] == b"\x89PNG"


def test_digits_classification(tmp_path):
    pytest.importorskip("sklearn")
    out = run("digits_classification.py", "--out", str(tmp_path), cwd=tmp_path)
    accuracy = float(re.search(r"LM: .* test accuracy (\S+)", out).group(1))
    assert accuracy > 0.8
    assert (tmp_path / "digits_classification.png").exists()


def test_pinn_poisson(tmp_path):
    out = run("pinn_poisson.py", cwd=tmp_path)
    error = float(re.search(r"relative L2 error (\S+)\n", out.split("LM:")[1]).group(1))
    assert error < 1e-2


def test_curve_fit_report(tmp_path):
    out = run("curve_fit_report.py", cwd=tmp_path)
    assert "[[Variables]]" in out and "center1" in out and "±" in out
    rel = float(re.search(r"max \|pcov - scipy\| / \|scipy\| = (\S+)", out).group(1))
    assert rel < 1e-4


def test_cupylma_migration(tmp_path):
    out = run("cupylma_migration.py", cwd=tmp_path)
    mse = float(re.search(r"final MSE (\S+)", out).group(1))
    assert mse < 5e-3
