"""Nielsen's rule with its largest decrease per accepted step as a parameter."""

from __future__ import annotations

import math

import pytest

from secondorder.lm.damping import (
    DampingState,
    NielsenRule,
    check_damping_shrink,
    make_damping_rule,
)

RHOS = (1e-4, 0.1, 0.25, 0.5, 0.6, 0.75, 0.87, 0.9, 0.99, 1.0, 1.3)


@pytest.mark.parametrize("shrink", [3.0, 10.0, 1.5])
@pytest.mark.parametrize("rho", RHOS)
def test_accept_follows_the_closed_form(shrink: float, rho: float) -> None:
    rule = NielsenRule(shrink)
    state = DampingState(damping=0.37, nu=16.0)
    rule.accept(state, rho)
    expected = 0.37 * max(1.0 / shrink, 1.0 - (2.0 * rho - 1.0) ** 3)
    assert state.damping == pytest.approx(expected, rel=1e-15)
    assert state.nu == 2.0


@pytest.mark.parametrize("rho", RHOS)
def test_default_is_nielsens_rule_bit_for_bit(rho: float) -> None:
    """The default keeps the old update exactly: ``max(1/3, 1 - (2ρ - 1)³)``."""
    state = DampingState(damping=1.234e-3)
    NielsenRule().accept(state, rho)
    assert state.damping == 1.234e-3 * max(1.0 / 3.0, 1.0 - (2.0 * rho - 1.0) ** 3)


def test_shrink_matters_only_where_the_model_predicts_well() -> None:
    """Below ρ ≈ 0.87 the cubic is above 1/3 and every ``shrink`` gives the same λ."""
    threshold = 0.5 * (1.0 + (2.0 / 3.0) ** (1.0 / 3.0))  # 1 - (2ρ - 1)³ = 1/3
    for rho in (0.3, 0.5, 0.8, threshold - 1e-6):
        a, b = DampingState(damping=1.0), DampingState(damping=1.0)
        NielsenRule(3.0).accept(a, rho)
        NielsenRule(100.0).accept(b, rho)
        assert a.damping == b.damping
    a, b = DampingState(damping=1.0), DampingState(damping=1.0)
    NielsenRule(3.0).accept(a, 1.0)
    NielsenRule(10.0).accept(b, 1.0)
    assert (a.damping, b.damping) == (pytest.approx(1 / 3), pytest.approx(0.1))


def test_reject_is_unchanged_by_shrink() -> None:
    state = DampingState(damping=2.0, nu=2.0)
    NielsenRule(10.0).reject(state)
    NielsenRule(10.0).reject(state)
    assert (state.damping, state.nu) == (16.0, 8.0)  # 2·2, then 4·4; ν 2 -> 4 -> 8


def test_make_damping_rule_passes_shrink() -> None:
    rule = make_damping_rule("nielsen", shrink=10.0)
    assert isinstance(rule, NielsenRule) and rule.shrink == 10.0
    assert make_damping_rule("nielsen").shrink == 3.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0, math.inf, math.nan, True, "3", None])
def test_bad_shrink_is_refused_with_its_name_and_value(bad: object) -> None:
    with pytest.raises(ValueError, match=r"Invalid damping_shrink=.*: must be a finite number > 1"):
        check_damping_shrink(bad)
    with pytest.raises(ValueError, match=r"Invalid damping_shrink="):
        NielsenRule(bad)  # type: ignore[arg-type]
