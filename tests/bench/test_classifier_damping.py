"""The classifier damping comparison: same data and weights per initialisation."""

from __future__ import annotations

import torch

from benchmarks.experiments import classifier_damping
from benchmarks.lm_methods import lm_method
from benchmarks.lm_problems import build_problems


def test_initialisation_zero_is_the_bench_model_and_others_redraw() -> None:
    problem = build_problems(tiny=True, keys=["digits_mlp"])["digits_mlp"]
    bench = problem.make_model().state_dict()
    zero = classifier_damping._model(problem, 0).state_dict()
    one = classifier_damping._model(problem, 1).state_dict()
    assert all(torch.equal(bench[k], zero[k]) for k in bench)
    assert not any(torch.equal(bench[k], one[k]) for k in bench)


def test_a_run_reports_accuracy_and_loss_of_the_trained_model() -> None:
    problem = build_problems(tiny=True, keys=["digits_mlp"])["digits_mlp"]
    out = classifier_damping.run(problem, lm_method("LM", {}), 0)
    again = classifier_damping.run(problem, lm_method("LM", {}), 0)
    assert 0.0 <= out["acc"] <= 1.0 and out["ce"] > 0 and out["step_s"] > 0
    # Deterministic on the CPU: the same batches from the same weights.
    assert (out["acc"], out["ce"]) == (again["acc"], again["ce"])
