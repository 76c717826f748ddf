"""least_squares and curve_fit refuse or flag what would otherwise be a silent wrong result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import secondorder as so

F64 = torch.float64
X0 = torch.tensor([1.0, 2.0], dtype=F64)
NOT_CONNECTED = "fun's residuals do not depend on the parameters x"


def _detached(x: torch.Tensor) -> torch.Tensor:
    return (x**2 - 3).detach()


def _constant(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([1.0, 2.0], dtype=F64)


def _through_item(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([float(x[0]) - 1.0, float(x[1]) + 2.0], dtype=F64)


def _through_numpy(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.cos(x.detach().numpy()))


def _under_no_grad(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.sin(x) - 0.5


_W = torch.tensor([3.0, 4.0], dtype=F64, requires_grad=True)


def _other_tensor_only(x: torch.Tensor) -> torch.Tensor:
    return _W * 2  # requires grad, but not through x


@pytest.mark.parametrize(
    "fun",
    [_detached, _constant, _through_item, _through_numpy, _under_no_grad, _other_tensor_only],
)
@pytest.mark.parametrize("jac", ["auto", "fwd", "rev"])
def test_residuals_detached_from_x_are_refused(fun, jac):
    # Before: success=True at x0 (a zero Jacobian passes the gtol test).
    with pytest.raises(ValueError, match=NOT_CONNECTED + r".* or pass jac="):
        so.least_squares(fun, X0, jac=jac)


def test_partly_constant_residuals_and_finite_differences_are_accepted():
    # A constant residual next to ones that depend on x is a legitimate problem.
    def fun(x):
        return torch.cat([x - torch.tensor([3.0, -1.0], dtype=F64), torch.ones(1, dtype=F64)])

    res = so.least_squares(fun, X0)
    assert res.success
    torch.testing.assert_close(res.x, torch.tensor([3.0, -1.0], dtype=F64), rtol=0, atol=1e-6)
    # With finite differences a detached fun is differentiated numerically: no check.
    fd = so.least_squares(lambda x: (x.detach() - 3.0) * 2.0, X0, jac="2-point")
    torch.testing.assert_close(fd.x, torch.full((2,), 3.0, dtype=F64), rtol=0, atol=1e-6)


# -- item 6: float32 functions and parameters the model ignores ----------------------------

T = np.linspace(0.0, 3.0, 30)
Y = 2.5 * np.exp(-1.3 * T) + 0.5


def _decay32(p: np.ndarray) -> np.ndarray:
    return (p[0] * np.exp(-p[1] * T) + p[2] - Y).astype(np.float32)


@pytest.mark.parametrize("jac", ["2-point", "3-point"])
def test_float32_numpy_function_gets_steps_sized_for_float32(jac):
    # Before: 2-point steps of √eps64 are below float32's resolution: x = (2.58, 0.66,
    # 0.004) with success=True.  The data are exact: the answer is (2.5, 1.3, 0.5).
    res = so.least_squares(_decay32, np.array([1.0, 1.0, 0.0]), jac=jac)
    assert res.success
    np.testing.assert_allclose(res.x, [2.5, 1.3, 0.5], rtol=1e-4, atol=1e-4)


def test_step_size_follows_the_output_dtype():
    from secondorder.fitting.functions import output_eps

    assert output_eps(np.zeros(2, dtype=np.float32)) == float(np.finfo(np.float32).eps)
    assert output_eps(torch.zeros(2, dtype=torch.float16)) == float(torch.finfo(torch.float16).eps)
    assert output_eps(np.zeros(2)) == output_eps(np.zeros(2, dtype=np.int64))
    assert output_eps(np.zeros(2)) == float(np.finfo(np.float64).eps)


def _ignores_c(t, a, k, c):
    return a * torch.exp(-k * t)


def _ignores_c_np(t, a, k, c):
    return a * np.exp(-k * t)


@pytest.mark.parametrize("model", [_ignores_c, _ignores_c_np], ids=["torch", "numpy"])
def test_a_parameter_the_model_ignores_has_infinite_variance(model):
    scipy_optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(0)
    y = 2.0 * np.exp(-0.7 * T) + 0.01 * rng.standard_normal(T.size)
    with pytest.warns(
        scipy_optimize.OptimizeWarning,
        match=r"could not be estimated for parameters \[2\]: the residuals do not change",
    ):
        popt, pcov = so.curve_fit(model, T, y, p0=[1.0, 1.0, 0.3])
    # The reference: scipy's fit of the model without the ignored parameter.
    ref_p, ref_cov = scipy_optimize.curve_fit(lambda t, a, k: a * np.exp(-k * t), T, y, p0=[1, 1])
    np.testing.assert_allclose(popt[:2], ref_p, rtol=1e-6)
    assert popt[2] == 0.3
    assert np.isinf(pcov[2, 2]) and np.all(np.isinf(pcov[2])) and np.all(np.isinf(pcov[:, 2]))
    # The other two keep the covariance of the reduced fit, scaled by m - 3 instead of
    # m - 2 degrees of freedom (the ignored parameter still counts, as in scipy).
    np.testing.assert_allclose(pcov[:2, :2], ref_cov * (T.size - 2) / (T.size - 3), rtol=1e-5)
    assert issubclass(so.fitting.UndeterminedWarning, RuntimeWarning)


def test_fit_report_flags_an_undetermined_parameter():
    def fun(p):
        return p[0] * torch.exp(-p[1] * torch.as_tensor(T)) - torch.as_tensor(Y) + 0.0 * p[2]

    res = so.least_squares(fun, torch.tensor([1.0, 1.0, 0.3], dtype=F64))
    text = str(so.fit_report(res, names=["a", "k", "c"]))
    assert "c =  0.3 ± (not determined)" in text
    assert "± 0 (0.00%)" not in text
