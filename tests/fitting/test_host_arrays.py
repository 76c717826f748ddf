"""A system formed on the host carries its NumPy arrays: the same numbers.

* The scalars of a host system (``NormalEquations.host``) equal the torch expressions
  of :meth:`NormalEquations.scalars` (finite flag, ``Σr²``, MINPACK's cosine to its
  last bit, and bitwise the NumPy expressions used before), also for zero columns, no
  residual, non-finite and overflowing entries.
* The host factorisation given the system's arrays (and told they are finite) gives
  the steps and norms it gives from the tensors.
* Residuals already flat float64 pass through ``flat_residuals`` untouched; others are
  flattened and cast as before.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from secondorder.fitting.bounds import BoxTransform, parse_bounds
from secondorder.fitting.functions import (
    CallCounter,
    flat_residuals,
    jacobian_function,
    residual_function,
)
from secondorder.fitting.problem import FunctionProblem
from secondorder.lm.linalg import NormalEquations, QRSolver
from secondorder.lm.linalg.record import _host_scalars

F64 = torch.float64


def _torch_scalars(loss: float, grad: torch.Tensor, col_sq: torch.Tensor) -> tuple:
    """The device branch of NormalEquations.scalars, written out in torch."""
    loss_t = torch.tensor(loss, dtype=F64)
    finite = torch.isfinite(loss_t) & torch.isfinite(grad).all() & torch.isfinite(col_sq).all()
    rnorm = loss_t.clamp(min=0.0).sqrt()
    colnorm = col_sq.sqrt()
    ratio = grad.abs() / (colnorm * rnorm)
    cos = torch.where(colnorm > 0, ratio, torch.zeros_like(ratio))
    top = float(cos.max()) if cos.numel() else -math.inf
    return bool(finite), loss, top if float(rnorm) > 0 else 0.0


def _numpy_cosine(loss: float, grad: np.ndarray, col_sq: np.ndarray) -> float:
    """The same cosine in NumPy, as the host branch computed it before (bitwise)."""
    with np.errstate(all="ignore"):
        rnorm = math.sqrt(max(loss, 0.0)) if not math.isnan(loss) else math.nan
        colnorm = np.sqrt(col_sq)
        ratio = np.abs(grad) / (colnorm * rnorm)
        cos = float(np.where(colnorm > 0, ratio, 0.0).max(initial=-math.inf))
    return cos if rnorm > 0 else 0.0


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("seed", range(6))
def test_host_scalars_equal_the_torch_expressions(seed: int) -> None:
    rng = np.random.default_rng(seed)
    losses = [0.0, 1e-300, 2.5, 1e300, math.inf, math.nan]
    for _ in range(300):
        n = int(rng.integers(1, 7))
        grad = rng.standard_normal(n) * 10.0 ** rng.integers(-300, 300, n)
        col_sq = np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-320, 308, n)
        if rng.random() < 0.3:
            col_sq[rng.integers(n)] = 0.0  # a zero column
        if rng.random() < 0.1:
            grad[rng.integers(n)] = math.inf
        if rng.random() < 0.1:
            col_sq[rng.integers(n)] = math.nan
        loss = float(rng.choice(losses)) if rng.random() < 0.5 else float(rng.random() * 1e3)
        got = _host_scalars(loss, grad, col_sq, None)
        ref = _torch_scalars(loss, torch.from_numpy(grad), torch.from_numpy(col_sq))
        assert got[0] == ref[0] and _same(got[1], ref[1]), (loss, grad, col_sq)
        # torch's vectorised division may round the cosine's last bit differently.
        assert got[2] == pytest.approx(ref[2], rel=1e-15, nan_ok=True), (got, ref)
        assert _same(got[2], _numpy_cosine(loss, grad, col_sq)), (loss, grad, col_sq)


def _host_problem(J: torch.Tensor, f: torch.Tensor) -> FunctionProblem:
    def jac(x: torch.Tensor, f0: torch.Tensor | None = None) -> torch.Tensor:
        return J

    return FunctionProblem(
        lambda x: f,
        jac,
        BoxTransform(*parse_bounds(None, J.shape[1])),
        "linear",
        1.0,
        need_gram=False,
        differentiable=False,
        takes_residuals=True,
    )


def _without_arrays(system: NormalEquations, J: Tensor, f: Tensor) -> NormalEquations:
    """The same system as plain tensors: what the host path computed before it kept arrays."""
    return NormalEquations(
        loss_sum=system.loss_sum,
        count=system.count,
        grad=system.grad,
        col_sq=system.col_sq,
        jac=J,
        residuals=f,
    )


def test_a_host_system_reads_the_same_scalars_as_one_without_arrays() -> None:
    g = torch.Generator().manual_seed(5)
    J = torch.randn(20, 4, generator=g, dtype=F64) * torch.logspace(-2, 2, 4, dtype=F64)
    J[:, 2] = 0.0  # a zero column: no angle there
    f = torch.randn(20, generator=g, dtype=F64)
    system = _host_problem(J, f).linearize(torch.zeros(4, dtype=F64), f)
    assert system.host is not None
    plain = _without_arrays(system, J, f)
    assert plain.host is None
    assert system.scalars() == plain.scalars()
    ref = _torch_scalars(float(f @ f), J.T @ f, (J * J).sum(0))
    # NumPy's vdot and torch's dot sum in different orders: equal to rounding.
    assert system.scalars()[0] == ref[0]
    assert system.scalars()[1] == pytest.approx(ref[1], rel=1e-14)
    assert system.scalars()[2] == pytest.approx(ref[2], rel=1e-14)


def test_host_factorisation_from_the_system_arrays_equals_the_one_from_tensors() -> None:
    g = torch.Generator().manual_seed(9)
    J = torch.randn(30, 5, generator=g, dtype=F64) * torch.logspace(-3, 3, 5, dtype=F64)
    f = torch.randn(30, generator=g, dtype=F64)
    system = _host_problem(J, f).linearize(torch.zeros(5, dtype=F64), f)
    assert system.scalars()[0]  # read first, as the engine does: J and r known finite
    d = system.col_sq.clone()
    with_arrays = QRSolver(host=True).factor(system, d)
    plain = _without_arrays(system, J, f)
    without = QRSolver(host=True).factor(plain, d)
    for lam in (0.0, 1e-3, 10.0):
        a = with_arrays.solve_scaled(lam, -f)
        b = without.solve_scaled(lam, -f)
        assert a is not None and b is not None
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
        assert with_arrays.scaled_norm(lam, -f) == without.scaled_norm(lam, -f)


def test_a_host_system_with_non_finite_residuals_is_still_refused_by_the_factorisation() -> None:
    J = torch.ones(5, 2, dtype=F64)
    J[:, 1] = torch.arange(5, dtype=F64)
    f = torch.ones(5, dtype=F64)
    f[3] = math.inf
    system = _host_problem(J, f).linearize(torch.zeros(2, dtype=F64), f)
    assert system.host is not None and not system.scalars()[0]
    with pytest.raises(torch.linalg.LinAlgError, match="not finite"):
        QRSolver(host=True).factor(system, torch.ones(2, dtype=F64))


def test_flat_float64_residuals_pass_through_and_others_are_flattened() -> None:
    flat = torch.arange(4, dtype=F64)
    assert flat_residuals(flat, numpy_fun=False) is flat
    grid = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = flat_residuals(grid, numpy_fun=False)
    assert out.dtype == F64 and out.shape == (6,)
    torch.testing.assert_close(out, grid.reshape(-1).to(F64), rtol=0.0, atol=0.0)
    with pytest.raises(TypeError, match="real floating-point residuals"):
        flat_residuals(torch.arange(3), numpy_fun=False)


def _exp_model(x: torch.Tensor) -> torch.Tensor:
    t = torch.linspace(0.0, 3.0, 12, dtype=F64)
    return x[0] * torch.exp(-x[1] * t) - torch.cos(t)


def _autodiff(counter: CallCounter, mode: str, flat: Any) -> Any:
    """``jacobian_function``'s transform of ``counter``'s fun (12 residuals, 2 unknowns)."""
    residuals = residual_function(counter, (), {}, numpy_fun=False)
    return jacobian_function(
        mode,
        residuals,
        numpy_fun=False,
        shape=(12, 2),
        args=(),
        kwargs={},
        counter=counter,
        flat_fun=flat,
    )


def test_the_direct_transform_of_a_flat_float64_fun_equals_the_adapted_one() -> None:

    x = torch.tensor([1.5, 0.7], dtype=F64)
    for mode in ("auto", "fwd", "rev"):
        counts = []
        jacobians = []
        for flat in (None, _exp_model):
            counter = CallCounter(_exp_model)
            jac = _autodiff(counter, mode, flat)
            jacobians.append(jac(x))
            counts.append((counter.calls, counter.jacobian_calls, counter.value_calls))
        assert torch.equal(jacobians[0], jacobians[1])
        torch.testing.assert_close(
            jacobians[1], torch.func.jacfwd(_exp_model)(x), rtol=1e-14, atol=1e-14
        )
        assert counts[0] == counts[1] == (1, 1, 0)


def test_a_fun_whose_residuals_change_form_goes_through_the_adapter() -> None:

    form = {"flat": True}

    def changing(x: torch.Tensor) -> torch.Tensor:
        out = _exp_model(x)
        # float64 and flat when probed; a (12, 1) float32 column afterwards.
        return out if form["flat"] else out.reshape(12, 1).to(torch.float32)

    counter = CallCounter(changing)
    jac = _autodiff(counter, "auto", changing)
    form["flat"] = False
    x = torch.tensor([2.0, 0.7], dtype=F64)
    J = jac(x)
    ref = torch.func.jacrev(lambda v: changing(v).reshape(-1).to(F64))(x)
    assert J.shape == (12, 2) and J.dtype == F64
    torch.testing.assert_close(J, ref, rtol=0.0, atol=0.0)
    assert counter.value_calls == 0  # both transforms' calls booked as Jacobian calls
    assert counter.calls == counter.jacobian_calls == 2  # the refused call counts too


def test_least_squares_takes_the_direct_transform_and_matches_scipy() -> None:
    import scipy.optimize

    t = np.linspace(0.0, 3.0, 12)
    data = 2.0 * np.exp(-0.5 * t) + 0.01 * np.sin(7 * t)

    def torch_fun(x: torch.Tensor) -> torch.Tensor:
        tt = torch.from_numpy(t)
        return x[0] * torch.exp(-x[1] * tt) - torch.from_numpy(data)

    def numpy_fun(x: np.ndarray) -> np.ndarray:
        return x[0] * np.exp(-x[1] * t) - data

    def numpy_jac(x: np.ndarray) -> np.ndarray:
        e = np.exp(-x[1] * t)
        return np.stack([e, -x[0] * t * e], axis=1)

    import secondorder as so

    tight = {"ftol": 1e-15, "xtol": 1e-15, "gtol": 1e-15, "method": "lm"}
    ours = so.least_squares(torch_fun, torch.tensor([1.0, 1.0], dtype=F64), **tight)
    ref = scipy.optimize.least_squares(numpy_fun, [1.0, 1.0], jac=numpy_jac, **tight)
    # The valley is flat to 1e-18 in cost: scipy's own lm and trf differ by 3e-10 in x.
    np.testing.assert_allclose(ours.x.numpy(), ref.x, rtol=1e-8)
    assert ours.cost == pytest.approx(ref.cost, rel=1e-12)
    assert ours.njev >= 1 and ours.nfev >= 1
