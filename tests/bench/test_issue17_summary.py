"""The bench's issue-17 summary: each target's ratio from the run's own comparisons."""

from __future__ import annotations

import pytest

from benchmarks import bench, lm_methods


def _result(name: str, step_s: float, curve: list[tuple[float, float]]) -> bench.MethodResult:
    r = bench.MethodResult(name, "test")
    r.step_seconds = [step_s, step_s]
    for k, (t, loss) in enumerate(curve):
        r.add(k, t, loss, None)
    return r


def test_issue17_rows_come_from_the_defaults_against_the_peer() -> None:
    problems = bench.build_problems(tiny=True, keys=["sinc", "wide_dual"])
    ours = _result("secondorder LM (defaults)", 0.1, [(0.0, 1.0), (2.5, 1e-7)])
    fast = _result("secondorder LM (fastest)", 0.01, [(0.0, 1.0), (0.5, 1e-7)])
    tlm = _result("torch-levenberg-marquardt 1.2.3", 0.3, [(0.0, 1.0), (20.0, 5e-6)])
    sinc = bench.ProblemResult(problems["sinc"], [ours, fast, tlm], [])
    ours_w = _result("secondorder LM (defaults)", 0.2, [(0.0, 2.0)])
    tlm_w = _result("torch-levenberg-marquardt 1.2.3", 0.1, [(0.0, 2.0)])
    wide = bench.ProblemResult(problems["wide_dual"], [ours_w, tlm_w], [])
    rows = {(r["problem"], r["measure"]): r for r in lm_methods.issue17([sinc, wide])}
    step = rows[("sinc", "step_speedup_vs_tlm")]
    assert step["value"] == pytest.approx(3.0) and step["met"] is True  # the fastest is ignored
    to_target = rows[("sinc", "time_to_target_s")]
    assert to_target["value"] == pytest.approx(2.5) and to_target["met"] is True
    dual = rows[("wide_dual", "step_speedup_vs_tlm")]
    assert dual["value"] == pytest.approx(0.5) and dual["met"] is False
    cnn = rows[("digits_cnn", "step_speedup_vs_tlm")]
    assert cnn["value"] is None and cnn["met"] is None and not cnn["ran"]
    text = "\n".join(lm_methods.issue17_lines([sinc, wide]))
    assert "| sinc | peer s/step over ours | 3.00 | >= 2.5 | yes |" in text
    assert "| wide_dual | peer s/step over ours | 0.50 | >= 1.5 | no |" in text
    assert "| digits_cnn | peer s/step over ours | not run | >= 1.5 | - |" in text
    assert "torch threads, load average" in text and " UTC on " in text
    # A problem that ran but missed the target, or ran without the peer.
    never = _result("secondorder LM (defaults)", 0.1, [(0.0, 1.0), (1.0, 1e-3)])
    missed = bench.ProblemResult(problems["sinc"], [never], [])
    text = "\n".join(lm_methods.issue17_lines([missed]))
    assert "| sinc | time to the target (s) | not reached | <= 3 | - |" in text
    assert "| sinc | peer s/step over ours | peer not run | >= 2.5 | - |" in text
    # In the whole report, after the problems.
    assert "## Issue 17: secondorder LM (defaults)" in bench.markdown([sinc, wide], "# t")


def test_issue17_summary_is_left_out_when_nothing_it_needs_ran() -> None:
    problems = bench.build_problems(tiny=True, keys=["digits_mlp"])
    pr = bench.ProblemResult(
        problems["digits_mlp"], [_result("secondorder LM (defaults)", 0.1, [(0.0, 1.0)])], []
    )
    assert lm_methods.issue17_lines([pr]) == []
    assert all(r["value"] is None for r in lm_methods.issue17([pr]))
