"""curve_fit on NumPy data: the model and jac see NumPy's meanings, as in scipy."""

from __future__ import annotations

import numpy as np
import pytest

from secondorder.fitting import curve_fit

scipy_optimize = pytest.importorskip("scipy.optimize")


def _repeat(x, a, b):
    return a * x.repeat(2) + b  # NumPy repeats each element; torch would tile


def _standardised(x, a, b):
    return a * (x - x.mean()) / x.std() + b  # NumPy divides by n; torch by n - 1


@pytest.mark.parametrize(
    ("f", "x", "y"),
    [
        (_repeat, np.linspace(0, 1, 10), np.repeat(np.linspace(0, 1, 10), 2) * 2 + 1),
        (
            _standardised,
            np.linspace(0, 1, 20),
            3 * np.linspace(0, 1, 20) + 1 + 0.01 * np.sin(7 * np.linspace(0, 1, 20)),
        ),
    ],
)
def test_a_model_with_other_meanings_on_tensors_keeps_numpys(f, x, y):
    ref, ref_cov = scipy_optimize.curve_fit(f, x, y)
    popt, pcov = curve_fit(f, x, y)
    np.testing.assert_allclose(popt, ref, rtol=1e-6)
    np.testing.assert_allclose(pcov, ref_cov, rtol=1e-4, atol=1e-12)


def test_a_numpy_jac_gets_numpy_arrays():
    x = np.linspace(0, 1, 20)
    y = 3 * x + 1 + 0.01 * np.cos(5 * x)
    seen = []

    def jac(x, a, b):
        seen.append(type(x))
        J = np.empty((x.size, 2))
        J[:, 0], J[:, 1] = x, 1.0
        return J

    ref, _ = scipy_optimize.curve_fit(lambda x, a, b: a * x + b, x, y, jac=jac)
    popt, _ = curve_fit(lambda x, a, b: a * x + b, x, y, jac=jac)
    np.testing.assert_allclose(popt, ref, rtol=1e-8)
    assert set(seen) == {np.ndarray}
