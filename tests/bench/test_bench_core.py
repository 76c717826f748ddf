"""The family-agnostic benchmark core on a toy problem, with torch.optim as the reference.

No timings are asserted: the runner's curve and final weights are compared with a
hand-written torch.optim.SGD loop over the same batches, and time/steps to the target
with a curve whose answer is known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from benchmarks import core
from benchmarks.core import (
    Closing,
    Column,
    Family,
    Method,
    MethodResult,
    Problem,
    ProblemResult,
    Section,
    StepReport,
)


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _data(n: int = 24) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3


def _problem(**kw: Any) -> Problem:
    args: dict[str, Any] = dict(
        key="toy",
        title="linear regression, 3 inputs",
        kind="regression",
        train=_data(),
        make_model=_linear,
        loss=nn.functional.mse_loss,
        batch_size=8,
        target=1e-2,
        max_steps=10,
        budget_s=1e9,  # never the reason to stop here
        eval_every=2,
    )
    args.update(kw)
    return Problem(**args)


def _sgd(lr: float = 0.1) -> Method:
    return Method(
        name=f"torch.optim.SGD (lr {lr:g})",
        family="first-order",
        settings=f"lr={lr:g}",
        make=core.torch_optimizer(lambda ps: torch.optim.SGD(ps, lr=lr)),
    )


def test_sgd_through_the_runner_equals_a_plain_torch_optim_loop() -> None:
    problem = _problem()
    (result,) = core.run_problem(problem, [_sgd()], log=lambda s: None).methods
    # Reference: torch.optim.SGD by hand over the same batches (3 per epoch, reshuffled
    # per epoch with the runner's seeds).
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def full_loss() -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(problem.train[0]), problem.train[1]))

    losses = [full_loss()]
    steps = 0
    for epoch in range(4):
        for xb, yb in core.batches(problem, epoch):
            if steps == 10:
                break
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            steps += 1
            if steps % 2 == 0:
                losses.append(full_loss())
    assert result.final_state is not None
    for k, v in model.state_dict().items():
        assert torch.equal(result.final_state[k], v), k
    assert result.steps == [0, 2, 4, 6, 8, 10]
    assert result.losses == losses
    assert len(result.seconds) == len(result.steps) and result.seconds == sorted(result.seconds)
    assert len(result.step_seconds) == 10 and result.status == "ok"
    assert result.family == "first-order" and result.accuracies == []
    assert result.losses[-1] < result.losses[0]


def test_time_and_steps_to_target_come_from_the_first_point_that_meets_it() -> None:
    r = MethodResult("m", "s")
    for step, t, loss, acc in [(0, 0.0, 1.0, 0.1), (5, 0.5, 0.2, 0.6), (9, 0.9, 0.05, 0.9)]:
        r.add(step, t, loss, acc)
    assert r.time_to(0.2, "regression") == 0.5 and r.steps_to(0.2, "regression") == 5
    assert r.time_to(0.1, "regression") == 0.9 and r.steps_to(0.1, "regression") == 9
    assert r.time_to(0.85, "classification") == 0.9
    assert r.steps_to(0.6, "classification") == 5
    assert math.isnan(r.time_to(0.01, "regression")) and r.steps_to(0.01, "regression") is None
    s = r.summary(0.1, "regression")
    assert (s["time_to_target_s"], s["steps_to_target"], s["reached_target"]) == (0.9, 9, True)
    s = r.summary(0.99, "classification")
    assert (s["time_to_target_s"], s["steps_to_target"], s["reached_target"]) == (None, None, False)
    assert s["final_loss"] == 0.05 and s["final_accuracy"] == 0.9


def _scripted(stop_at: int) -> Method:
    """A stepper that changes nothing, reports stop from step ``stop_at`` on, and says
    what it resolved on its first step."""

    def make(problem: Problem, model: nn.Module) -> core.Stepper:
        calls = [0]

        def step(x: Tensor, y: Tensor) -> StepReport:
            calls[0] += 1
            return StepReport(
                float(calls[0]), calls[0] >= stop_at, {"inner": 2.0 * calls[0]}, "chose: x"
            )

        return step

    return Method(name="scripted", family="toy", make=make)


def test_a_full_batch_run_stops_when_the_method_says_so_a_mini_batch_run_does_not() -> None:
    full = core.run_method(_problem(batch_size=None), _scripted(stop_at=3))
    assert full.steps == [0, 2, 3] and full.reported_loss == 3.0
    assert full.stages == {"inner": [2.0, 4.0, 6.0]}
    assert full.settings == "defaults (chose: x)"  # resolved is appended once
    mini = core.run_method(_problem(), _scripted(stop_at=3))
    assert mini.steps[-1] == 10 and len(mini.stages["inner"]) == 10


def test_zero_budget_runs_no_step_and_says_time_cap() -> None:
    r = core.run_method(_problem(budget_s=0.0), _sgd())
    assert r.steps == [0] and r.step_seconds == [] and r.status == "time cap"
    assert math.isnan(r.median_step)


def test_skipped_and_self_driven_methods() -> None:
    skipped = core.run_method(_problem(), Method(name="peer", family="p", skipped="not installed"))
    assert (skipped.status, skipped.note, skipped.steps) == ("skipped", "not installed", [])

    def run(problem: Problem, result: MethodResult) -> None:
        result.add(0, 0.0, 1.0, None)
        result.add(4, 0.25, 1e-3, None)
        result.step_seconds += [0.1, 0.1]

    r = core.run_method(_problem(), Method(name="own loop", family="p", run=run))
    assert r.steps == [0, 4] and r.time_to(1e-2, "regression") == 0.25


def test_bad_problems_and_methods_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Problem 'toy': kind='ranking' is not one of"):
        _problem(kind="ranking")
    with pytest.raises(ValueError, match=r"Problem 'toy': a classification problem needs test="):
        _problem(kind="classification")
    with pytest.raises(ValueError, match=r"Method 'm': give exactly one of make= .* and run="):
        Method(name="m", family="f")
    with pytest.raises(ValueError, match=r"Method 'm': give exactly one of make="):
        Method(name="m", family="f", make=_sgd().make, run=lambda p, r: None)


def test_classification_curve_has_the_test_accuracy() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 3, generator=g)
    y = (x[:, 0] > 0).long()

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(3, 2)

    problem = _problem(
        kind="classification",
        train=(x[:32], y[:32]),
        test=(x[32:], y[32:]),
        make_model=make_model,
        loss=nn.functional.cross_entropy,
        target=0.75,
    )
    r = core.run_method(problem, _sgd(0.5))
    model = make_model()
    assert r.final_state is not None
    model.load_state_dict(r.final_state)
    with torch.no_grad():
        acc = float((model(x[32:]).argmax(1) == y[32:]).double().mean())
    assert r.accuracies[-1] == acc and len(r.accuracies) == len(r.losses)


def _toy_family() -> Family:
    def measure(
        problem: Problem, methods: Sequence[Method], results: Sequence[MethodResult]
    ) -> int:
        return sum(len(r.step_seconds) for r in results)

    return Family(
        name="toy",
        problems={"toy": lambda mode: _problem()},
        methods={"sgd": lambda p: [_sgd()]},
        columns=(Column("steps run", lambda r: str(len(r.step_seconds))),),
        sections=(
            Section(
                key="total_steps",
                measure=measure,
                summary=lambda pr: {"total_steps": pr.sections["total_steps"]},
                markdown=lambda pr: [f"toy section: {pr.sections['total_steps']} steps", ""],
            ),
        ),
        closings=(Closing("problem_count", len, lambda rs: [f"## {len(rs)} problem(s)", ""]),),
    )


def test_a_family_adds_columns_sections_and_closings(tmp_path: Path) -> None:
    fam = _toy_family()
    problem = fam.problems["toy"]("tiny")
    methods = fam.methods["sgd"](problem)
    pr = core.run_problem(problem, methods, fam.sections, log=lambda s: None)
    assert pr.sections == {"total_steps": 10}
    record = pr.summary(fam.sections)
    assert record["total_steps"] == 10 and record["target_metric"] == "MSE"
    assert [m["name"] for m in record["methods"]] == ["torch.optim.SGD (lr 0.1)"]
    report = core.markdown([pr], "# toy", [fam])
    lines = report.splitlines()
    header = next(line for line in lines if line.startswith("| method |"))
    assert header.endswith("| final loss | steps run | status |")
    row = next(line for line in lines if line.startswith("| torch.optim.SGD"))
    assert row.endswith("| 10 | ok |")
    assert "toy section: 10 steps" in report and report.rstrip().endswith("## 1 problem(s)")
    assert core.plot(pr, tmp_path / "toy.png") and (tmp_path / "toy.png").stat().st_size > 0
    assert core.plot(pr, tmp_path / "steps.png", x="steps")
    assert (tmp_path / "steps.png").stat().st_size > 0
    bad_x = r"Unknown x='epochs'; valid choices are \('time', 'steps'\)"
    with pytest.raises(ValueError, match=bad_x):
        core.plot(pr, tmp_path / "bad.png", x="epochs")


def test_finite_or_none_spells_nan_and_inf_as_null() -> None:
    data = {"a": [1.0, math.nan], "b": (math.inf, 2), "c": "x"}
    assert core.finite_or_none(data) == {"a": [1.0, None], "b": [None, 2], "c": "x"}


def test_the_pre_split_problem_result_keeps_its_shape() -> None:
    from benchmarks import bench

    pr = bench.ProblemResult(_problem(), [], [{"config": "c"}])
    assert isinstance(pr, ProblemResult) and pr.sections == {"floor": [{"config": "c"}]}
    assert pr.comparisons() == []
