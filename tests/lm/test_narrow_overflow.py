"""Two clear outcomes where torch would give a raw one: meta parameters, float32 overflow."""

from __future__ import annotations

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
    assert info.reason.startswith("non-finite residuals or Jacobian")
    assert "overflowed float32" in info.reason and "model.double()" in info.reason
    # The loss is measured in float64, so it is finite and equals the float64 value.
    w, b = (p.detach().double() for p in model.parameters())
    r64 = x.double() @ w.T + b - y.double()
    assert info.loss == pytest.approx(float((r64**2).mean()), rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    # In float64 the same problem steps.
    opt64 = so.LevenbergMarquardt(model.double())
    assert opt64.step(x.double(), y.double()).accepted


def test_non_finite_residuals_keep_their_own_reason() -> None:
    model = torch.nn.Linear(2, 1)
    x, y = torch.randn(16, 2), torch.randn(16, 1)
    y[3] = float("nan")
    info = so.LevenbergMarquardt(model).step(x, y)
    assert not info.accepted and info.reason.startswith("non-finite residuals")
    assert "overflowed" not in info.reason
