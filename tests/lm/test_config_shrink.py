"""``LMConfig.damping_shrink``: validated, and the optimizer's λ follows it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.lm.checkpoint import entries, saved_settings
from secondorder.lm.config import LMConfig
from secondorder.lm.damping import NielsenRule


@pytest.mark.parametrize("bad", [1.0, 0.0, -2.0, math.nan, math.inf, True, "10"])
def test_bad_value_names_the_field_the_value_and_the_range(bad: object) -> None:
    with pytest.raises(ValueError, match=r"Invalid damping_shrink=.*must be a finite number > 1"):
        LMConfig(damping_shrink=bad)  # type: ignore[arg-type]


def test_other_rules_refuse_it_and_name_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"Invalid damping_shrink=10.0 with damping_rule='multiplicative'.*"
        r"use damping_rule='nielsen', or damping_down",
    ):
        LMConfig(damping_rule="multiplicative", damping_shrink=10.0)
    assert LMConfig(damping_rule="multiplicative").damping_shrink == 3.0


def _linear_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.3
    torch.manual_seed(0)
    return nn.Linear(3, 1).double(), x, y


@pytest.mark.parametrize("shrink", [3.0, 10.0])
def test_a_linear_fit_lowers_lambda_by_shrink(shrink: float) -> None:
    """A linear model's LM model is exact: ρ = 1, so λ falls by exactly ``shrink``.

    The step itself is checked against the damped normal equations solved by
    ``torch.linalg.solve`` with ``D = diag(JᵀJ)``.
    """
    model, x, y = _linear_problem()
    opt = so.LevenbergMarquardt(model, damping=1e-2, damping_shrink=shrink)
    assert isinstance(opt._rule, NielsenRule) and opt._rule.shrink == shrink
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    info = opt.step(x, y)
    assert info.accepted
    assert info.gain_ratio == pytest.approx(1.0, abs=1e-9)
    assert info.damping == pytest.approx(1e-2 / shrink, rel=1e-9)
    J = torch.cat([x, torch.ones(40, 1, dtype=torch.float64)], dim=1)
    r = J @ torch.cat([w0.reshape(-1), b0]) - y.reshape(-1)
    A = J.T @ J
    delta = torch.linalg.solve(A + 1e-2 * torch.diag(A.diagonal()), -J.T @ r)
    step = torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])
    torch.testing.assert_close(step - torch.cat([w0.reshape(-1), b0]), delta)


def test_checkpoints_carry_it_and_the_default_is_not_written() -> None:
    model, x, y = _linear_problem()
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    assert "damping_shrink" not in entries(opt.state_dict())["config"]
    assert saved_settings(opt.state_dict())["damping_shrink"] == 3.0
    custom = so.LevenbergMarquardt(model, damping_shrink=10.0)
    custom.step(x, y)
    saved = custom.state_dict()
    assert saved_settings(saved)["damping_shrink"] == 10.0
    with pytest.raises(ValueError, match=r"damping_shrink=10.0 in the checkpoint, 3.0 here"):
        opt.load_state_dict(saved)
