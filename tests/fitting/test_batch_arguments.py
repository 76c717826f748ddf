"""Every bad argument of curve_fit_batch and least_squares_batch is refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import secondorder as so

F64 = torch.float64
T = torch.linspace(0, 3, 12, dtype=F64)
Y = 2.0 * torch.exp(-T) + torch.zeros(5, 1, dtype=F64)


UB_CROSSED = torch.full((5, 2), 9.0, dtype=F64)
UB_CROSSED[3, 1] = -1.0
SIGMA_NEGATIVE = torch.ones(5, 12, dtype=F64)
SIGMA_NEGATIVE[2, 7] = -0.5


def decay(t, a, k):
    return a * torch.exp(-k * t)


CURVE_FIT_CASES = [
    ({"f": 3}, TypeError, "f must be callable"),
    ({"estimator": "chi2"}, ValueError, r"Unknown estimator='chi2'"),
    ({"absolute_sigma": "yes"}, TypeError, "absolute_sigma must be True or False"),
    ({"ydata": Y[0]}, ValueError, r"ydata must be 2-D \(B, m\)"),
    ({"ydata": Y.to(torch.complex128)}, ValueError, "ydata must be real"),
    ({"ydata": [["a"]]}, TypeError, "ydata must be an array of numbers"),
    ({"p0": torch.ones(3, 2)}, ValueError, r"p0 must be \(n,\) or \(B, n\) = \(5, 2\)"),
    ({"p0": torch.ones(1, 1, 2)}, ValueError, r"p0 must be \(n,\) or \(B, n\) with n > 0"),
    ({"f": lambda t: t, "p0": None}, ValueError, "takes no parameters after x"),
    ({"bounds": (0.0,)}, ValueError, r"bounds must be a pair \(lb, ub\)"),
    ({"bounds": (1.0, 1.0)}, ValueError, "strictly less than each upper bound"),
    (
        {"bounds": (0.0, UB_CROSSED)},
        ValueError,
        r"bounds lb=0.0 >= ub=-1.0 for parameter 1 of fit 3",
    ),
    ({"bounds": ([0.0, 0.0, 0.0], 9.0)}, ValueError, r"bounds lb must be a scalar, \(2,\)"),
    ({"bounds": (0.0, [9.0, math.nan])}, ValueError, "bounds ub contains NaN"),
    ({"bounds": (0.0, [9.0, 0.5])}, ValueError, "p0 is outside the bounds for fit 0"),
    (
        {"sigma": torch.ones(3)},
        ValueError,
        r"sigma must be standard deviations \(a scalar, \(12,\)",
    ),
    ({"sigma": -torch.eye(12)}, ValueError, "sigma as a covariance of ydata must be positive def"),
    ({"sigma": torch.ones(12, 12)}, ValueError, "must be positive definite"),
    ({"sigma": torch.triu(torch.ones(12, 12))}, ValueError, "must be symmetric"),
    (
        {
            "sigma": torch.eye(12).expand(5, 12, 12)
            * torch.tensor([1.0, 1, -1, 1, 1])[:, None, None]
        },
        ValueError,
        r"must be positive definite \(fit 2\)",
    ),
    (
        {"sigma": 0.0},
        ValueError,
        r"sigma must be > 0 everywhere \(standard deviations of ydata\), got sigma=0.0",
    ),
    ({"sigma": SIGMA_NEGATIVE}, ValueError, r"got sigma\[2, 7\]=-0.5; .* pass the points' st"),
    ({"estimator": "mle", "sigma": 1.0}, ValueError, "sigma=1.0 with estimator='mle'"),
    ({"estimator": "mle", "loss": "huber"}, ValueError, "loss='huber' with estimator='mle'"),
    ({"loss": "l2"}, ValueError, r"Unknown loss='l2'; valid choices are"),
    ({"loss": lambda z: z}, TypeError, "loss must be one of"),
    ({"f_scale": 0.0}, ValueError, r"Invalid f_scale=0.0"),
    ({"ftol": -1.0}, ValueError, r"Invalid ftol=-1.0"),
    ({"ftol": None, "xtol": None, "gtol": None}, ValueError, "At least one of the tolerances"),
    ({"max_nfev": 0}, ValueError, r"Invalid max_nfev=0"),
    ({"check_every": 0}, ValueError, r"Invalid check_every=0"),
    ({"chunk_size": 0}, ValueError, r"Invalid chunk_size=0"),
    ({"memory_budget": -1}, ValueError, r"Invalid memory_budget=-1"),
    ({"progress": "yes"}, TypeError, "progress must be None, True/False or a callable"),
    ({"x_scale": "auto"}, ValueError, r"Invalid x_scale='auto'"),
    ({"x_scale": [1.0, -1.0]}, ValueError, r"Invalid x_scale=\[1.0, -1.0\]"),
    ({"x_scale": [1.0, 1.0, 1.0]}, ValueError, r"x_scale must be 'jac', a scalar, \(2,\)"),
    ({"dtype": torch.float16}, ValueError, r"Invalid dtype=torch.float16"),
    ({"device": "nowhere"}, ValueError, r"Invalid device='nowhere'"),
    ({"xdata_per_fit": True}, ValueError, r"xdata_per_fit=True needs xdata of shape"),
    ({"xdata_per_fit": "yes"}, TypeError, "xdata_per_fit must be None, True or False"),
    ({"xdata": T.expand(5, 12)}, ValueError, r"xdata of shape \(5, 12\) with 5 fits .* two ways"),
    ({"jac": "2-point"}, TypeError, "jac must be None or a callable"),
    ({"p0": [1.0, 1.0, 1.0]}, ValueError, r"p0 has 3 parameters per fit but f takes 2 after x"),
    ({"device": "meta"}, ValueError, r"Invalid device='meta': a fit computes numbers"),
    ({"ydata": Y.to("meta")}, ValueError, "The data are on 'meta': a fit computes numbers"),
    (
        {"f": lambda t, a, k: (a * t).double(), "ydata": Y.float()},
        TypeError,
        r"f must return a tensor of the fits' dtype torch.float32, got torch.float64",
    ),
    (
        {"f": lambda t, a, k: (a * torch.exp(-k * t)).float()},
        TypeError,
        r"f must return a tensor of the fits' dtype torch.float64, got torch.float32",
    ),
    (
        {"f": lambda t, a, k: torch.ones(5, 12, dtype=torch.int64)},
        TypeError,
        r"f must return a tensor of the fits' dtype torch.float64, got torch.int64",
    ),
    ({"f": lambda t, a, k: np.ones(12)}, TypeError, "f must return a tensor"),
    (
        {"f": lambda t, a, k: (a * t).to("meta")},
        ValueError,
        r"f must return a tensor on the fits' device cpu, got one on meta: make its const",
    ),
    (
        {"jac": lambda t, a, k: torch.zeros(5, 12, 2, dtype=F64, device="meta")},
        ValueError,
        r"jac must return a tensor on the fits' device cpu, got one on meta",
    ),
    ({"f": lambda t, a, k: a * t[:4]}, ValueError, r"f returned shape \(5, 4\) for 5 fits"),
    ({"jac": lambda t, a, k: torch.ones(5, 12)}, ValueError, r"jac must return a tensor of shape"),
]


@pytest.mark.parametrize(("change", "error", "match"), CURVE_FIT_CASES)
def test_curve_fit_batch_refuses(change, error, match):
    call = {"f": decay, "xdata": T, "ydata": Y, "p0": [1.0, 1.0], **change}
    with pytest.raises(error, match=match):
        so.curve_fit_batch(**call)


def _fun(x, rows):
    return x[:, :1] * torch.exp(-x[:, 1:] * T) - rows


X0 = torch.ones(5, 2, dtype=F64)

LEAST_SQUARES_CASES = [
    ({"fun": None}, TypeError, "fun must be callable"),
    ({"x0": torch.ones(2)}, ValueError, r"x0 must be 2-D \(B, n\)"),
    ({"args": Y}, TypeError, "args must be a tuple of per-fit tensors"),
    ({"args": (Y[:3],)}, ValueError, r"args\[0\] must be a tensor with one row per fit"),
    ({"kwargs": [1]}, TypeError, "kwargs must be a dict of shared keyword arguments"),
    ({"jac": 1}, TypeError, "jac must be None or a callable"),
    ({"fun": lambda x, rows: rows[:, 0]}, ValueError, r"fun must return \(B, m\) residuals"),
    ({"fun": lambda x, rows: [1.0]}, TypeError, "fun must return a tensor"),
    (
        {"fun": lambda x, rows: _fun(x, rows).to("meta")},
        ValueError,
        r"fun must return a tensor on the fits' device cpu, got one on meta",
    ),
    (
        {"jac": lambda x, rows: torch.zeros(5, 12, 2, dtype=F64, device="meta")},
        ValueError,
        r"jac must return a tensor on the fits' device cpu, got one on meta",
    ),
    ({"loss": "l1"}, ValueError, r"Unknown loss='l1'"),
    ({"bounds": (2.0, 3.0)}, ValueError, r"x0 is outside the bounds for fit 0: x0=\[1.0, 1.0\]"),
    ({"x0": X0.half()}, ValueError, r"dtype torch.float16 is not supported: pass x0 as float32"),
    # Checked before fun is called: this fun would fail otherwise.
    ({"fun": lambda x, rows: 1 / 0, "ftol": -1.0}, ValueError, r"Invalid ftol=-1.0"),
    ({"fun": lambda x, rows: 1 / 0, "compile": 1}, TypeError, "compile must be True or False"),
    ({"fun": lambda x, rows: 1 / 0, "bounds": (2.0, 3.0)}, ValueError, "x0 is outside the bounds"),
    ({"fun": lambda x, rows: 1 / 0, "x_scale": -1.0}, ValueError, r"Invalid x_scale=-1.0"),
]


@pytest.mark.parametrize(("change", "error", "match"), LEAST_SQUARES_CASES)
def test_least_squares_batch_refuses(change, error, match):
    call = {"fun": _fun, "x0": X0, "args": (Y,), **change}
    with pytest.raises(error, match=match):
        so.least_squares_batch(**call)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a build or machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Invalid device='cuda:7': torch sees no CUDA device"):
        so.curve_fit_batch(decay, T, Y, p0=[1.0, 1.0], device="cuda:7")


def test_bounds_as_one_array_of_lower_and_upper_rows_as_scipy_takes_them():
    pair = so.curve_fit_batch(decay, T, Y, p0=[1.0, 1.0], bounds=([0.0, 0.0], [9.0, 9.0]))
    for arr in (np.array([[0.0, 0.0], [9.0, 9.0]]), torch.tensor([[0.0, 0.0], [9.0, 9.0]])):
        one = so.curve_fit_batch(decay, T, Y, p0=[1.0, 1.0], bounds=arr)
        assert torch.equal(one[0], pair[0])


def test_the_valid_call_of_these_cases_runs():
    popt, _, info = so.curve_fit_batch(decay, T, Y, p0=[1.0, 1.0])
    torch.testing.assert_close(popt, torch.tensor([[2.0, 1.0]], dtype=F64).expand(5, 2))
    res = so.least_squares_batch(_fun, X0, args=(Y,))
    torch.testing.assert_close(res.x, popt)
    assert bool(info.success.all()) and bool(res.success.all())


def test_negative_counts_are_refused_with_the_fit_and_point():
    counts = torch.full((4, 12), 3.0, dtype=F64)
    counts[2, 7] = -1.0
    counts[3, 1] = -5.0
    with pytest.raises(ValueError, match=r"ydata\[2, 7\]=-1.0 with estimator='mle'"):
        so.curve_fit_batch(decay, T, counts, p0=[1.0, 1.0], estimator="mle")
    counts[2, 7], counts[3, 1] = math.nan, 3.0  # NaN is missing data: that fit fails alone
    _, _, info = so.curve_fit_batch(decay, T, counts, p0=[3.0, 0.0], estimator="mle")
    assert info.status.tolist()[2] == -1 and bool(info.success[[0, 1, 3]].all())


def test_the_deviance_of_a_negative_count_is_not_a_number():
    from secondorder.fitting.batch.problem import Objective

    mu = torch.full((2, 3), 2.0, dtype=F64)
    k = torch.tensor([[1.0, 0.0, 2.0], [1.0, -1.0, 2.0]], dtype=F64)
    cost = Objective("poisson").cost2(mu, k)
    assert math.isfinite(float(cost[0])) and float(cost[1]) == math.inf
