"""curve_fit and covariance against scipy.optimize.curve_fit on the same problems."""

from __future__ import annotations

import inspect
import math
import warnings

import numpy as np
import pytest
import scipy.optimize as sopt
import torch

from secondorder.fitting import (
    FitReport,
    correlation,
    covariance,
    curve_fit,
    fit_report,
    least_squares,
    standard_errors,
)

# Tight tolerances on both sides, so both solvers stop at the same minimum to ~1e-10
# and the comparison measures the covariance formula, not where each one stopped.
TOL = {"ftol": 1e-14, "xtol": 1e-14, "gtol": 1e-14}


def decay_np(t, a, k):
    return a * np.exp(-k * t)


def decay_torch(t, a, k):
    return a * torch.exp(-k * t)


def gauss_np(x, a, mu, s, c):
    return a * np.exp(-((x - mu) ** 2) / (2 * s**2)) + c


def gauss_torch(x, a, mu, s, c):
    return a * torch.exp(-((x - mu) ** 2) / (2 * s**2)) + c


def decay_data():
    rng = np.random.default_rng(0)
    t = np.linspace(0, 4, 50)
    sigma = 0.01 + 0.03 * rng.random(50)
    y = 2.5 * np.exp(-1.3 * t) + sigma * rng.standard_normal(50)
    return t, y, sigma, [1.0, 0.1]


def gauss_data():
    rng = np.random.default_rng(1)
    x = np.linspace(-3, 3, 80)
    sigma = 0.03 + 0.05 * rng.random(80)
    y = gauss_np(x, 3.0, 0.4, 0.7, 0.5) + sigma * rng.standard_normal(80)
    return x, y, sigma, [1.0, 0.0, 1.0, 0.0]


PROBLEMS = {
    "decay-torch": (decay_torch, decay_np, decay_data),
    "decay-numpy": (decay_np, decay_np, decay_data),
    "gauss-torch": (gauss_torch, gauss_np, gauss_data),
    "gauss-numpy": (gauss_np, gauss_np, gauss_data),
}
WEIGHTS = {
    "unweighted": lambda s: {},
    "sigma": lambda s: {"sigma": s},
    "absolute-sigma": lambda s: {"sigma": s, "absolute_sigma": True},
    "covariance-sigma": lambda s: {
        "sigma": np.diag(s**2)
        + 1e-5 * np.exp(-np.abs(np.subtract.outer(np.arange(s.size), np.arange(s.size))))
    },
}


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_matches_scipy_curve_fit(problem, weights):
    f, f_ref, data = PROBLEMS[problem]
    x, y, sigma, p0 = data()
    kw = WEIGHTS[weights](sigma)
    popt_ref, pcov_ref = sopt.curve_fit(f_ref, x, y, p0=p0, **kw, **TOL)
    popt, pcov = curve_fit(f, x, y, p0=p0, **kw, **TOL)
    assert isinstance(popt, np.ndarray) and isinstance(pcov, np.ndarray)
    assert popt.shape == popt_ref.shape and pcov.shape == pcov_ref.shape
    assert rel(popt, popt_ref) < 1e-7
    assert rel(pcov, pcov_ref) < 1e-6


def test_matches_scipy_with_bounds():
    x, y, _, p0 = gauss_data()
    bounds = ([0, -1, 0.1, -1], [10, 1, 5, 1])
    popt_ref, pcov_ref = sopt.curve_fit(gauss_np, x, y, p0=p0, bounds=bounds, **TOL)
    popt, pcov = curve_fit(gauss_torch, x, y, p0=p0, bounds=bounds, **TOL)
    assert rel(popt, popt_ref) < 1e-7
    assert rel(pcov, pcov_ref) < 1e-6


@pytest.mark.parametrize("upper", [math.inf, 1e-6])
def test_a_tiny_parameter_above_its_bound_keeps_its_digits(upper):
    # A diode's saturation current (1e-14 A) fitted under bounds (0, upper) on exact
    # data: scipy's trf recovers it to rounding, and so must the change of variables
    # (√(y² + 1) - 1 and (sin y + 1)/2 rounded it to a few digits).
    v = np.linspace(0.3, 0.7, 41)

    def diode(v, i0, n):
        return i0 * np.expm1(v / (n * 0.02585))

    current = diode(v, 1e-14, 1.5)
    bounds = ([0.0, 0.5], [upper, 3.0])
    kw = {"p0": [3e-14, 1.3], "sigma": 0.01 * current, "bounds": bounds}
    ref, _ = sopt.curve_fit(diode, v, current, **kw)
    popt, _ = curve_fit(diode, v, current, **kw)
    np.testing.assert_allclose(ref, [1e-14, 1.5], rtol=1e-12)
    np.testing.assert_allclose(popt, [1e-14, 1.5], rtol=1e-12)


def test_covariance_does_not_depend_on_the_parameters_units():
    # I0 ~ 3e-15 beside n ~ 1.5: J's columns are 10¹⁴ apart (cond 1.5e14) but the fit
    # is well posed (cond 8.6 with unit columns).  scipy's default (MINPACK's pivoted
    # QR) gives the errors; an SVD rank test on the unscaled J called I0's direction
    # undetermined (inf, with a warning) and shrank the other error 4x.
    v = np.linspace(0.3, 0.7, 41)

    def diode(v, i0, n):
        return i0 * np.expm1(v / (n * 0.02585))

    clean = diode(v, 3.3e-15, 1.5)
    sigma = 0.01 * clean
    noisy = clean + sigma * np.random.default_rng(0).standard_normal(v.size)
    kw = {"p0": [3e-14, 1.3], "sigma": sigma, "absolute_sigma": True}
    popt_ref, pcov_ref = sopt.curve_fit(diode, v, noisy, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        popt, pcov = curve_fit(diode, v, noisy, **kw)
    np.testing.assert_allclose(popt, popt_ref, rtol=1e-8)
    np.testing.assert_allclose(np.sqrt(np.diag(pcov)), np.sqrt(np.diag(pcov_ref)), rtol=1e-6)


def test_p0_none_reads_the_signature_like_scipy():
    t, y, _, _ = decay_data()
    popt_ref, pcov_ref = sopt.curve_fit(decay_np, t, y, **TOL)
    popt, pcov = curve_fit(decay_torch, t, y, **TOL)
    assert rel(popt, popt_ref) < 1e-7
    assert rel(pcov, pcov_ref) < 1e-6


def test_covariance_of_least_squares_result_equals_scipy_formula():
    """covariance(res) is s²(JᵀJ)⁻¹ with s² = 2·cost/(m-n), computed here independently."""
    t, y, _, _ = decay_data()
    tt, yy = torch.tensor(t), torch.tensor(y)
    res = least_squares(
        lambda p: p[0] * torch.exp(-p[1] * tt) - yy, torch.tensor([1.0, 0.1], dtype=torch.float64)
    )
    J = res.jac.numpy()
    m, n = J.shape
    s_sq = np.sum(res.fun.numpy() ** 2) / (m - n)
    expected = np.linalg.inv(J.T @ J) * s_sq
    cov = covariance(res)
    assert isinstance(cov, torch.Tensor)
    assert rel(cov.numpy(), expected) < 1e-10
    assert rel(covariance(res, absolute_sigma=True).numpy(), np.linalg.inv(J.T @ J)) < 1e-10


def test_tensor_p0_gives_tensors():
    t, y, _, _ = decay_data()
    popt, pcov = curve_fit(decay_torch, torch.tensor(t), torch.tensor(y), torch.tensor([1.0, 0.1]))
    assert isinstance(popt, torch.Tensor) and isinstance(pcov, torch.Tensor)
    assert popt.dtype == torch.float64
    assert popt[1].item() == pytest.approx(1.3, rel=0.05)


def test_callable_jac_matches_scipy():
    t, y, sigma, p0 = decay_data()

    def jac(t, a, k):
        e = np.exp(-k * t)
        return np.stack([e, -a * t * e], axis=1)

    popt_ref, pcov_ref = sopt.curve_fit(decay_np, t, y, p0=p0, sigma=sigma, jac=jac, **TOL)
    popt, pcov = curve_fit(decay_np, t, y, p0=p0, sigma=sigma, jac=jac, **TOL)
    assert rel(popt, popt_ref) < 1e-7
    assert rel(pcov, pcov_ref) < 1e-6


def test_full_output_and_report():
    t, y, _, p0 = decay_data()
    popt, pcov, info, mesg, ier = curve_fit(decay_torch, t, y, p0, full_output=True)
    # method="lm" (the default here): MINPACK's ier and meaning, as scipy's leastsq.
    ref_ier = sopt.curve_fit(decay_np, t, y, p0, full_output=True)[-1]
    assert ier == ref_ier == 1
    assert mesg.startswith("ftol") and "reductions of the sum of squares" in mesg
    assert info["nfev"] == info["result"].nfev
    assert np.asarray(info["fvec"]).shape == (50,)
    report = fit_report(info["result"], names=["amplitude", "rate"])
    assert isinstance(report, FitReport)
    np.testing.assert_allclose(report.values, popt, rtol=1e-12)
    np.testing.assert_allclose(report.covariance, pcov, rtol=1e-12)
    np.testing.assert_allclose(report.stderr, np.sqrt(np.diag(pcov)), rtol=1e-12)
    assert report.params["rate"] == pytest.approx(popt[1])
    assert report.redchi == pytest.approx(2 * report.cost / 48)
    text = str(report)
    assert "amplitude" in text and "rate" in text and "±" in text
    assert f"function evals     = {info['result'].nfev}" in text
    assert info["result"].message in text
    c = pcov[0, 1] / math.sqrt(pcov[0, 0] * pcov[1, 1])
    assert f"C(amplitude, rate) = {c:+.4f}" in text


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("epsfcn", "diff_step=sqrt"),
        ("diag", "x_scale=1/diag"),
        ("factor", "leave it out"),
        ("col_deriv", "one row per data point"),
    ],
)
def test_leastsq_only_keywords_are_refused_with_what_to_pass_instead(name, hint):
    t, y, _, p0 = decay_data()
    with pytest.raises(TypeError, match=rf"curve_fit got {name}=.*scipy's leastsq.*{hint}"):
        curve_fit(decay_np, t, y, p0, **{name: 1e-6})


def test_nan_in_the_data_is_named_as_a_possible_cause():
    t, y, _, p0 = decay_data()
    y = np.array(y, dtype=float)
    y[[3, 7]] = np.nan
    with pytest.raises(ValueError, match=r"2 of 50 entries are NaN or inf \(at 3, 7\).*ydata"):
        curve_fit(decay_np, t, y, p0, check_finite=False)


def test_report_hides_weak_correlations():
    x, y, _, p0 = gauss_data()
    res = least_squares(
        lambda p: gauss_torch(torch.tensor(x), *p.unbind(0)) - torch.tensor(y),
        torch.tensor(p0, dtype=torch.float64),
    )
    report = fit_report(res, names=["a", "mu", "s", "c"], min_correlation=0.5)
    corr = correlation(covariance(res)).numpy()
    strong = {(i, j) for i in range(4) for j in range(i + 1, 4) if abs(corr[i, j]) > 0.5}
    assert len(report.correlations()) == len(strong)
    everything = fit_report(res, min_correlation=0.0)
    assert len(everything.correlations()) == 6
    assert "p0" in str(everything)


def test_standard_errors_and_correlation():
    cov = np.array([[4.0, 1.0, 0.0], [1.0, 9.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(standard_errors(cov), [2.0, 3.0, 0.0])
    expected = np.array([[1.0, 1 / 6, 0.0], [1 / 6, 1.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(correlation(cov), expected)
    assert isinstance(correlation(torch.tensor(cov)), torch.Tensor)


def test_no_degrees_of_freedom_gives_inf_with_a_warning():
    t = np.array([0.0, 1.0])
    y = np.array([2.0, 1.0])
    # scipy's category (scipy.optimize.OptimizeWarning), as its curve_fit warns.
    with pytest.warns(sopt.OptimizeWarning, match="2 residuals leave no degrees of freedom"):
        popt, pcov = curve_fit(decay_torch, t, y, p0=[1.0, 0.1])
    assert np.isinf(pcov).all()
    assert popt[0] == pytest.approx(2.0, rel=1e-6)
    _, pcov_abs = curve_fit(decay_torch, t, y, p0=[1.0, 0.1], absolute_sigma=True)
    assert np.isfinite(pcov_abs).all()


def test_evaluation_budget_raises_like_scipy():
    x, y, _, p0 = gauss_data()
    with pytest.raises(RuntimeError, match="Optimal parameters not found"):
        curve_fit(gauss_torch, x, y, p0=p0, maxfev=2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"sigma": np.ones(7)},
            ValueError,
            r"sigma must be a scalar or have shape \(50,\) or \(50, 50\)",
        ),
        ({"sigma": np.zeros(50)}, ValueError, "sigma must be finite and > 0"),
        ({"sigma": -np.eye(50)}, ValueError, "sigma, given as an .* positive definite"),
        ({"method": "newton"}, ValueError, "Unknown method='newton'"),
        ({"nan_policy": "hi"}, ValueError, r"nan_policy must be one of \{None, 'raise', 'omit'\}"),
        ({"absolute_sigma": 1}, TypeError, "absolute_sigma must be True or False"),
        ({"p0": [[1.0, 2.0]]}, ValueError, "p0 must be a non-empty 1-D sequence"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    t, y, _, p0 = decay_data()
    kwargs = {"p0": p0, **kwargs}
    with pytest.raises(error, match=match):
        curve_fit(decay_torch, t, y, **kwargs)


def test_bad_data_and_model_are_named():
    t, y, _, p0 = decay_data()
    with pytest.raises(TypeError, match="f must be callable"):
        curve_fit("decay", t, y, p0)
    bad = y.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match="ydata contains NaN"):
        curve_fit(decay_torch, t, bad, p0)
    with pytest.raises(ValueError, match="f\\(xdata, \\*p\\) returned 49 values but ydata has 50"):
        curve_fit(lambda x, a, k: a * torch.exp(-k * x[1:]), t, y, p0)
    with pytest.raises(ValueError, match=r"p0 is None .* takes no parameters after x"):
        curve_fit(lambda *a: a[0], t, y)


def test_report_arguments_are_checked():
    t, y, _, _ = decay_data()
    tt, yy = torch.tensor(t), torch.tensor(y)
    res = least_squares(
        lambda p: p[0] * torch.exp(-p[1] * tt) - yy, torch.tensor([1.0, 0.1], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="names has 3 entries but the fit has 2 parameters"):
        fit_report(res, names=["a", "b", "c"])
    with pytest.raises(ValueError, match="names must be unique"):
        fit_report(res, names=["a", "a"])
    with pytest.raises(TypeError, match="names must be a sequence of strings"):
        fit_report(res, names="ab")
    with pytest.raises(ValueError, match=r"Invalid min_correlation=1\.5"):
        fit_report(res, min_correlation=1.5)
    with pytest.raises(TypeError, match="res must be the OptimizeResult of least_squares"):
        covariance({"x": 1})
    with pytest.raises(ValueError, match="cov must be a square matrix"):
        standard_errors(np.ones(3))


class CountedModel:
    """A model function that counts its calls."""

    def __init__(self, f):
        self.f = f
        self.calls = 0
        self.__signature__ = inspect.signature(f)

    def __call__(self, x, *params):
        self.calls += 1
        return self.f(x, *params)


@pytest.mark.parametrize(
    ("model", "options", "kind_check"),
    [
        # A torch f on NumPy data: two calls decide (it is differentiable, and it refuses
        # the arrays, so it has no NumPy meaning to keep), then nfev + 1 calls: reverse
        # mode takes an accepted point's J from the vjp that evaluated it, so only the
        # Jacobian at p0 calls f (before the fix: 17 calls for nfev 6, njev 5).
        (decay_torch, {}, 2),
        # A NumPy f: the same one call (it rejects tensors), then nfev calls.
        (decay_np, {}, 1),
        # jac="3-point": the same one call decides (a torch f would take its
        # differences on tensors, a NumPy f on arrays).
        (decay_np, {"jac": "3-point"}, 1),
    ],
)
def test_f_is_called_once_per_counted_evaluation(model, options, kind_check):
    t, y, sigma, p0 = decay_data()
    f = CountedModel(model)
    popt, _, info, _, _ = curve_fit(f, t, y, p0=p0, sigma=sigma, full_output=True, **options)
    res = info["result"]
    autodiff = model is decay_torch
    assert f.calls == kind_check + res.nfev + (1 if autodiff else 0)
    assert not autodiff or res.njev > 1
    ref, _ = sopt.curve_fit(decay_np, t, y, p0=p0, sigma=sigma)
    np.testing.assert_allclose(popt, ref, rtol=1e-6)


def test_maxfev_1_calls_f_three_times_for_a_torch_model():
    t, y, _, p0 = decay_data()
    f = CountedModel(decay_torch)
    with pytest.raises(RuntimeError, match="Optimal parameters not found"):
        curve_fit(f, t, y, p0=p0, maxfev=1)
    # Deciding torch or NumPy (two calls on NumPy data), the value and the Jacobian at
    # p0 (before the fix: 8).
    assert f.calls == 4
