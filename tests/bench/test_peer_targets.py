"""The bench's peer-targets summary: each target's ratio from the run's own comparisons."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from benchmarks import bench, lm_methods
from benchmarks.core import Method, Problem, Stepper, StepReport, batches, torch_optimizer


def _result(name: str, step_s: float, curve: list[tuple[float, float]]) -> bench.MethodResult:
    r = bench.MethodResult(name, "test")
    r.step_seconds = [step_s, step_s]
    for k, (t, loss) in enumerate(curve):
        r.add(k, t, loss, None)
    return r


def test_peer_targets_rows_come_from_the_defaults_against_the_peer() -> None:
    problems = bench.build_problems(tiny=True, keys=["sinc", "wide_dual"])
    ours = _result("secondorder LM (defaults)", 0.1, [(0.0, 1.0), (2.5, 1e-7)])
    fast = _result("secondorder LM (fastest)", 0.01, [(0.0, 1.0), (0.5, 1e-7)])
    tlm = _result("torch-levenberg-marquardt 1.2.3", 0.3, [(0.0, 1.0), (20.0, 5e-6)])
    sinc = bench.ProblemResult(problems["sinc"], [ours, fast, tlm], [])
    ours_w = _result("secondorder LM (defaults)", 0.2, [(0.0, 2.0)])
    tlm_w = _result("torch-levenberg-marquardt 1.2.3", 0.1, [(0.0, 2.0)])
    wide = bench.ProblemResult(problems["wide_dual"], [ours_w, tlm_w], [])
    rows = {(r["problem"], r["measure"]): r for r in lm_methods.peer_targets([sinc, wide])}
    step = rows[("sinc", "step_speedup_vs_tlm")]
    assert step["value"] == pytest.approx(3.0) and step["met"] is True  # the fastest is ignored
    to_target = rows[("sinc", "time_to_target_s")]
    assert to_target["value"] == pytest.approx(2.5) and to_target["met"] is True
    dual = rows[("wide_dual", "step_speedup_vs_tlm")]
    assert dual["value"] == pytest.approx(0.5) and dual["met"] is False
    cnn = rows[("digits_cnn", "step_speedup_vs_tlm")]
    assert cnn["value"] is None and cnn["met"] is None and not cnn["ran"]
    text = "\n".join(lm_methods.peer_targets_lines([sinc, wide]))
    assert "| sinc | peer s/step over ours (methods table) | 3.00 | >= 2.5 | yes |" in text
    assert "| wide_dual | peer s/step over ours (methods table) | 0.50 | >= 1.5 | no |" in text
    assert "| digits_cnn | peer s/step over ours (methods table) | not run | >= 1.5 | - |" in text
    assert "torch threads, load average" in text and " UTC on " in text
    # A problem that ran but missed the target, or ran without the peer.
    never = _result("secondorder LM (defaults)", 0.1, [(0.0, 1.0), (1.0, 1e-3)])
    missed = bench.ProblemResult(problems["sinc"], [never], [])
    text = "\n".join(lm_methods.peer_targets_lines([missed]))
    assert "| sinc | time to the target (s) | not reached | <= 3 | - |" in text
    assert "| sinc | peer s/step over ours (methods table) | peer not run | >= 2.5 | - |" in text
    assert "| sinc | peer s/step over ours (side by side) | peer not run | >= 2.5 | - |" in text
    # In the whole report, after the problems.
    assert "## Targets: secondorder LM (defaults)" in bench.markdown([sinc, wide], "# t")


def test_peer_targets_summary_is_left_out_when_nothing_it_needs_ran() -> None:
    problems = bench.build_problems(tiny=True, keys=["digits_mlp"])
    pr = bench.ProblemResult(
        problems["digits_mlp"], [_result("secondorder LM (defaults)", 0.1, [(0.0, 1.0)])], []
    )
    assert lm_methods.peer_targets_lines([pr]) == []
    assert all(r["value"] is None for r in lm_methods.peer_targets([pr]))


def test_peer_targets_side_by_side_rows_read_the_alternating_run() -> None:
    problems = bench.build_problems(tiny=True, keys=["wide_dual"])
    ours = _result("secondorder LM (defaults)", 0.2, [(0.0, 2.0)])
    tlm = _result("torch-levenberg-marquardt 1.2.3", 0.1, [(0.0, 2.0)])
    both = {"steps": 4, "ours_s": 0.01, "peer_s": 0.016, "speedup": 1.6}
    wide = bench.ProblemResult(problems["wide_dual"], [ours, tlm], [])
    wide.sections["side_by_side"] = both
    rows = {(r["problem"], r["measure"]): r for r in lm_methods.peer_targets([wide])}
    assert rows[("wide_dual", "step_speedup_vs_tlm")]["met"] is False  # 0.5 in the table
    side = rows[("wide_dual", "step_speedup_side_by_side")]
    assert side["value"] == pytest.approx(1.6) and side["met"] is True
    text = "\n".join(lm_methods.peer_targets_lines([wide]))
    assert "| wide_dual | peer s/step over ours (side by side) | 1.60 | >= 1.5 | yes |" in text
    assert "1.60x" in "\n".join(lm_methods.side_by_side_lines(wide))


def _recorded(tag: str, make: object, calls: list[tuple[str, Tensor]]) -> object:
    def wrapped(problem: Problem, model: nn.Module) -> Stepper:
        inner = make(problem, model)  # type: ignore[operator]

        def step(x: Tensor, y: Tensor) -> StepReport:
            calls.append((tag, x))
            return inner(x, y)  # type: ignore[no-any-return]

        return step

    return wrapped


def test_side_by_side_alternates_the_two_on_the_same_batches() -> None:
    """Both optimizers see the bench's batch sequence, one step each in turn, the
    first mover alternating; the ratio is the medians' quotient."""
    problem = bench.build_problems(tiny=True, keys=["wide_dual"])["wide_dual"]
    calls: list[tuple[str, Tensor]] = []
    lm = lm_methods.lm_method("secondorder LM (defaults)", {})
    ours = Method(name=lm.name, family="secondorder LM", make=_recorded("ours", lm.make, calls))
    sgd = torch_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
    peer = Method(
        name="torch-levenberg-marquardt (stand-in)",
        family="peer",
        make=_recorded("peer", sgd, calls),
    )
    steps = 5
    out = lm_methods.side_by_side(problem, [ours, peer], steps=steps)
    assert out is not None and out["steps"] == min(steps, problem.max_steps)
    n = out["steps"]
    assert out["speedup"] == pytest.approx(out["peer_s"] / out["ours_s"])
    assert len(calls) == 2 * n
    expected = [b for epoch in range(n) for b in batches(problem, epoch)][:n]
    for k in range(n):
        first, second = calls[2 * k], calls[2 * k + 1]
        assert (first[0], second[0]) == (("ours", "peer") if k % 2 == 0 else ("peer", "ours"))
        assert first[1] is second[1] and torch.equal(first[1], expected[k][0])
    # Either method missing, or another problem: nothing measured.
    assert lm_methods.side_by_side(problem, [ours], steps=steps) is None
    digits = bench.build_problems(tiny=True, keys=["digits_mlp"])["digits_mlp"]
    assert lm_methods.side_by_side(digits, [ours, peer], steps=steps) is None
