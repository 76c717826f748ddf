"""The small-problem path of least_squares: the same answers as the device path.

* ``QRSolver(host=True)`` factors a few float64 CPU columns in NumPy; its steps equal
  the torch QR solver's (the reference: MINPACK's least squares on ``[R0; √λD^½]``)
  and its search norms equal ``‖D^½δ‖`` of those steps.
* Finite differences of a NumPy ``fun`` computed in NumPy equal the torch path's J
  bitwise (same operations, same order).
* ``jac="auto"`` picks reverse mode for small problems and forward mode for many
  residuals; either way J equals ``torch.func.jacfwd``'s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import secondorder as so
from secondorder.fitting.differences import finite_difference
from secondorder.fitting.functions import auto_mode, jacobian_function
from secondorder.lm.linalg import HOST_MAX_N, NormalEquations, QRSolver

F64 = torch.float64


def _system(J: torch.Tensor, r: torch.Tensor) -> NormalEquations:
    return NormalEquations(
        loss_sum=r @ r, count=r.numel(), grad=J.T @ r, col_sq=(J * J).sum(0), jac=J, residuals=r
    )


@pytest.mark.parametrize(("m", "n"), [(14, 2), (40, 7), (250, 9), (3, 5), (6, 16)])
@pytest.mark.parametrize("scales", ["unit", "spread"])
def test_host_steps_equal_the_torch_qr_steps(m: int, n: int, scales: str) -> None:
    g = torch.Generator().manual_seed(m * 100 + n)
    J = torch.randn(m, n, generator=g, dtype=F64)
    if scales == "spread":  # columns 1e-6 .. 1e6 apart, as on NIST's Bennett5 or MGH10
        J = J * torch.logspace(-6, 6, n, dtype=F64)
    r = torch.randn(m, generator=g, dtype=F64)
    d = (J * J).sum(0) * torch.rand(n, generator=g, dtype=F64).add(0.5)
    system = _system(J, r)
    host = QRSolver(host=True).factor(system, d)
    device = QRSolver().factor(system, d)
    assert host.on_host and not device.on_host
    for lam in (0.0, 1e-8, 1e-3, 1.0, 1e3):
        if lam == 0.0 and m < n:
            continue  # the device solver's minimum-norm step: checked below
        ref = device.solve(lam, -system.grad, -r)
        assert ref is not None
        out = host.solve_scaled(lam, -r)
        assert out is not None
        step, norm = out
        # solve() (geodesic acceleration's second solve) gives the same step.
        same = host.solve(lam, -system.grad, -r)
        assert same is not None and torch.equal(same, step)
        torch.testing.assert_close(step, ref, rtol=1e-9, atol=1e-12 * float(ref.abs().max()))
        expected = float(torch.linalg.vector_norm(d.sqrt() * ref))
        assert norm == pytest.approx(expected, rel=1e-9)
        # The search's norm (from the SVD of R0 D^-½) is the same length.
        assert host.scaled_norm(lam, -r) == pytest.approx(expected, rel=1e-8)


def test_host_step_at_zero_damping_with_fewer_rows_is_the_minimum_norm_solution() -> None:
    g = torch.Generator().manual_seed(5)
    J, r = torch.randn(3, 5, generator=g, dtype=F64), torch.randn(3, generator=g, dtype=F64)
    d = torch.rand(5, generator=g, dtype=F64) + 0.5
    host = QRSolver(host=True).factor(_system(J, r), d)
    out = host.solve_scaled(0.0, -r)
    assert out is not None
    # min ‖D^½δ‖ subject to Jδ = -r: δ = D^-½ pinv(J D^-½)(-r).
    s = d.rsqrt()
    ref = s * (torch.linalg.pinv(J * s) @ -r)
    torch.testing.assert_close(out[0], ref, rtol=1e-10, atol=1e-12)


def test_host_path_only_for_a_few_float64_cpu_columns() -> None:
    r = torch.ones(40, dtype=F64)
    wide = torch.ones(40, HOST_MAX_N + 1, dtype=F64)
    assert (
        not QRSolver(host=True)
        .factor(_system(wide, r), torch.ones(HOST_MAX_N + 1, dtype=F64))
        .on_host
    )
    narrow = torch.ones(40, 3, dtype=torch.float32)
    system = _system(narrow, r.float())
    assert not QRSolver(host=True).factor(system, torch.ones(3)).on_host
    assert (
        not QRSolver()
        .factor(_system(torch.ones(40, 3, dtype=F64), r), torch.ones(3, dtype=F64))
        .on_host
    )


def test_host_factorisation_of_a_non_finite_matrix_fails_like_a_qr() -> None:
    J = torch.ones(5, 2, dtype=F64)
    J[0, 0] = math.inf
    with pytest.raises(torch.linalg.LinAlgError, match="not finite"):
        QRSolver(host=True).factor(_system(J, torch.ones(5, dtype=F64)), torch.ones(2, dtype=F64))


def _model(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    return x[0] * np.exp(-x[1] * t) + x[2] * t


@pytest.mark.parametrize("scheme", ["2-point", "3-point"])
@pytest.mark.parametrize("rel_step", [None, 1e-6])
@pytest.mark.parametrize("minpack", [False, True])
def test_numpy_finite_differences_equal_the_torch_path_bitwise(
    scheme: str, rel_step: float | None, minpack: bool
) -> None:
    t = np.linspace(0, 3, 11)

    def fun_np(x: np.ndarray) -> np.ndarray:
        return _model(x, t)

    def fun_torch(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(fun_np(x.numpy()))

    x = torch.tensor([2.5, -0.3, 0.0], dtype=F64)
    step = None if rel_step is None else torch.full((3,), rel_step, dtype=F64)
    ref = finite_difference(fun_torch, scheme, rel_step=step, minpack=minpack)(x)
    out = finite_difference(fun_torch, scheme, rel_step=step, numpy_fun=fun_np, minpack=minpack)(x)
    assert torch.equal(out, ref)
    # The all-columns-at-once NumPy path equals the column loop it replaced: f(x + hⱼeⱼ)
    # one column at a time, on a copy of x (the step read back from J's first column).
    if scheme == "2-point" and rel_step is None:
        xn, f0 = x.numpy(), fun_np(x.numpy())
        for j in range(3):
            h = (abs(xn[j]) or 1.0) * math.sqrt(np.finfo(float).eps) if minpack else None
            if h is None:
                h = math.copysign(1.0, xn[j] + 0.0) * max(1.0, abs(xn[j])) * 2.0**-26
            up = xn.copy()
            up[j] = xn[j] + h
            h = up[j] - xn[j]
            col = (fun_np(up) - f0) / h
            assert np.array_equal(out[:, j].numpy(), col)


def test_minpack_step_is_relative_to_each_parameter() -> None:
    """MINPACK's step, h = √eps·|xⱼ| (√eps at 0), keeps tiny parameters' columns exact.

    f(x) = x₀²·t + x₁·t² has the closed-form J = [2x₀t, t²]; at x₀ = 1e-6 the step
    √eps·max(1, |x₀|) = 1.5e-8 is 1.5% of x₀, and the forward difference's truncation
    error ``h·t`` is 0.7% of the column; MINPACK's step is 1.5e-14.
    """
    t = np.linspace(0.5, 2.0, 7)

    def fun(x: np.ndarray) -> np.ndarray:
        return x[0] ** 2 * t + x[1] * t**2

    def fun_torch(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(fun(x.numpy()))

    x = torch.tensor([1e-6, 0.0], dtype=F64)
    exact = np.stack([2 * x[0].item() * t, t**2], axis=1)
    ours = finite_difference(fun_torch, "2-point", numpy_fun=fun, minpack=True)(x).numpy()
    scipys = finite_difference(fun_torch, "2-point", numpy_fun=fun)(x).numpy()
    np.testing.assert_allclose(ours, exact, rtol=1e-6)
    assert np.abs(scipys[:, 0] / exact[:, 0] - 1).max() > 1e-3
    # At x₁ = 0 the step is √eps itself: a linear column, exact to rounding.
    np.testing.assert_allclose(ours[:, 1], t**2, rtol=1e-7)


def test_finite_differences_refuse_a_residual_count_that_changes() -> None:
    def fun(x: np.ndarray) -> np.ndarray:
        return np.ones(3 if x[1] == 0.5 else 4)

    x = torch.tensor([0.5, 0.5], dtype=F64)
    jac = finite_difference(
        lambda v: torch.from_numpy(fun(v.numpy())), "3-point", numpy_fun=fun, minpack=False
    )
    with pytest.raises(ValueError, match="must not depend on x"):
        jac(x)


@pytest.mark.parametrize(("name", "start"), [("Kirby2", 1), ("Kirby2", 2), ("Hahn1", 2)])
def test_numpy_residuals_with_minpack_differences_reach_six_digits(name: str, start: int) -> None:
    """NIST's certified values from NumPy residuals by forward differences (method="lm").

    With the step √eps·max(1, |x|) these starts ended at 2-5 digits (Hahn1's b₅..b₇ are
    1e-4..1e-7); with MINPACK's relative step, taken exactly (``h = (x + h) - x``), at
    7 or more.  (scipy's lm, the same step not taken exactly, ends at 2.2 and 5.0.)
    """
    from benchmarks.nist_data import PROBLEMS
    from benchmarks.nist_evals import lre

    p = PROBLEMS[name]
    with np.errstate(all="ignore"):
        res = so.least_squares(
            p.numpy_residuals(),
            np.array(p.starts[start - 1], dtype=np.float64),
            method="lm",
            ftol=1e-15,
            xtol=1e-15,
            gtol=1e-15,
        )
    assert lre(res.x.tolist(), p.certified) >= 6


def test_auto_mode_takes_reverse_mode_for_small_problems() -> None:
    assert auto_mode(14, 2) == "rev"
    assert auto_mode(256, 16) == "rev"
    assert auto_mode(257, 3) == "fwd"
    assert auto_mode(1000, 17) == "fwd"
    assert auto_mode(5, 40) == "rev"  # fewer residuals than parameters


@pytest.mark.parametrize("m", [14, 300])
def test_auto_jacobian_equals_forward_mode_on_both_sides_of_the_rule(m: int) -> None:
    t = torch.linspace(0, 3, m, dtype=F64)

    def fun(x: torch.Tensor) -> torch.Tensor:
        return x[0] * torch.exp(-x[1] * t) + x[2] * t

    x = torch.tensor([2.5, -0.3, 0.7], dtype=F64)
    J = jacobian_function("auto", fun, numpy_fun=False, shape=(m, 3), args=(), kwargs={})(x)
    torch.testing.assert_close(J, torch.func.jacfwd(fun)(x), rtol=1e-14, atol=1e-14)


def test_least_squares_on_the_host_path_matches_scipy() -> None:
    scipy_optimize = pytest.importorskip("scipy.optimize")
    t = np.linspace(0, 3, 11)
    y = _model(np.array([2.0, 0.7, 0.3]), t) + 0.01 * np.sin(7 * t)

    def fun(x: np.ndarray) -> np.ndarray:
        return _model(x, t) - y

    x0 = np.array([1.0, 1.0, 0.0])
    ours = so.least_squares(fun, x0, method="lm", ftol=1e-12, xtol=1e-12, gtol=1e-12)
    ref = scipy_optimize.least_squares(fun, x0, method="lm", ftol=1e-12, xtol=1e-12, gtol=1e-12)
    np.testing.assert_allclose(ours.x, ref.x, rtol=1e-7)
    assert ours.cost == pytest.approx(ref.cost, rel=1e-10)


@pytest.mark.parametrize("which", ["held", "equal copy", "other"])
def test_host_factorisation_of_j_and_minus_r_solves_for_any_w(which: str) -> None:
    """The QR of [J, -r] gives Q0ᵀ(-r) without Q0; any other w forms Q0 (the torch QR's steps)."""
    g = torch.Generator().manual_seed(11)
    J = torch.randn(30, 4, generator=g, dtype=F64) * torch.logspace(-3, 3, 4, dtype=F64)
    r = torch.randn(30, generator=g, dtype=F64)
    d = (J * J).sum(0)
    system = _system(J, r)
    host = QRSolver(host=True).factor(system, d)
    device = QRSolver().factor(system, d)
    held = getattr(host, "w", None)
    assert isinstance(held, torch.Tensor) and torch.equal(held, -r)
    w = {"held": held, "equal copy": -r, "other": torch.randn(30, generator=g, dtype=F64)}[which]
    for lam in (0.0, 1e-4, 10.0):
        ref = device.solve(lam, J.T @ w, w)
        out = host.solve_scaled(lam, w)
        assert ref is not None and out is not None
        torch.testing.assert_close(out[0], ref, rtol=1e-9, atol=1e-12 * float(ref.abs().max()))
        norm = host.scaled_norm(lam, w)
        assert norm == pytest.approx(float(torch.linalg.vector_norm(d.sqrt() * ref)), rel=1e-8)


def test_host_normal_equations_equal_torch_products() -> None:
    from secondorder.fitting.bounds import BoxTransform, parse_bounds
    from secondorder.fitting.problem import FunctionProblem

    g = torch.Generator().manual_seed(3)
    J = torch.randn(25, 5, generator=g, dtype=F64)
    f = torch.randn(25, generator=g, dtype=F64)
    y = torch.zeros(5, dtype=F64)

    def jac(x: torch.Tensor, f0: torch.Tensor | None = None) -> torch.Tensor:
        return J

    problem = FunctionProblem(
        lambda x: f,
        jac,
        BoxTransform(*parse_bounds(None, 5)),
        "linear",
        1.0,
        need_gram=True,
        differentiable=False,
        takes_residuals=True,
    )
    system = problem.linearize(y, f)
    torch.testing.assert_close(system.grad, J.T @ f, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(system.col_sq, (J * J).sum(0), rtol=1e-14, atol=0.0)
    assert system.gram is not None
    torch.testing.assert_close(system.gram, J.T @ J, rtol=1e-14, atol=1e-14)
    assert float(system.loss_sum) == pytest.approx(float(f @ f), rel=1e-14)
    assert system.jac is J and system.residuals is f


def test_finite_system_check_reads_j_through_its_column_norms() -> None:
    from secondorder.fitting.problem import is_finite_system

    J, r = torch.ones(6, 2, dtype=F64), torch.ones(6, dtype=F64)
    assert is_finite_system(_system(J, r))
    bad = J.clone()
    bad[2, 1] = math.nan
    assert not is_finite_system(_system(bad, r))
    # Residuals whose squares overflow: the loss is inf, but J, Jᵀr and the norms are
    # finite numbers, so a linear model exists (as before the check shared the read).
    huge = torch.full((6,), 1e155, dtype=F64)
    system = _system(J, huge)
    assert not math.isfinite(float(system.loss_sum))
    assert is_finite_system(system)
