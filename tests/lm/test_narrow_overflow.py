"""Two clear outcomes where torch would give a raw one: meta parameters, float32 overflow."""

from __future__ import annotations

import re

import pytest
import torch

import secondorder as so


def test_meta_parameters_are_refused_at_construction() -> None:
    model = torch.nn.Linear(2, 1, device="meta")
    with pytest.raises(ValueError, match=r"parameters on the meta device.*weight.*to_empty"):
        so.LevenbergMarquardt(model)


def test_float32_overflow_of_the_products_is_named_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(64, 2) * 1e10
    y = torch.randn(64, 1) * 1e29  # r² and x·r are finite in float64, not in float32
    opt = so.LevenbergMarquardt(model)
    info = opt.step(x, y)
    assert not info.accepted
    # Before: "non-finite residuals or Jacobian at the current parameters (...)", which
    # they were not: J = x ≈ 1e10 and r ≈ 1e29 are finite float32, Jᵀr ≈ 1e40 is not.
    assert re.match(
        r"Jᵀr overflowed float32 at the current parameters, with finite residuals and "
        r"Jacobian: scale .* model\.double\(\); step rejected and damping raised$",
        info.reason,
    ), info.reason
    assert "non-finite" not in info.reason
    # The loss is measured in float64, so it is finite and equals the float64 value.
    w, b = (p.detach().double() for p in model.parameters())
    r64 = x.double() @ w.T + b - y.double()
    assert info.loss == pytest.approx(float((r64**2).mean()), rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    # In float64 the same problem steps.
    opt64 = so.LevenbergMarquardt(model.double())
    assert opt64.step(x.double(), y.double()).accepted


def test_a_float32_column_norm_overflow_beside_a_float64_gram_is_named() -> None:
    # J ≈ 1e20 is finite float32, and so are r and Jᵀr (r is tiny); diag(JᵀJ) ≈ 1e42
    # fits the float64 Gram but not float32, the dtype of the column norms.
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((64, 2), 1e20)
    y = model(x).detach() + 1e-25
    opt = so.LevenbergMarquardt(model, gram_dtype=torch.float64, solver="cholesky")
    info = opt.step(x, y)
    assert not info.accepted
    assert re.match(
        r"diag\(JᵀJ\) overflowed float32 at the current parameters, with finite "
        r"residuals and Jacobian",
        info.reason,
    ), info.reason
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_a_nan_jacobian_beside_finite_float32_residuals_is_named() -> None:
    # sqrt at 0 has an infinite derivative: r = 0·sqrt(w·x - w·x) is finite, J is not.
    class Root(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            return out + torch.sqrt(out - out.detach())

    torch.manual_seed(0)
    model = Root()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(64, 2), torch.randn(64, 1)
    info = so.LevenbergMarquardt(model, gram_dtype=torch.float64, solver="cholesky").step(x, y)
    assert not info.accepted
    assert re.match(
        r"non-finite Jacobian at the current parameters, with finite residuals", info.reason
    ), info.reason
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_non_finite_residuals_keep_their_own_reason() -> None:
    model = torch.nn.Linear(2, 1)
    x, y = torch.randn(16, 2), torch.randn(16, 1)
    y[3] = float("nan")
    info = so.LevenbergMarquardt(model).step(x, y)
    assert not info.accepted and info.reason.startswith("non-finite residuals")
    assert "overflowed" not in info.reason
