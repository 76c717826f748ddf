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
