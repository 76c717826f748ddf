"""Every example runs in its fast mode (``--quick``), reports what it promises and writes
its plot under ``out/`` (a PNG; skipped where matplotlib is not installed)."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def run(name: str, *args: str, cwd: Path) -> str:
    """Run ``name --quick`` in ``cwd``; with matplotlib, its plot must be ``cwd/out/<name>.png``."""
    # One thread: on a shared CPU, OpenMP threads spin-waiting for a busy core made the
    # quick runs many times slower; the results do not depend on the thread count here.
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    plot = cwd / "out" / name.replace(".py", ".png")
    plot.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--quick", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    if has_matplotlib():
        data = plot.read_bytes() if plot.exists() else b""
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, (name, len(data))
        assert f"wrote {Path('out') / plot.name}" in proc.stdout
    return proc.stdout


# Each example and the test that runs it (and checks its plot).
TESTED = {
    "sinc_curve_fit.py": "test_sinc_curve_fit",
    "digits_classification.py": "test_digits_classification",
    "pinn_poisson.py": "test_pinn_poisson",
    "pinn_burgers.py": "test_pinn_burgers_quick",
    "curve_fit_report.py": "test_curve_fit_report",
    "cupylma_migration.py": "test_cupylma_migration",
    "distributed_sinc.py": "test_distributed_sinc_single_process",
    "fluorescence_lifetime.py": "test_fluorescence_lifetime",
}


def test_every_example_here_is_covered():
    assert set(TESTED) == set(SCRIPTS)
    assert all(callable(globals().get(test)) for test in TESTED.values())


def test_sinc_curve_fit(tmp_path):
    out = run("sinc_curve_fit.py", cwd=tmp_path)
    lm = float(re.search(r"LM: .* MSE (\S+)", out).group(1))
    assert lm < 1e-2


def test_digits_classification(tmp_path):
    pytest.importorskip("sklearn")
    out = run("digits_classification.py", cwd=tmp_path)
    assert re.search(r"180 training, 45 validation and 75 test images", out)
    for kind, floor in (("mlp", 0.8), ("cnn", 0.6)):
        accuracy = float(re.search(rf"LM {kind}: .* test accuracy (\S+)", out).group(1))
        assert accuracy > floor, (kind, accuracy)
        assert re.search(rf"Adam {kind}: .* test accuracy", out)
    # The test set is used once per run, after training: the validation set alone
    # picks the kept epoch.
    assert out.count("restored the parameters of epoch") == 4


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


def test_fluorescence_lifetime(tmp_path):
    out = run("fluorescence_lifetime.py", cwd=tmp_path)
    assert float(re.search(r"success (\S+);", out).group(1)) > 0.99
    assert float(re.search(r"median \|τ error\| / τ (\S+);", out).group(1)) < 0.1
    assert 0.7 < float(re.search(r"/ stderr (\S+) ", out).group(1)) < 1.3


def test_distributed_sinc_single_process(tmp_path):
    # Without torchrun the example is the single-process run; the distributed runs are
    # the subject of tests/distributed.
    out = run("distributed_sinc.py", cwd=tmp_path)
    mse = [float(m) for m in re.findall(r"mse (\S+)", out)]
    assert mse and mse[-1] < mse[0]


def test_cupylma_migration_on_two_devices(tmp_path):
    # Equality with one device at the same slicing is tested in test_cupylma_compat.py;
    # here the example's own command line runs with two replicas and converges.
    out = run("cupylma_migration.py", "--devices", "cpu,cpu", cwd=tmp_path)
    assert float(re.search(r"final MSE (\S+)", out).group(1)) < 5e-3


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cole_hopf_reference_is_burgers_solution():
    burgers = load_example("pinn_burgers.py")
    u, nu = burgers.cole_hopf, burgers.NU
    x = np.linspace(-1, 1, 41)
    # Initial and boundary conditions; t = 1e-9 goes through the quadrature, not the t = 0 branch.
    assert np.array_equal(u(x, 0.0), -np.sin(np.pi * x))
    np.testing.assert_allclose(u(x, 1e-9), -np.sin(np.pi * x), atol=1e-6)
    np.testing.assert_allclose(
        u(np.array([-1.0, 1.0]), np.array([[0.2], [0.7], [1.0]])), 0, atol=1e-12
    )
    # u(-x, t) = -u(x, t), as the data are odd.
    np.testing.assert_allclose(u(-x, 0.6), -u(x, 0.6), atol=1e-13)
    # The PDE by central differences at points away from the front.
    h = 1e-3
    for xi, ti in [(-0.6, 0.2), (0.3, 0.5), (0.8, 0.9), (-0.25, 0.75)]:
        ut = (u(xi, ti + h) - u(xi, ti - h)) / (2 * h)
        ux = (u(xi + h, ti) - u(xi - h, ti)) / (2 * h)
        uxx = (u(xi + h, ti) - 2 * u(xi, ti) + u(xi - h, ti)) / h**2
        residual = ut + u(xi, ti) * ux - nu * uxx
        assert abs(residual) < 1e-5 * (abs(ut) + abs(ux)), (xi, ti, residual)
    # Basdevant et al. (1986): the steepest slope, |u_x| = 152.00516 at x = 0, t = 1.6037/π.
    t_peak, d = 1.6037 / np.pi, 1e-7
    slope = -(u(d, t_peak) - u(-d, t_peak)) / (2 * d)
    assert slope == pytest.approx(152.00516, rel=2e-6)
    # The Gauss-Hermite sums against a fine trapezoidal rule for the same integrals.
    for xi, ti in [(0.01, 1.0), (0.5, 0.75), (-0.9, 0.05)]:
        eta = np.linspace(-20, 20, 400_001) * np.sqrt(nu * ti)
        y = xi - eta
        log_w = -np.cos(np.pi * y) / (2 * np.pi * nu) - eta**2 / (4 * nu * ti)
        w = np.exp(log_w - log_w.max())
        assert u(xi, ti) == pytest.approx(-(np.sin(np.pi * y) * w).sum() / w.sum(), abs=1e-10)


def test_pinn_burgers_quick(tmp_path):
    out = run("pinn_burgers.py", cwd=tmp_path)
    before = float(re.search(r"before training: (\S+)", out).group(1))
    error = float(re.search(r"relative L2 error (\S+)\n", out.split("LM:")[1]).group(1))
    assert error < 0.5 * before


def test_burgers_operator_and_model_residual_take_the_same_steps():
    torch = pytest.importorskip("torch")
    burgers = load_example("pinn_burgers.py")
    torch.manual_seed(0)
    net = burgers.make_model(6, 2)
    interior, initial, walls = burgers.points(30, 10, seed=1)
    nets = {form: copy.deepcopy(net) for form in ("operator", "model-residual")}
    infos = {}
    for form, model in nets.items():
        opt, batch = burgers.optimizer(model, interior, initial, walls, 5.0, form)
        infos[form] = [opt.step(*batch) for _ in range(3)]
    assert infos["operator"][0].jacobian == "reverse"
    assert infos["model-residual"][0].jacobian.startswith("batch_")
    for a, b in zip(infos["operator"], infos["model-residual"], strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-9)
    for p, q in zip(
        nets["operator"].parameters(), nets["model-residual"].parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-10)
