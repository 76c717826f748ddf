"""scipy's own tests of ``least_squares`` and ``curve_fit``, run against secondorder's.

The tests are scipy's (``scipy/optimize/tests/test_least_squares.py`` and
``test_minpack.py``, shipped in scipy's wheel), imported unchanged: the fixture below
swaps the module globals ``least_squares`` and ``curve_fit`` of those modules for
secondorder's, and the classes here inherit scipy's test methods.  Reference: scipy
1.17.1.  ``TestDogbox`` repeats ``TestTRF`` with ``method="dogbox"``, which runs the
same iteration here, so it is behind ``@pytest.mark.slow`` with the other long tests.

Tests that do not apply (skipped with the reason), and why:

=====================================  =================================================
test                                   why it does not apply
=====================================  =================================================
``*::test_workers``                    ``workers`` is refused: ``fun`` is called serially
``*::test_linear_operator``            a ``LinearOperator`` Jacobian is refused (the
                                       solvers need J's entries)
``*::test_solver_selection``,          a scipy.sparse Jacobian is made dense, so
``*::test_exact_tr_solver``            ``res.jac`` is dense and ``tr_solver="exact"``
                                       works with it (scipy refuses)
``*::test_fun_wrong_dimensions``       residuals of any shape are flattened (documented)
``*::test_full_result_single_fev``,    ``nfev`` counts every call of ``fun``, finite-
``*::test_nfev_options``,              difference columns included;
``*::test_numerical_jac``,             scipy 1.17 leaves them out, and ``max_nfev``
``*::test_bvp``                        budgets them the same way
``*::test_options``,                   assert ``x == 0`` to 1e-15 or bitwise on
``*::test_x_scale_options``,           ``fun_trivial``/``fun_2d_trivial``: scipy's "trf"
``*::test_bounds_shape``,              lands on 0 exactly because its first trust radius
``test_basic``                         ‖x0‖ clips the first step onto the minimiser; LM
                                       reaches 1e-5 (``fun_trivial``, J = 0 at the
                                       minimum) and 7e-26 (``fun_2d_trivial``)
``test_gh_18793_and_19351``            ``gtol`` is MINPACK's cosine test (documented),
                                       which never fires with one residual; xtol stops it
``TestCurveFit::test_pcov``            a parameter the model ignores gets an infinite
                                       variance alone; scipy's "lm"
                                       makes the whole ``pcov`` infinite
``TestCurveFit::test_gh13670``         one call of ``f`` with tensors decides whether it
                                       is torch; a NumPy ``f`` is then called again at
                                       ``p0``, which that test forbids
=====================================  =================================================

Known failures (``xfail(strict=True)``, so a fix is noticed):

=====================================  =================================================
``*::test_full_result``                ``fun_trivial`` takes 10 Jacobians (LM converges
                                       linearly where J = 0); scipy asserts < 10
``TestCurveFit::test_gh4555b``         pcov within 1.6e-6 of scipy's reference, against
                                       2e-7 (each stops at its own point, ftol 1e-8)
=====================================  =================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import secondorder as so

scipy = pytest.importorskip("scipy")
if tuple(int(v) for v in scipy.__version__.split(".")[:2]) < (1, 17):
    # The exclusions below were decided on 1.17's files; older files test what their
    # scipy did and carry other tests.
    pytest.skip(f"recorded against scipy 1.17, found {scipy.__version__}", allow_module_level=True)
tls = pytest.importorskip("scipy.optimize.tests.test_least_squares")
tmp = pytest.importorskip("scipy.optimize.tests.test_minpack")


@pytest.fixture(autouse=True)
def _ours(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """scipy's test modules call secondorder's functions for the duration of a test."""
    monkeypatch.setattr(tls, "least_squares", so.least_squares)
    monkeypatch.setattr(tmp, "curve_fit", so.curve_fit)
    yield


def _skip(reason: str) -> Callable[..., Any]:
    @pytest.mark.skip(reason=reason)
    def test(*args: Any) -> None:  # pragma: no cover - skipped
        raise AssertionError(reason)

    return test


def _marked(inherited: Callable[..., Any], *marks: Any) -> Any:
    """A new test calling scipy's ``inherited`` with its marks plus ``marks``.

    Marking scipy's function itself would mark it in every class sharing it.
    """

    def test(self: Any) -> None:
        inherited(self)

    test.__name__ = inherited.__name__
    test.__doc__ = inherited.__doc__
    test.pytestmark = list(getattr(inherited, "pytestmark", []))  # type: ignore[attr-defined]
    for mark in marks:
        test = mark(test)
    return test


def _xfail(inherited: Callable[..., Any], reason: str, *marks: Any) -> Any:
    return _marked(inherited, pytest.mark.xfail(strict=True, reason=reason), *marks)


def _slow(inherited: Callable[..., Any]) -> Any:
    return _marked(inherited, pytest.mark.slow)


WORKERS = "workers is refused: fun is called serially"
OPERATOR = "a LinearOperator Jacobian is refused (the solvers need J's entries)"
SPARSE = "a scipy.sparse Jacobian is made dense (res.jac dense, tr_solver='exact' works)"
FLATTEN = "residuals of any shape are flattened (documented)"
NFEV = "nfev counts finite-difference calls; scipy 1.17 leaves them out"
EXACT = "asserts x == 0 exactly on fun_trivial: only trf's first trust radius lands there"
COSINE = "gtol is MINPACK's cosine test, which never fires with one residual"
SLOW_LINEAR = "fun_trivial has J = 0 at its minimum: LM converges linearly (10 Jacobians)"


class _Common:
    """The exclusions shared by the three least_squares classes."""

    test_workers = _skip(WORKERS)
    test_fun_wrong_dimensions = _skip(FLATTEN)
    test_nfev_options = _skip(NFEV)
    test_full_result_single_fev = _skip(NFEV)
    test_x_scale_options = _skip(EXACT)


class _Trust(_Common):
    """The exclusions of scipy's trust-region classes (TRF and dogbox)."""

    test_linear_operator = _skip(OPERATOR)
    test_solver_selection = _skip(SPARSE)
    test_exact_tr_solver = _skip(SPARSE)
    test_numerical_jac = _skip(NFEV)
    test_bvp = _skip(NFEV)
    test_options = _skip(EXACT)
    test_bounds_shape = _skip(EXACT)


class TestTRF(_Trust, tls.TestTRF):
    test_full_result = _xfail(tls.TestTRF.test_full_result, SLOW_LINEAR)
    test_rosenbrock_bounds = _slow(tls.TestTRF.test_rosenbrock_bounds)
    test_with_bounds = _slow(tls.TestTRF.test_with_bounds)
    test_robustness = _slow(tls.TestTRF.test_robustness)
    test_rosenbrock = _slow(tls.TestTRF.test_rosenbrock)


@pytest.mark.slow
class TestDogbox(_Trust, tls.TestDogbox):
    test_full_result = _xfail(tls.TestDogbox.test_full_result, SLOW_LINEAR)


class TestLM(_Common, tls.TestLM):
    test_rosenbrock = _slow(tls.TestLM.test_rosenbrock)
    test_bvp = _slow(tls.TestLM.test_bvp)


class TestCurveFit(tmp.TestCurveFit):
    test_pcov = _skip("an ignored parameter gets infinite variance alone")
    test_gh13670 = _skip("one call with tensors decides torch or NumPy; then f is called at p0")
    test_gh4555b = _xfail(
        tmp.TestCurveFit.test_gh4555b, "pcov within 1.6e-6 of scipy's reference, vs 2e-7"
    )
    test_gh4555 = _slow(tmp.TestCurveFit.test_gh4555)


test_basic = _skip(EXACT + " (atol 1e-10)")


def test_callback() -> None:
    tls.test_callback()


def test_small_tolerances_for_lm() -> None:
    tls.test_small_tolerances_for_lm()


def test_fp32_gh12991() -> None:
    tls.test_fp32_gh12991()


test_gh_18793_and_19351 = _skip(COSINE)


def test_gh_19103() -> None:
    tls.test_gh_19103()
