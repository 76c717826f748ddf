"""scipy's keywords of least_squares and curve_fit, each against scipy on the same problem.

What scipy users pass, and the fitting errors: ``method``,
``x_scale``, ``verbose``, ``diff_step``, a callable ``loss``, ``callback``,
``jac_sparsity``, ``tr_solver``/``tr_options``, the result as a dict, ``curve_fit``'s
``nan_policy``, scalar ``sigma``/``ydata``, ``infodict``'s MINPACK fields, the default
start under bounds, and ``fit_report`` as a string.
"""

from __future__ import annotations

import io
import re
import warnings
from contextlib import redirect_stdout
from typing import Any

import numpy as np
import pytest
import scipy.optimize as sopt
import torch
from scipy.sparse import lil_array
from scipy.sparse.linalg import aslinearoperator

import secondorder as so
from secondorder.fitting import FitReport, OptimizeResult, curve_fit, fit_report, least_squares
from secondorder.fitting.differences import column_groups

F64 = torch.float64
TIGHT = {"ftol": 1e-12, "xtol": 1e-12, "gtol": 1e-12}


def rosen(x: Any) -> Any:
    return np.array([10 * (x[1] - x[0] ** 2), 1 - x[0]])


def rosen_t(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([10 * (x[1] - x[0] ** 2), 1 - x[0]])


T = np.linspace(0, 3, 30)
Y = 2.5 * np.exp(-1.3 * T) + 0.5 + 0.01 * np.sin(17 * T)


def decay(p: Any) -> Any:
    return p[0] * np.exp(-p[1] * T) + p[2] - Y


def decay_model(x: Any, a: Any, b: Any, c: Any) -> Any:
    return a * np.exp(-b * x) + c


def broyden(x: Any) -> Any:
    f = (3 - x) * x + 1
    f[1:] -= x[:-1]
    f[:-1] -= 2 * x[1:]
    return f


def tridiagonal(n: int) -> np.ndarray:
    return (np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= 1).astype(int)


# -- method --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["trf", "dogbox", "lm"])
def test_each_method_reaches_scipy_solution(method: str) -> None:
    res = least_squares(decay, [1.0, 1.0, 0.0], method=method, **TIGHT)
    ref = sopt.least_squares(decay, [1.0, 1.0, 0.0], method=method, **TIGHT)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-7)
    assert res.cost == pytest.approx(ref.cost, rel=1e-10)


def test_trf_and_dogbox_under_bounds_reach_scipy_solution() -> None:
    bounds = ([0.0, 1.5, -1.0], [3.0, 5.0, 1.0])  # b's bound is active at 1.5
    for method in ("trf", "dogbox"):
        res = least_squares(decay, [1.0, 2.0, 0.0], bounds=bounds, method=method, **TIGHT)
        ref = sopt.least_squares(decay, [1.0, 2.0, 0.0], bounds=bounds, method=method, **TIGHT)
        np.testing.assert_allclose(res.x, ref.x, rtol=1e-6, atol=1e-9)
        np.testing.assert_array_equal(res.active_mask, ref.active_mask)


def test_lm_reports_njev_none_with_differences_like_scipy() -> None:
    res = least_squares(decay, [1.0, 1.0, 0.0], method="lm")
    ref = sopt.least_squares(decay, [1.0, 1.0, 0.0], method="lm")
    assert res.njev is None and ref.njev is None
    exact = least_squares(decay, [1.0, 1.0, 0.0], method="lm", jac=_decay_jac)
    assert exact.njev >= 1


def _decay_jac(p: Any) -> Any:
    e = np.exp(-p[1] * T)
    return np.stack([e, -p[0] * T * e, np.ones_like(T)], axis=1)


# -- x_scale -------------------------------------------------------------------------------


def test_array_x_scale_is_the_change_of_variables_x_equals_scale_times_u() -> None:
    """x_scale=s on f(x) runs the same iterates as f(s·u) with an identity damping matrix."""
    s = np.array([2.0, 0.5, 3.0])
    x0 = np.array([1.0, 1.0, 0.0])
    res = least_squares(decay, x0, jac=_decay_jac, x_scale=s, **TIGHT)
    ref = least_squares(
        lambda u: decay(s * u),
        x0 / s,
        jac=lambda u: _decay_jac(s * u) * s,
        damping_matrix="identity",
        **TIGHT,
    )
    np.testing.assert_allclose(res.x, s * ref.x, rtol=1e-12)
    assert (res.nfev, res.njev) == (ref.nfev, ref.njev)
    scipy_ref = sopt.least_squares(decay, x0, x_scale=s, **TIGHT)
    np.testing.assert_allclose(res.x, scipy_ref.x, rtol=1e-7)


def test_x_scale_jac_is_mores_scaling_the_default() -> None:
    a = least_squares(decay, [1.0, 1.0, 0.0], x_scale="jac")
    b = least_squares(decay, [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(a.x, b.x)
    assert a.nfev == b.nfev


def test_x_scale_under_bounds_reaches_scipy_solution() -> None:
    bounds = ([0.0, 1.5, -1.0], [3.0, 5.0, 1.0])
    res = least_squares(decay, [1.0, 2.0, 0.0], bounds=bounds, x_scale=[1.0, 0.1, 1.0], **TIGHT)
    ref = sopt.least_squares(decay, [1.0, 2.0, 0.0], bounds=bounds, **TIGHT)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-6, atol=1e-9)


# -- verbose -------------------------------------------------------------------------------


def _printed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, list[str]]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        out = fn(*args, **kw)
    return out, buf.getvalue().splitlines()


def test_verbose_2_prints_scipys_table_and_summary() -> None:
    res, ours = _printed(least_squares, rosen, [-2.0, 1.0], verbose=2)
    ref, theirs = _printed(sopt.least_squares, rosen, [-2.0, 1.0], verbose=2)
    assert ours[0] == theirs[0]  # the header, character for character
    rows = ours[1:-2]
    assert len(rows) == res.nit + 1
    for line in rows:
        assert len(line) == len(theirs[1]) or len(line) == len(theirs[-3])
    # The first row is the start: the same cost and optimality as scipy's (our nfev
    # also counts the finite-difference calls of the first Jacobian).
    first, ref_first = ours[1].split(), theirs[1].split()
    assert (first[0], first[2:]) == (ref_first[0], ref_first[2:])
    assert int(first[1]) == 1 + 2
    assert ours[-2] == res.message and theirs[-2] == ref.message
    pattern = (
        r"Function evaluations \d+, initial cost 4\.5450e\+02, final cost \S+, "
        r"first-order optimality \S+\."
    )
    assert re.fullmatch(pattern, ours[-1]) and re.fullmatch(pattern, theirs[-1])
    assert f"Function evaluations {res.nfev}," in ours[-1]


def test_verbose_1_prints_two_lines_and_lm_prints_no_table_like_scipy() -> None:
    for method in ("trf", "lm"):
        _, ours = _printed(least_squares, rosen, [-2.0, 1.0], verbose=1, method=method)
        _, theirs = _printed(sopt.least_squares, rosen, [-2.0, 1.0], verbose=1, method=method)
        assert len(ours) == len(theirs) == 2
    _, ours = _printed(least_squares, rosen, [-2.0, 1.0], verbose=2, method="lm")
    _, theirs = _printed(sopt.least_squares, rosen, [-2.0, 1.0], verbose=2, method="lm")
    assert len(ours) == len(theirs) == 2
    _, silent = _printed(least_squares, rosen, [-2.0, 1.0])
    assert silent == []


# -- diff_step and the finite-difference schemes --------------------------------------------


@pytest.mark.parametrize("jac", ["2-point", "3-point", "cs"])
@pytest.mark.parametrize("diff_step", [None, 1e-3])
def test_finite_difference_jacobian_equals_scipys(jac: str, diff_step: float | None) -> None:
    """max_nfev=1 returns the Jacobian at x0: the same steps give the same numbers."""
    x0 = np.array([-1.2, 0.7, 0.3])
    res = least_squares(decay, x0, jac=jac, diff_step=diff_step, max_nfev=1)
    ref = sopt.least_squares(decay, x0, jac=jac, diff_step=diff_step, max_nfev=1)
    np.testing.assert_allclose(res.jac, ref.jac, rtol=1e-12, atol=1e-14)


def test_complex_step_of_a_torch_fun_is_exact() -> None:
    x0 = torch.tensor([-1.2, 1.0], dtype=F64)
    res = least_squares(rosen_t, x0, jac="cs", max_nfev=1)
    exact = torch.func.jacfwd(rosen_t)(x0)
    torch.testing.assert_close(res.jac, exact, rtol=1e-15, atol=1e-15)


# -- a callable loss -----------------------------------------------------------------------


def cubic_soft_l1(z: np.ndarray) -> np.ndarray:
    t = 1 + z
    return np.stack([3 * (t ** (1 / 3) - 1), t ** (-2 / 3), -2 / 3 * t ** (-5 / 3)])


def soft_l1(z: np.ndarray) -> np.ndarray:
    t = 1 + z
    return np.stack([2 * (t**0.5 - 1), t**-0.5, -0.5 * t**-1.5])


def test_a_callable_loss_equals_the_named_one_and_scipys_solution() -> None:
    y = Y.copy()
    y[[3, 11]] += 2.0  # outliers

    def fun(p: Any) -> Any:
        return p[0] * np.exp(-p[1] * T) + p[2] - y

    named = least_squares(fun, [1.0, 1.0, 0.0], loss="soft_l1", f_scale=0.1, **TIGHT)
    given = least_squares(fun, [1.0, 1.0, 0.0], loss=soft_l1, f_scale=0.1, **TIGHT)
    # The same ρ, computed by NumPy instead of torch: equal to rounding.
    np.testing.assert_allclose(given.x, named.x, rtol=1e-8)
    assert given.cost == pytest.approx(named.cost, rel=1e-12)
    ours = least_squares(fun, [1.0, 1.0, 0.0], loss=cubic_soft_l1, f_scale=0.1, **TIGHT)
    ref = sopt.least_squares(fun, [1.0, 1.0, 0.0], loss=cubic_soft_l1, f_scale=0.1, **TIGHT)
    np.testing.assert_allclose(ours.x, ref.x, rtol=1e-6)
    assert ours.cost == pytest.approx(ref.cost, rel=1e-9)


# -- callback ------------------------------------------------------------------------------


def test_callback_intermediate_result_and_stop_iteration_like_scipy() -> None:
    seen: list[OptimizeResult] = []

    def record(intermediate_result: OptimizeResult) -> None:
        seen.append(intermediate_result)

    res = least_squares(rosen, [-2.0, 1.0], callback=record)
    assert [r.nit for r in seen] == list(range(1, res.nit + 1))
    np.testing.assert_array_equal(seen[-1].x, res.x)
    assert seen[-1].cost == res.cost and seen[-1].nfev == res.nfev
    np.testing.assert_array_equal(seen[-1]["fun"], res.fun)

    xs: list[np.ndarray] = []

    def stop(x: np.ndarray) -> None:
        xs.append(x)
        raise StopIteration

    res = least_squares(rosen, [-2.0, 1.0], callback=stop)
    ref = sopt.least_squares(rosen, [-2.0, 1.0], callback=stop)
    assert res.status == ref.status == -2
    assert not res.success and res.nit == 1
    assert "callback" in res.message and "StopIteration" in res.message


# -- jac_sparsity --------------------------------------------------------------------------


def test_jac_sparsity_groups_columns_and_gives_the_dense_differences() -> None:
    n = 30
    x0 = -np.ones(n)
    pattern = tridiagonal(n)
    assert column_groups(torch.from_numpy(pattern != 0)) == [list(range(k, n, 3)) for k in range(3)]
    dense = least_squares(broyden, x0, jac="2-point", max_nfev=1)
    grouped = least_squares(broyden, x0, jac="2-point", max_nfev=1, jac_sparsity=pattern)
    np.testing.assert_array_equal(grouped.jac, dense.jac)
    assert (dense.nfev, grouped.nfev) == (1 + n, 1 + 3)
    sparse = lil_array(pattern)
    res = least_squares(broyden, x0, jac_sparsity=sparse, **TIGHT)
    ref = sopt.least_squares(broyden, x0, jac_sparsity=sparse, **TIGHT)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-9)


# -- tr_solver / tr_options ----------------------------------------------------------------


def test_lsmr_is_the_iterative_solver_and_reaches_the_exact_solution() -> None:
    exact = least_squares(broyden, -np.ones(20), tr_solver="exact", **TIGHT)
    lsmr = least_squares(
        broyden, -np.ones(20), tr_solver="lsmr", tr_options={"btol": 1e-12}, **TIGHT
    )
    ref = sopt.least_squares(broyden, -np.ones(20), tr_solver="lsmr", **TIGHT)
    np.testing.assert_allclose(lsmr.x, exact.x, rtol=1e-9)
    np.testing.assert_allclose(lsmr.x, ref.x, rtol=1e-9)


def test_a_sparse_jacobian_is_made_dense() -> None:
    n = 20

    def jac(x: np.ndarray) -> lil_array:
        J = lil_array((n, n))
        i = np.arange(n)
        J[i, i] = 3 - 2 * x
        J[i[1:], i[:-1]] = -1
        J[i[:-1], i[1:]] = -2
        return J

    res = least_squares(broyden, -np.ones(n), jac=jac, **TIGHT)
    dense = least_squares(broyden, -np.ones(n), jac=lambda x: jac(x).toarray(), **TIGHT)
    np.testing.assert_array_equal(res.x, dense.x)
    assert isinstance(res.jac, np.ndarray)


# -- the result ----------------------------------------------------------------------------


def test_result_is_a_dict_with_attributes_and_a_short_repr() -> None:
    res = least_squares(broyden, -np.ones(200), jac_sparsity=tridiagonal(200))
    ref = sopt.least_squares(broyden, -np.ones(200), jac_sparsity=tridiagonal(200))
    assert isinstance(res, dict)
    assert res["x"] is res.x and res["jac"] is res.jac
    assert set(ref.keys()) <= set(res.keys())
    text = repr(res)
    assert "jac: array of shape (200, 200), float64" in text
    assert len(text) < 1500 and len(text.splitlines()) == len(res)
    res.note = "kept"
    assert res["note"] == "kept"
    with pytest.raises(AttributeError, match="no_such_field"):
        _ = res.no_such_field


# -- NumPy and torch, x0 and fun of different kinds ------------------------------------------


def test_a_numpy_fun_with_a_tensor_x0_runs_and_returns_tensors() -> None:
    res = least_squares(decay, torch.tensor([1.0, 1.0, 0.0], dtype=F64), **TIGHT)
    ref = least_squares(decay, np.array([1.0, 1.0, 0.0]), **TIGHT)
    assert isinstance(res.x, torch.Tensor)
    np.testing.assert_array_equal(res.x.numpy(), ref.x)


def test_a_torch_fun_with_a_numpy_x0_runs_with_exact_derivatives() -> None:
    res = least_squares(rosen_t, np.array([-2.0, 1.0]))
    ref = least_squares(rosen_t, torch.tensor([-2.0, 1.0], dtype=F64))
    assert isinstance(res.x, np.ndarray)
    np.testing.assert_array_equal(res.x, ref.x.numpy())


def test_a_fun_failing_for_both_kinds_raises_its_own_error() -> None:
    def broken(x: Any) -> Any:
        raise KeyError("the user's bug")

    with pytest.raises(KeyError, match="the user's bug"):
        least_squares(broken, np.ones(2))


# -- errors of least_squares -----------------------------------------------------------------


def _f(x: Any) -> Any:
    return x - 1


_X = np.zeros(2)
_EPS = r"2\.22e-16"


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"method": "newton"}, ValueError, r"Unknown method='newton'.*'trf', 'dogbox', 'lm'"),
        ({"method": "lm", "loss": "huber"}, ValueError, r"method='lm' supports only the 'linear'"),
        ({"method": "lm", "bounds": (-1, 1)}, ValueError, r"Method 'lm' doesn't support bounds"),
        ({"verbose": 3}, ValueError, r"Invalid verbose=3: must be 0, 1 or 2"),
        ({"verbose": True}, ValueError, r"Invalid verbose=True"),
        (
            {"method": "lm", "xtol": None},
            ValueError,
            rf"machine epsilon \({_EPS}\) for method 'lm'",
        ),
        (
            {"ftol": None, "xtol": 0.0, "gtol": 1e-20},
            ValueError,
            r"At least one of the tolerances must be higher than machine epsilon",
        ),
        ({"tr_solver": "best"}, ValueError, r"Unknown tr_solver='best'.*None, 'exact', 'lsmr'"),
        ({"tr_options": [1]}, TypeError, r"tr_options must be a dict, got \[1\]"),
        ({"tr_solver": "lsmr", "solver": "qr"}, ValueError, r"tr_solver='lsmr' and solver='qr'"),
        (
            {"tr_solver": "exact", "tr_options": {"btol": 1e-9}},
            ValueError,
            r"tr_options=\{'btol': 1e-09\} apply to tr_solver='lsmr'",
        ),
        ({"tr_options": {"tol": 1.0}}, TypeError, r"tr_options has unsupported keys \['tol'\]"),
        ({"tr_options": {"atol": -1.0}}, ValueError, r"Invalid tr_options\['atol'\]=-1\.0"),
        ({"tr_options": {"maxiter": 0}}, ValueError, r"Invalid tr_options\['maxiter'\]=0"),
        ({"kwargs": [("a", 1)]}, TypeError, r"kwargs must be a dict.*got list"),
        ({"callback": 3}, TypeError, r"callback must be callable or None, got 3"),
        ({"workers": 2}, ValueError, r"workers=2 is not supported"),
        ({"diff_step": "big"}, TypeError, r"diff_step must be a positive number or array"),
        ({"diff_step": -1.0}, ValueError, r"diff_step must be finite and > 0 everywhere"),
        ({"diff_step": [1e-3] * 3}, ValueError, r"diff_step must be a scalar or have x0's shape"),
        ({"diff_step": ["a", "b"]}, ValueError, r"diff_step must be a positive number or an array"),
        ({"x_scale": "auto"}, ValueError, r"x_scale must be 'jac' or positive numbers.*'auto'"),
        ({"x_scale": 1 + 2j}, ValueError, r"x_scale must be 'jac' or positive numbers"),
        ({"x_scale": -1.0}, ValueError, r"x_scale must be finite and > 0"),
        (
            {"x_scale": "jac", "damping_matrix": "identity"},
            ValueError,
            r"x_scale='jac' is Moré's scaling.*damping_matrix='identity'",
        ),
        (
            {"x_scale": 2.0, "damping_matrix": "more"},
            ValueError,
            r"x_scale=2\.0 sets the damping matrix.*damping_matrix='more'",
        ),
        ({"method": "lm", "jac_sparsity": [1]}, ValueError, r"method='lm' does not support jac"),
        ({"jac": "fwd", "jac_sparsity": np.eye(2)}, ValueError, r"jac='fwd' is automatic"),
        ({"jac_sparsity": np.ones((3, 2))}, ValueError, r"jac_sparsity has wrong shape \(3, 2\)"),
        ({"jac_sparsity": [["a"]]}, ValueError, r"jac_sparsity must be an \(m, n\) 0/1 array"),
        ({"loss": lambda z: z}, ValueError, r"callable loss has wrong shape \(2,\); expected"),
        ({"loss": 3}, ValueError, r"Unknown loss=3.*or a callable rho"),
        (
            {"jac": lambda x: aslinearoperator(np.eye(2))},
            ValueError,
            r"jac returned a \w*LinearOperator; LinearOperator Jacobians are not supported",
        ),
        (
            {"jac": lambda x: lil_array(np.eye(2)), "method": "lm"},
            ValueError,
            r"method='lm' works only with dense Jacobian matrices",
        ),
        ({"jac": lambda x: np.ones((1, 1, 2))}, ValueError, r"jac returned shape \(1, 1, 2\)"),
        ({"bounds": (1.0, 2.0)}, ValueError, r"Initial guess is outside of provided bounds"),
    ],
)
def test_bad_keywords_are_refused_with_a_message(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        least_squares(_f, _X, **options)


def test_residuals_and_jacobian_on_another_device_than_x0_are_refused() -> None:
    # The meta device stands for a GPU (differences: autograd cannot probe meta values):
    # a fun that moves its result elsewhere is named before any step, rather than
    # failing inside torch with a device mismatch.
    x0 = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match=r"fun returned residuals on meta for x0 on cpu"):
        least_squares(lambda x: (x - 1).to("meta"), x0, jac="2-point")
    with pytest.raises(ValueError, match=r"jac returned a Jacobian on meta for x on cpu"):
        least_squares(lambda x: x - 1, x0, jac=lambda x: torch.eye(2, dtype=F64, device="meta"))


def test_lm_refuses_fewer_residuals_than_variables() -> None:
    with pytest.raises(ValueError, match=r"number of residuals \(1\) is less than.*\(2\)"):
        least_squares(lambda x: x[:1], _X, method="lm")


def test_jac_sparsity_with_torch_autodiff_is_refused() -> None:
    with pytest.raises(ValueError, match=r"differentiated exactly by torch \(jac='auto'\)"):
        least_squares(rosen_t, torch.zeros(2, dtype=F64), jac_sparsity=np.ones((2, 2)))


def test_complex_step_needs_a_fun_that_keeps_the_imaginary_part() -> None:
    with pytest.raises(TypeError, match=r"jac='cs' \(complex step\) needs fun"):
        least_squares(lambda x: np.real(x) - 1, _X, jac="cs")


# -- curve_fit -----------------------------------------------------------------------------


def test_nan_policy_against_scipy() -> None:
    x = np.array([0.0, 0.5, np.nan, 1.5, 2.0, 2.5, 3.0])
    y = decay_model(np.nan_to_num(x), 2.0, 1.0, 0.5) + np.array([0, 1, 0, -1, 1, 0, -1]) * 1e-3
    y[4] = np.nan
    p0 = [1.0, 1.0, 0.0]
    ours, ours_cov = curve_fit(decay_model, x, y, p0, nan_policy="omit")
    ref, ref_cov = sopt.curve_fit(decay_model, x, y, p0, nan_policy="omit")
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    np.testing.assert_allclose(ours_cov, ref_cov, rtol=1e-4)
    for fit in (curve_fit, sopt.curve_fit):
        with pytest.raises(ValueError, match="The input contains nan"):
            fit(decay_model, x, y, p0, nan_policy="raise")
        with pytest.raises(ValueError, match=r"`nan_policy='propagate'` is not supported"):
            fit(decay_model, x, y, p0, nan_policy="propagate")
    with pytest.raises(ValueError, match=r"ydata contains NaN or inf.*nan_policy='omit'"):
        curve_fit(decay_model, np.nan_to_num(x), y, p0)


def test_omit_drops_the_matching_sigma_entries_and_rows_of_a_covariance() -> None:
    x = np.linspace(0, 3, 12)
    y = decay_model(x, 2.0, 1.0, 0.5) + 1e-3 * np.cos(5 * x)
    y[5] = np.nan
    sigma = np.linspace(0.5, 1.5, 12)
    keep = ~np.isnan(y)
    full = curve_fit(decay_model, x, y, [1, 1, 0], sigma=np.diag(sigma**2), nan_policy="omit")
    cut = curve_fit(decay_model, x[keep], y[keep], [1, 1, 0], sigma=sigma[keep])
    # Whitening by a diagonal Cholesky factor and dividing by sigma agree to rounding.
    np.testing.assert_allclose(full[0], cut[0], rtol=1e-9)
    np.testing.assert_allclose(full[1], cut[1], rtol=1e-6)


@pytest.mark.parametrize("absolute_sigma", [False, True])
def test_scalar_sigma_and_scalar_ydata_like_scipy(absolute_sigma: bool) -> None:
    _, pcov1 = curve_fit(decay_model, T, Y, [1, 1, 0], sigma=0.2, absolute_sigma=absolute_sigma)
    _, pcov2 = curve_fit(
        decay_model, T, Y, [1, 1, 0], sigma=np.full(T.size, 0.2), absolute_sigma=absolute_sigma
    )
    np.testing.assert_array_equal(pcov1, pcov2)
    _, ref = sopt.curve_fit(decay_model, T, Y, [1, 1, 0], sigma=0.2, absolute_sigma=absolute_sigma)
    np.testing.assert_allclose(pcov1, ref, rtol=1e-5)

    def shifted(x: Any, a: Any, b: Any, c: Any) -> Any:
        return decay_model(x, a, b, c) - Y

    p_zero, cov_zero = curve_fit(shifted, T, np.zeros_like(T), [1, 1, 0])
    p_scalar, cov_scalar = curve_fit(shifted, T, 0.0, [1, 1, 0])
    np.testing.assert_array_equal(p_zero, p_scalar)
    np.testing.assert_array_equal(cov_zero, cov_scalar)


def test_infodict_has_minpacks_fjac_ipvt_qtf_like_scipy() -> None:
    """Same problem, same Jacobian: ipvt equal, R and Qᵀf equal up to MINPACK's signs."""

    def jac(x: Any, a: Any, b: Any, c: Any) -> Any:
        e = np.exp(-b * x)
        return np.stack([e, -a * x * e, np.ones_like(x)], axis=1)

    kw = {"ftol": 1e-15, "xtol": 1e-15, "gtol": 1e-15}
    ours = curve_fit(decay_model, T, Y, [1, 1, 0], jac=jac, method="lm", full_output=True, **kw)
    ref = sopt.curve_fit(decay_model, T, Y, [1, 1, 0], jac=jac, method="lm", full_output=True, **kw)
    info, rinfo = ours[2], ref[2]
    assert info["fjac"].shape == rinfo["fjac"].shape == (3, T.size)
    np.testing.assert_array_equal(info["ipvt"], rinfo["ipvt"])
    R, R_ref = np.triu(info["fjac"].T[:3]), np.triu(rinfo["fjac"].T[:3])
    signs = np.sign(np.diag(R)) * np.sign(np.diag(R_ref))
    np.testing.assert_allclose(R, signs[:, None] * R_ref, rtol=1e-6, atol=1e-9)
    # Qᵀf is ~0 at the minimum; both are small next to ‖f‖ and agree to that scale.
    scale = np.linalg.norm(info["fvec"])
    np.testing.assert_allclose(info["qtf"], signs * rinfo["qtf"], atol=1e-6 * scale)
    # The covariance from (R, ipvt) as scipy's leastsq builds it equals pcov.
    inv = np.linalg.inv(R)
    inv[info["ipvt"]] = inv.copy()
    np.testing.assert_allclose(inv @ inv.T * 2 * info["result"].cost / (T.size - 3), ours[1])
    assert info["nfev"] == info["result"].nfev


def test_with_bounds_and_no_p0_the_start_is_scipys_feasible_point() -> None:
    starts: list[tuple[float, ...]] = []

    def model(x: Any, a: Any, b: Any, c: Any) -> Any:
        if not starts:
            starts.append((float(a), float(b), float(c)))
        return decay_model(x, a, b, c)

    bounds = ([0.0, 0.5, -np.inf], [4.0, np.inf, 2.0])
    popt, _ = curve_fit(model, T, Y, bounds=bounds)
    assert starts[0] == (2.0, 1.5, 1.0)  # middle, lb + 1, ub - 1 (scipy's rule)
    ref, _ = sopt.curve_fit(decay_model, T, Y, bounds=bounds)
    np.testing.assert_allclose(popt, ref, rtol=1e-6)


def test_a_torch_model_with_finite_differences_and_a_torch_jac() -> None:
    def model(x: Any, a: Any, b: Any, c: Any) -> Any:
        return a * torch.exp(-b * x) + c

    def jac(x: Any, a: Any, b: Any, c: Any) -> Any:
        e = torch.exp(-b * x)
        return torch.stack([e, -a * x * e, torch.ones_like(x)], dim=1)

    ref, ref_cov = sopt.curve_fit(decay_model, T, Y, [1, 1, 0])
    for options in ({"jac": "2-point"}, {"jac": "3-point"}, {"jac": jac}):
        popt, pcov = curve_fit(model, T, Y, [1, 1, 0], **options)
        np.testing.assert_allclose(popt, ref, rtol=1e-6)
        np.testing.assert_allclose(pcov, ref_cov, rtol=1e-4)


def test_the_undetermined_warning_is_scipys_optimize_warning() -> None:
    with pytest.warns(sopt.OptimizeWarning, match="could not be estimated"):
        curve_fit(lambda x, a, b: a * x, T, Y, [1.0, 1.0])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        ({"args": (1,)}, ValueError, r"'args' is not a supported keyword argument of curve_fit"),
        ({"kwargs": {"a": 1}}, ValueError, r"'kwargs' is not a supported keyword argument"),
        ({"nan_policy": "hi"}, ValueError, r"nan_policy must be one of \{None, 'raise', 'omit'\}"),
        (
            {"bounds": (0, 5), "method": "lm"},
            ValueError,
            r"Method 'lm' only works for unconstrained problems",
        ),
        ({"p0": [1, 1, 0], "method": "lm", "ydata": [1.0, 2.0]}, TypeError, r"func parameters=3"),
        (
            {"p0": [1, 1, 0], "jac": lambda x, a, b, c: np.ones((2, 3))},
            ValueError,
            r"jac\(xdata, \*p\) must return shape \(30, 3\), got \(2, 3\)",
        ),
        ({"p0": [1, 1, 0], "sigma": [1.0, 2.0]}, ValueError, r"sigma must be a scalar or have"),
    ],
)
def test_curve_fit_errors_name_the_argument(
    call: dict[str, Any], error: type[Exception], match: str
) -> None:
    ydata = call.pop("ydata", Y)
    with pytest.raises(error, match=match):
        curve_fit(decay_model, T, ydata, **call)


# -- fit_report ----------------------------------------------------------------------------


def test_fit_report_is_a_string_with_its_fields() -> None:
    _, _, info, _, _ = curve_fit(decay_model, T, Y, [1, 1, 0], full_output=True)
    report = fit_report(info["result"], names=["a", "b", "c"])
    assert isinstance(report, str) and isinstance(report, FitReport)
    assert ("fit:\n" + report).startswith("fit:\n[[Fit statistics]]")
    assert str(report) == report.text() and "[[Warnings]]" not in report
    # method=None is scipy's "lm", which reports no Jacobian count with differences.
    assert info["njev"] is None and "Jacobian evals     = not reported" in report
    assert report.params["b"] == pytest.approx(float(info["result"].x[1]))
    with pytest.raises(AttributeError, match="FitReport is read-only: cannot set cost"):
        report.cost = 1.0  # type: ignore[misc]


def test_fit_report_flags_undetermined_uncertainties_like_lmfit() -> None:
    ignored = least_squares(lambda p: p[0] * T - Y, np.array([1.0, 2.0]))
    report = fit_report(ignored, names=["slope", "unused"])
    assert "unused = " in report and "(not determined)" in report
    assert "[[Warnings]]" in report and "unused: infinite variance" in report

    # Two nearly parallel columns: finite variances, correlation -1 to 1e-12.
    def twins(p: Any) -> Any:
        return p[0] * T + p[1] * T * (1 + 1e-7 * T) - Y

    res = least_squares(twins, np.array([1.0, 1.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = fit_report(res, names=["a", "b"])
    assert np.isfinite(report.stderr).all()
    assert "a: correlation -1.0000 with b" in report
    assert "b: correlation -1.0000 with a" in report


def test_fit_report_of_none_says_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"res must be the OptimizeResult.*got NoneType.*infodict"):
        so.fit_report(None)  # type: ignore[arg-type]
