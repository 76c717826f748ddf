"""One object per decision: the fixed options, the "auto" objects above them, and their wiring.

References: the rules as the planner's docstring states them (closed forms on the
shape), a brute-force search for the slice bisection, and the optimizer's own
``jacobian``/``solver``/``form`` options for the wiring.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.lm.choices import AutoJacobian, ForcedJacobian
from secondorder.lm.planner import DIRECT_SOLVE_LIMIT, MemoryPlan, plan_memory
from secondorder.lm.planner.rules import (
    AutoForm,
    AutoSlice,
    AutoSolver,
    FixedForm,
    FixedSlice,
    FixedSolver,
    form_choice,
    slice_choice,
    solver_choice,
)
from secondorder.lm.stages import Stage, StepShape


def shape(n: int, m: int, samples: int = 10) -> StepShape:
    return StepShape(
        n=n,
        samples=samples,
        rows=m,
        rows_total=m,
        b=8,
        g=8,
        converts=False,
        jacobian="reverse",
        activations=0,
    )


@pytest.mark.parametrize(
    ("n", "m", "expected"),
    [
        # m < n: the dual form first, then the primal, then CG.
        (100, 10, [("cholesky", True), ("cholesky", False), ("cg", False)]),
        # m ≥ n: the primal form first.
        (10, 100, [("cholesky", False), ("cholesky", True), ("cg", False)]),
        # Too many residuals for the dual matrix: only the primal Cholesky and CG.
        (10, DIRECT_SOLVE_LIMIT + 1, [("cholesky", False), ("cg", False)]),
        # Too many parameters and residuals for either: CG alone.
        (DIRECT_SOLVE_LIMIT + 1, DIRECT_SOLVE_LIMIT + 2, [("cg", False)]),
    ],
)
def test_auto_solver_proposes_cholesky_by_size_then_cg(n, m, expected):
    assert AutoSolver().candidates(shape(n, m), AutoForm()) == expected


def test_auto_solver_keeps_a_fixed_form():
    # form="primal" forbids the switch to the dual form, even where m < n.
    assert AutoSolver().candidates(shape(100, 10), FixedForm(False)) == [
        ("cholesky", False),
        ("cg", False),
    ]


@pytest.mark.parametrize("name", ["cholesky", "eigh", "qr", "cg"])
def test_fixed_solver_is_its_only_candidate(name):
    dual = name != "cg"  # AutoForm: dual when m < n, except for CG
    assert FixedSolver(name).candidates(shape(100, 10), AutoForm()) == [(name, dual)]
    assert FixedSolver(name).candidates(shape(100, 10), FixedForm(True)) == [(name, True)]


def test_auto_slice_is_the_largest_good_slice():
    """The bisection equals a search over every slice size, for monotone costs."""
    base = plan_memory(parameters=3, samples=1, rows=1)
    for samples in (1, 2, 7, 64, 100):
        for limit in range(1, samples + 2):
            for budget in (None, 30, 1000):

                def build(s: int, limit: int = limit) -> MemoryPlan:
                    return _with(base, s, fits=s <= limit, slice_bytes=10 * s)

                good = [
                    s
                    for s in range(1, samples + 1)
                    if s <= limit and (budget is None or 10 * s <= budget or s == 1)
                ]
                expected = max(good) if good else 1
                assert AutoSlice(budget).choose(samples, build) == expected


def _with(plan: MemoryPlan, s: int, *, fits: bool, slice_bytes: int) -> MemoryPlan:
    stages = (Stage("jacobian slice", slice_bytes, ""),)
    return replace(plan, slice_size=s, fits=fits, stages=stages)


def test_fixed_slice_is_at_most_the_batch_and_ignores_devices():
    assert FixedSlice(8).choose(5, lambda s: pytest.fail("priced")) == 5
    assert FixedSlice(3).choose(5, lambda s: pytest.fail("priced")) == 3
    assert FixedSlice(3).spread(3, 100, 4) == 3


def test_auto_slice_gives_every_device_a_slice():
    assert AutoSlice(None).spread(100, 10, 4) == 3  # ceil(10 / 4)
    assert AutoSlice(None).spread(2, 10, 4) == 2
    assert AutoSlice(None).spread(100, 10, 1) == 100


def test_unknown_options_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"Unknown solver='lu'; valid choices are \('auto'"):
        solver_choice("lu")
    with pytest.raises(ValueError, match=r"Unknown form='both'; valid choices are \('auto'"):
        form_choice("both")
    assert isinstance(slice_choice(None, 1 << 20), AutoSlice)
    assert slice_choice(4, 1 << 20) == FixedSlice(4)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def test_the_optimizer_wires_one_object_per_decision():
    x = torch.randn(12, 2, dtype=torch.float64)
    y = torch.randn(12, 1, dtype=torch.float64)
    auto = so.LevenbergMarquardt(_model())
    forced = so.LevenbergMarquardt(_model(), jacobian="forward", solver="qr", form="primal")
    assert isinstance(auto._choices.jacobian, AutoJacobian)
    assert isinstance(forced._choices.jacobian, ForcedJacobian)
    auto.step(x, y)
    forced.step(x, y)
    # "auto" remembers its choice per input signature; a forced strategy has none.
    assert list(auto._choices.auto_cache.values()) == ["reverse"]
    assert forced._choices.auto_cache == {}
    plan = forced.plan(x, y)
    assert (plan.jacobian, plan.solver, plan.form) == ("forward", "qr", "primal")
    # 12 residuals < 17 parameters: auto takes the dual form with Cholesky.
    plan = auto.plan(x, y)
    assert (plan.jacobian, plan.solver, plan.form) == ("reverse", "cholesky", "dual")


def test_auto_cache_survives_a_checkpoint_through_the_jacobian_choice():
    x = torch.randn(12, 2, dtype=torch.float64)
    y = torch.randn(12, 1, dtype=torch.float64)
    opt = so.LevenbergMarquardt(_model())
    opt.step(x, y)
    again = so.LevenbergMarquardt(_model())
    again.load_state_dict(opt.state_dict())
    assert again._choices.auto_cache == opt._choices.auto_cache
    assert again._choices.jacobian.cache is again._choices.auto_cache
