"""A ``fun`` that changes under least_squares is reported, never taken for convergence.

Two ways a user's function goes bad in the middle of a fit: its residuals become NaN
(an overflow inside ``fun``, a log of a negative number) everywhere near the current
point, or the number of residuals it returns changes.  Scipy runs out its evaluation
budget on the first and raises on the second; neither may end in ``success=True``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import secondorder as so

F64 = torch.float64


def _rosenbrock(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([10 * (x[1] - x[0] ** 2), 1 - x[0]])


def _nan_after(
    calls: int, base: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[..., torch.Tensor]:
    seen = [0]

    def fun(x: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        r = base(x)
        return r * float("nan") if seen[0] > calls else r

    return fun


@pytest.mark.parametrize("method", ["trf", "lm", "dogbox"])
def test_residuals_that_turn_nan_everywhere_are_not_convergence(method: str) -> None:
    # Before: success=True, status 3 ("`xtol` termination condition is satisfied"):
    # every trial was NaN, λ grew to its maximum and the vanishing step passed for xtol.
    res = so.least_squares(_nan_after(5, _rosenbrock), [-1.2, 1.0], method=method)
    assert not res.success
    assert res.status == -1
    assert "xtol" not in res.message
    assert pytest.approx(0) != res.cost  # not at the solution [1, 1]
    assert pytest.approx(1.0) != float(res.x[0])
    assert res.message.startswith("fun returned non-finite residuals at every trial point")
    # The reported point is the last one whose residuals were finite, and its cost theirs.
    x = torch.as_tensor(np.asarray(res.x), dtype=F64)
    assert torch.isfinite(torch.as_tensor(np.asarray(res.fun))).all()
    assert res.cost == pytest.approx(0.5 * float((_rosenbrock(x) ** 2).sum()), rel=1e-12)


def test_a_nan_region_the_fit_steps_around_still_converges() -> None:
    # Non-finite trials that are not the last word (a region the trust radius backs
    # out of) leave the fit free to converge: only λ at its maximum with a NaN trial fails.
    def fun(x: torch.Tensor) -> torch.Tensor:
        r = _rosenbrock(x)
        return r * float("nan") if bool(x[0] < -2.0) else r

    res = so.least_squares(fun, [-1.2, 1.0])
    assert res.success and res.status > 0
    np.testing.assert_allclose(np.asarray(res.x), [1.0, 1.0], atol=1e-6)


def _count_changes_after(calls: int) -> Callable[..., torch.Tensor]:
    seen = [0]

    def fun(x: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        r = torch.stack([10 * (x[1] - x[0] ** 2), 1 - x[0], 0.1 * x[0]])
        return r[:2] if seen[0] > calls else r

    return fun


@pytest.mark.parametrize("jac", ["auto", "2-point", "fwd"])
def test_a_residual_count_that_changes_is_refused(jac: str) -> None:
    # Before: success=True with "`gtol` termination condition is satisfied", the third
    # residual silently dropped from the fit.
    with pytest.raises(
        ValueError, match=r"fun returned 2 residuals at a point but 3 at (x0|another)"
    ):
        so.least_squares(_count_changes_after(3), [-1.2, 1.0], jac=jac)


def test_a_numpy_fun_whose_residual_count_changes_is_refused() -> None:
    seen = [0]

    def fun(x: np.ndarray) -> np.ndarray:
        seen[0] += 1
        r = np.array([10 * (x[1] - x[0] ** 2), 1 - x[0], 0.1 * x[0]])
        return r[:2] if seen[0] > 3 else r

    with pytest.raises(ValueError, match=r"fun returned 2 residuals at .* but 3 at"):
        so.least_squares(fun, np.array([-1.2, 1.0]))
