"""kfac-pytorch's example loop with one changed import, against kfac-pytorch's own runs.

The reference runs are stored in data/kaisa_reference.pt (see data/README.md for the
command that made them); kfac-pytorch itself is not needed here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import secondorder.compat.kfac as kfac
from benchmarks import peers_cases as cases
from secondorder.compat.kfac.enums import ComputeMethod, DistributedStrategy, parse
from secondorder.compat.kfac.preconditioner import KAISAConventionWarning, KFACPreconditioner

pytest.importorskip("sklearn")
pytestmark = pytest.mark.filterwarnings(
    "ignore::secondorder.compat.kfac.preconditioner.KAISAConventionWarning"
)

REF = torch.load(Path(__file__).parent / "data" / "kaisa_reference.pt", weights_only=True)
EXACT = [n for n in cases.KAISA_CASES if n not in ("example_eigen_float32", "conv_factors")]


def run(name: str):
    case = cases.KAISA_CASES[name]
    return cases.run_kaisa(kfac, case, REF["init"][case.model])


@pytest.mark.parametrize("name", EXACT)
def test_example_matches_kfac_pytorch(name):
    final, losses, _ = run(name)
    ref = REF["cases"][name]
    for key, value in final.items():
        torch.testing.assert_close(value, ref["final"][key], rtol=0, atol=1e-10)
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64), ref["losses"], rtol=0, atol=1e-10
    )


def test_kfac_pytorch_as_shipped_differs_by_its_float32_eigh_only():
    # kfac-pytorch eigendecomposes in float32 whatever inv_dtype is; ours in inv_dtype
    final, _, _ = run("example_eigen_float32")
    ref = REF["cases"]["example_eigen_float32"]["final"]
    errors = [float((final[k] - ref[k]).abs().max()) for k in final]
    assert 1e-10 < max(errors) < 1e-5


def test_conv_factors_follow_the_documented_scale():
    # KAISA divides conv patch rows by the P output positions: its A is ours / P², its
    # G ours / P³ (Linear factors equal); no identity start with exp_decay_factor_averaging
    _, _, pre = run("conv_factors")
    ours = pre.state_dict()["layers"]
    ref = REF["cases"]["conv_factors"]["factors"]
    P = 16
    torch.testing.assert_close(ours["conv"]["A"] / P**2, ref["conv"]["A"], rtol=1e-12, atol=0)
    torch.testing.assert_close(ours["conv"]["G"] / P**3, ref["conv"]["G"], rtol=1e-12, atol=0)
    torch.testing.assert_close(ours["fc"]["A"], ref["fc"]["A"], rtol=1e-12, atol=0)
    torch.testing.assert_close(ours["fc"]["G"], ref["fc"]["G"], rtol=1e-12, atol=0)


def test_construction_names_the_scaling_convention():
    with pytest.warns(KAISAConventionWarning, match=r"divided by B² .* so\.KFAC"):
        KFACPreconditioner(cases.mlp())


@pytest.mark.parametrize(
    ("value", "member"),
    [
        ("EIGEN", ComputeMethod.EIGEN),
        ("eigen", ComputeMethod.EIGEN),
        ("Inverse", ComputeMethod.INVERSE),
        (ComputeMethod.INVERSE, ComputeMethod.INVERSE),
    ],
)
def test_compute_method_spellings(value, member):
    assert parse("compute_method", ComputeMethod, value) is member
    assert KFACPreconditioner(cases.mlp(), compute_method=value).compute_method is member


@pytest.mark.parametrize(
    "value", ["COMM_OPT", "comm_opt", "comm-opt", DistributedStrategy.COMM_OPT, 1.0]
)
def test_comm_opt_spellings(value):
    pre = KFACPreconditioner(cases.mlp(), grad_worker_fraction=value)
    assert pre.distributed_strategy is DistributedStrategy.COMM_OPT


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"compute_method": "cholesky"},
            ValueError,
            r"Invalid compute_method='cholesky': must be one of 'eigen', 'inverse'",
        ),
        ({"factor_decay": 1.0}, ValueError, r"Invalid factor_decay=1\.0: .* never updates"),
        ({"damping": 0.0}, ValueError, r"Invalid damping=0\.0: must be a finite number > 0"),
        ({"grad_worker_fraction": 1.5}, ValueError, r"Invalid grad_worker_fraction=1\.5"),
        (
            {"colocate_factors": False},
            ValueError,
            r"colocate_factors=False with compute_eigenvalue_outer_product",
        ),
        ({"allreduce_bucket_cap_mb": -1}, ValueError, r"Invalid allreduce_bucket_cap_mb=-1"),
        ({"skip_layers": "fc"}, TypeError, r"Invalid skip_layers='fc'"),
        (
            {"dampnig": 0.1},
            TypeError,
            r"unexpected keyword argument 'dampnig' \(a typo\?\); did you mean 'damping'",
        ),
        ({"tdc": None}, TypeError, r"does not support kfac-pytorch \(KAISA\)'s option 'tdc'"),
        (
            {"factor_checkpoint_dir": "x"},
            TypeError,
            r"option 'factor_checkpoint_dir': save state_dict",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    model = cases.mlp()
    with pytest.raises(error, match=match):
        KFACPreconditioner(model, **kwargs)
    assert not model[0]._forward_hooks  # refused before any hook was attached


def test_registers_what_kfac_pytorch_registers():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Conv1d(1, 1, 1), torch.nn.Linear(4, 2)
    ).double()
    pre = KFACPreconditioner(model, skip_layers=["^2$"])
    assert list(pre.kfac.layers) == ["0"]  # Conv1d is not KAISA's; "2" skipped by regex
    pre = KFACPreconditioner(model, skip_layers=["Conv"])
    assert list(pre.kfac.layers) == ["0", "2"]


def _train(pre, model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_dict_round_trip_continues_in_lockstep(method):
    data = cases.digits(8)
    model = cases.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(
        model, inv_update_steps=3, compute_method=method, inv_dtype=torch.float64
    )
    _train(pre, model, opt, data[:4])
    state = pre.state_dict()
    assert set(state) == {
        "steps",
        "factor_update_steps",
        "inv_update_steps",
        "damping",
        "factor_decay",
        "kl_clip",
        "lr",
        "layers",
    }
    assert state["layers"]["0"]["A"].shape == (65, 65)
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    pre2 = KFACPreconditioner(
        model2, inv_update_steps=3, compute_method=method, inv_dtype=torch.float64
    )
    pre2.load_state_dict(state)
    assert pre2.steps == 4
    _train(pre, model, opt, data[4:])
    _train(pre2, model2, opt2, data[4:])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-13)


def _everything(pre):
    """The preconditioner's whole state (copied) and its hyperparameters."""
    from tests.kfac.faults import state_of

    return {
        "native": state_of(pre.kfac, pre.kfac.layers["0"].module),
        "kaisa": copy.deepcopy(pre.state_dict()),
        "hyper": {n: getattr(pre, "_" + n) for n in kfac.preconditioner.SCHEDULED},
    }


def test_load_state_dict_refuses_a_wrong_layer_before_changing_anything():
    from tests.kfac.faults import same

    model = cases.mlp()
    pre = KFACPreconditioner(model)
    _train(pre, model, torch.optim.SGD(model.parameters(), lr=0.1), cases.digits(1))
    state = pre.state_dict()
    state["layers"]["0"]["A"] = torch.zeros(3, 3, dtype=torch.float64)
    state["damping"] = 0.5
    before = _everything(pre)
    with pytest.raises(
        ValueError, match=r"layer '0': factor A must be a tensor of shape \(65, 65\)"
    ):
        pre.load_state_dict(state)
    assert same(_everything(pre), before)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_load_state_dict_interrupted_while_recomputing_changes_nothing(method):
    # before: the hyperparameters were set, then the native load assigned the factors
    # and decomposed one layer at a time
    from tests.kfac.faults import Fault, same

    model = cases.mlp()
    pre = KFACPreconditioner(model, compute_method=method, inv_dtype=torch.float64)
    _train(pre, model, torch.optim.SGD(model.parameters(), lr=0.1), cases.digits(3))
    state = {**pre.state_dict(), "damping": 0.5, "inv_update_steps": 7}
    fresh_model = cases.mlp()
    fresh = KFACPreconditioner(fresh_model, compute_method=method, inv_dtype=torch.float64)
    _train(fresh, fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=0.1), cases.digits(1))
    before = _everything(fresh)
    func = torch.linalg.eigh if method == "eigen" else torch.linalg.cholesky_ex
    with Fault(func, KeyboardInterrupt("Ctrl-C"), at=3), pytest.raises(KeyboardInterrupt):
        fresh.load_state_dict(state)
    assert same(_everything(fresh), before)
    fresh.load_state_dict(state)
    assert fresh.damping == 0.5 and fresh.inv_update_steps == 7 and fresh.steps == 3


def test_lambda_param_scheduler_scales_damping():
    pre = KFACPreconditioner(cases.mlp(), damping=0.003)
    sched = kfac.scheduler.LambdaParamScheduler(pre, damping_lambda=lambda step: 0.5)
    sched.step()
    assert pre.damping == pytest.approx(0.0015)
    callable_damping = KFACPreconditioner(cases.mlp(), damping=lambda step: 0.003)
    with pytest.raises(
        ValueError, match=r"Invalid damping_lambda: preconditioner\.damping is already a callable"
    ):
        kfac.scheduler.LambdaParamScheduler(callable_damping, damping_lambda=lambda step: 0.5)


@pytest.mark.parametrize(
    ("lambdas", "match"),
    [
        (
            {"damping_lambda": lambda s: -1.0},
            r"Invalid damping=-0\.003: must be a finite number >",
        ),
        ({"inv_update_steps_lambda": lambda s: 0.05}, r"Invalid inv_update_steps=0: must be"),
        (
            {"factor_decay_lambda": lambda s: 2.0},
            r"Invalid factor_decay=1\.9: must be a finite number in",
        ),
    ],
)
def test_lambda_param_scheduler_refuses_a_bad_value_and_changes_nothing(lambdas, match):
    # before: damping became -0.003 (and the next step failed), or an interval 0
    pre = KFACPreconditioner(cases.mlp(), damping=0.003, inv_update_steps=10)
    sched = kfac.scheduler.LambdaParamScheduler(pre, lr_lambda=lambda s: 0.5, **lambdas)
    before = {n: getattr(pre, "_" + n) for n in kfac.preconditioner.SCHEDULED}
    with pytest.raises(ValueError, match=match + r".* \(from \w+_lambda at step 0; no hyper"):
        sched.step()
    assert {n: getattr(pre, "_" + n) for n in kfac.preconditioner.SCHEDULED} == before


def test_exp_decay_factor_averaging():
    f = kfac.hyperparams.exp_decay_factor_averaging(0.9)
    assert [f(k) for k in (0, 1, 2, 4, 100)] == [0.0, 0.0, 0.5, 0.75, 0.9]
    with pytest.raises(ValueError, match=r"Invalid min_value=0"):
        kfac.hyperparams.exp_decay_factor_averaging(0)


def test_memory_usage_has_kaisas_keys_and_the_bytes_of_each_part():
    # before: {a_factors, g_factors, inverses, total}, a KeyError on KAISA's "a_inverses".
    # Linear(3, 4) and Linear(4, 2), float32: A is 4x4 and 5x5 (bias row), G 4x4 and 2x2;
    # the eigen method keeps Q and d of each, the inverse method one matrix of each.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    a, g = (16 + 25) * 4, (16 + 4) * 4
    for method, a_inv, g_inv in (("eigen", (20 + 30) * 4, (20 + 6) * 4), ("inverse", a, g)):
        pre = KFACPreconditioner(model, inv_update_steps=1, compute_method=method)
        keys = ["a_factors", "g_factors", "a_batch", "g_batch", "a_inverses", "g_inverses"]
        assert pre.memory_usage() == dict.fromkeys([*keys, "total"], 0)
        model.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        gathered = pre.memory_usage()
        assert (gathered["a_batch"], gathered["g_batch"], gathered["total"]) == (a, g, a + g)
        pre.step()
        want = dict(zip(keys, [a, g, 0, 0, a_inv, g_inv], strict=True))
        assert pre.memory_usage() == {**want, "total": sum(want.values())}


def test_skip_layers_that_skips_every_layer_is_named():
    # before: "no layer K-FAC can precondition ... 'not in modules'", skip_layers unnamed
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"Invalid skip_layers=\['Linear'\]: it skips every"):
        KFACPreconditioner(model, skip_layers=["Linear"])
