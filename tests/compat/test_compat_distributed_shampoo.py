"""DistributedShampoo's README examples with one changed import, against its own runs.

The reference runs are stored in data/shampoo_reference.pt (see data/README.md for the
command that made them); DistributedShampoo itself is not needed here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import secondorder.compat.distributed_shampoo as ds
from benchmarks import peers_cases as cases
from secondorder.compat.distributed_shampoo import shampoo_types
from secondorder.compat.distributed_shampoo.preconditioner import matrix_functions_types as mft

pytest.importorskip("sklearn")

REF = torch.load(Path(__file__).parent / "data" / "shampoo_reference.pt", weights_only=True)
#: README example 5 (SOAP, basis refreshed every 2 steps, bias correction, no grafting)
#: differs for two reasons, neither a fault of either side:
#: * from step 1, by 6.5e-9: DistributedShampoo forms 1 − β₂ᵗ as ``torch.tensor(1.0) -
#:   beta2**step``, a float32 tensor, so at β₂ = 0.999, t = 1 its second-moment bias
#:   correction is off by 1.3e-5 (relative) and the ungrafted step by 6.4e-6; secondorder
#:   forms it in float64.  Rounding ours the same way leaves 2.3e-10 at step 1.
#: * from the first step after a refresh, by O(lr): a factor of lower rank than its size
#:   (a bias block's after t < d steps, pixels that are always 0) has a null space, any
#:   orthonormal basis of which is an exact eigenbasis, and eigh picks one by the last
#:   bits of the factor.  Those differ: DistributedShampoo forms β₂F then adds the
#:   tensordot outer product (two roundings) and decomposes F/(1 − β₂ᵗ) + εI; secondorder
#:   forms it in one baddbmm.  The factors then agree to 4e-22 (1e-16 relative), the
#:   eigenvectors of the null space by nothing; so the next gradients' components there
#:   are divided by other entries of E.  Checked against DistributedShampoo f606606 on
#:   Gaussian data (every weight factor full rank, only the biases' deficient): frequency
#:   1 agrees to 1e-12 without bias correction, frequency 2 and 3 differ by 4e-3 from
#:   the third step on, with ours equal to the SOAP formula applied to its own state
#:   (2.8e-17); feeding ours' factor to DistributedShampoo's own eigendecomposition
#:   reproduces the difference.  With the basis refreshed every step and no bias
#:   correction (soap_every_step) the gradient has no component in the null space and
#:   the runs coincide.
KNOWN_DIFFERENT = {"example5_soap"}
#: epsilon=1e-12 on rank-deficient factors magnifies rounding (see peers_cases.EPS).
LOOSE = {"example4_adamw_readme_epsilon": 1e-7}


def run(name: str):
    case = cases.SHAMPOO_CASES[name]
    return cases.run_shampoo(ds, case, REF["init"][case.model])


def assert_matches(name: str, atol: float) -> None:
    final, losses = run(name)
    ref = REF["cases"][name]
    for key, value in final.items():
        torch.testing.assert_close(value, ref["final"][key], rtol=0, atol=atol)
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64), ref["losses"], rtol=0, atol=atol
    )


@pytest.mark.parametrize("name", [n for n in cases.SHAMPOO_CASES if n not in KNOWN_DIFFERENT])
def test_readme_example_matches_distributed_shampoo(name):
    assert_matches(name, LOOSE.get(name, 1e-10))


@pytest.mark.xfail(strict=True, reason="float32 bias correction there; null-space basis (above)")
def test_soap_every_other_step_matches_distributed_shampoo():
    assert_matches("example5_soap", 1e-6)


def test_param_groups_by_distributed_shampoos_names():
    # a Muon-README-shaped split: Shampoo for weights, a never-preconditioned Adam group
    model = cases.mlp(8)
    weights = [p for p in model.parameters() if p.ndim == 2]
    biases = [p for p in model.parameters() if p.ndim == 1]
    opt = ds.DistributedShampoo(
        [
            {"params": weights, "lr": 2**-10},
            {
                "params": biases,
                "lr": 2**-8,
                "start_preconditioning_step": math.inf,
                "grafting_config": ds.AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
            },
        ],
        betas=(0.9, 0.95),
        epsilon=1e-6,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        precondition_frequency=2,
    )
    twin = [b.detach().clone().requires_grad_() for b in biases]
    adam = torch.optim.Adam(twin, lr=2**-8, betas=(0.9, 0.95), eps=1e-10)
    for x, y in cases.digits(4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for t, b in zip(twin, biases, strict=True):
            t.grad = b.grad.clone()
        opt.step()
        adam.step()
    for t, b in zip(twin, biases, strict=True):
        torch.testing.assert_close(b.detach(), t.detach(), rtol=0, atol=1e-14)


def build(**kwargs):
    return ds.DistributedShampoo(cases.mlp(8).parameters(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"preconditioner_config": ds.RootInvKLShampooPreconditionerConfig()},
            r"preconditioner_config=RootInvKLShampooPreconditionerConfig\(\.\.\.\) .*KL-Shampoo"
            r".*nearest supported choice is RootInvShampooPreconditionerConfig",
        ),
        (
            {"preconditioner_config": ds.EigendecomposedKLShampooPreconditionerConfig()},
            r"nearest supported choice is EigendecomposedShampooPreconditionerConfig",
        ),
        (
            {"preconditioner_config": ds.DefaultSpectralDescentPreconditionerConfig},
            r"spectral descent \(Muon\) is not implemented",
        ),
        (
            {"preconditioner_config": ds.DefaultSignDescentPreconditionerConfig},
            r"sign descent is not implemented.*AdamPreconditionerConfig",
        ),
        (
            {"preconditioner_config": ds.DefaultSOAPConfig},
            r"amortized_computation_config=QREigendecompositionConfig\(\.\.\.\)"
            r".*DefaultEigenvalueCorrectedShampooConfig \(eigh\)",
        ),
        (
            {"iterate_averaging_config": ds.GeneralizedPrimalAveragingConfig()},
            r"iterate_averaging_config=GeneralizedPrimalAveragingConfig.*ClassicMomentumConfig",
        ),
        (
            {"iterate_averaging_config": ds.ScheduleFreeConfig()},
            r"ScheduleFreeConfig.*not implemented",
        ),
        # Built with DistributedShampoo's own fields, then refused the same way.
        (
            {
                "iterate_averaging_config": ds.ScheduleFreeConfig(
                    train_interp_coeff=0.8, eval_coeff_lr_power=2
                )
            },
            r"ScheduleFreeConfig.*not implemented",
        ),
        (
            {
                "iterate_averaging_config": ds.GeneralizedPrimalAveragingConfig(
                    eval_interp_coeff=0.9, train_interp_coeff=0.8
                )
            },
            r"iterate_averaging_config=GeneralizedPrimalAveragingConfig",
        ),
        (
            {"distributed_config": ds.FullyShardDistributedConfig()},
            r"FullyShardDistributedConfig\(\.\.\.\): the parameters are not DTensors; shard "
            r"the model with torch\.distributed\.fsdp\.fully_shard first",
        ),
        (
            {"distributed_config": ds.FSDPDistributedConfig(param_to_metadata={})},
            r"FSDPDistributedConfig\(\.\.\.\): the FullyShardedDataParallel \(FSDP1\) "
            r"distributors are not supported",
        ),
        (
            {
                "distributed_config": ds.SingleDeviceDistributedConfig(
                    target_parameter_dimensionality=2
                )
            },
            r"target_parameter_dimensionality=2",
        ),
        ({"beta3": 0.81}, r"beta3=0\.81 .*nearest supported choice is beta3=-1\.0"),
        (
            {"weight_decay_type": ds.WeightDecayType.CORRECTED},
            r"WeightDecayType\.CORRECTED.*DECOUPLED",
        ),
        (
            {"shampoo_pt2_compile_config": ds.ShampooPT2CompileConfig()},
            r"shampoo_pt2_compile_config",
        ),
        (
            {
                "preconditioner_config": ds.RootInvShampooPreconditionerConfig(
                    use_trace_scaling=True
                )
            },
            r"use_trace_scaling=True.*use_trace_scaling=False",
        ),
        (
            {
                "preconditioner_config": ds.RootInvShampooPreconditionerConfig(
                    inverse_exponent_override={2: 0.25}
                )
            },
            r"inverse_exponent_override",
        ),
        (
            {
                "preconditioner_config": ds.RootInvShampooPreconditionerConfig(
                    factor_matrix_dtype=torch.float64
                )
            },
            r"inv_factor_matrix_dtype=torch\.float32.*one dtype",
        ),
        (
            {
                "preconditioner_config": ds.RootInvShampooPreconditionerConfig(
                    amortized_computation_config=ds.CoupledHigherOrderConfig()
                )
            },
            r"CoupledHigherOrderConfig.*CoupledNewtonConfig",
        ),
        (
            {
                "preconditioner_config": ds.RootInvShampooPreconditionerConfig(
                    amortized_computation_config=ds.CoupledHigherOrderConfig(
                        rel_epsilon=0.0, abs_epsilon=1e-12
                    )
                )
            },
            r"CoupledHigherOrderConfig.*CoupledNewtonConfig",
        ),
        (
            {
                "preconditioner_config": ds.RootInvShampooPreconditionerConfig(
                    drop_weighting_factor_on_gsquare=True
                )
            },
            r"drop_weighting_factor_on_gsquare=True",
        ),
        (
            {"momentum": 0.9},
            r"^DistributedShampoo got 'momentum', an option of older DistributedShampoo "
            r"releases that this one does not take: pass iterate_averaging_config="
            r"ClassicMomentumConfig",
        ),
        (
            {"factor_dtype": torch.float64},
            r"^DistributedShampoo got 'factor_dtype', secondorder\.Shampoo's option, which "
            r"DistributedShampoo does not take: pass preconditioner_config="
            r"RootInvShampooPreconditionerConfig\(factor_matrix_dtype=\.\.\.\) here",
        ),
        (
            {"root_inv_confg": None},  # nearer secondorder.Shampoo's name than any valid one
            r"^DistributedShampoo got an unexpected keyword argument 'root_inv_confg' \(a "
            r"typo of 'root_inv_config'\?\), secondorder\.Shampoo's option, which "
            r"DistributedShampoo does not take: pass preconditioner_config=\.\.\. here",
        ),
        (  # a diagonal method ignores them, as DistributedShampoo does, but checks them
            {"preconditioner_config": ds.AdamPreconditionerConfig(), "max_preconditioner_dim": 0},
            r"^Invalid max_preconditioner_dim=0: must be an integer >= 1 or math\.inf",
        ),
        (
            {
                "preconditioner_config": ds.AdamPreconditionerConfig(),
                "start_preconditioning_step": 0,
            },
            r"^Invalid start_preconditioning_step=0: must be -1, an integer >= 1 or math\.inf",
        ),
        (
            {"precondition_frequncy": 10},
            r"'precondition_frequncy' \(a typo\?\); did you mean 'precondition_frequency'",
        ),
    ],
)
def test_unsupported_options_are_refused_with_the_nearest_choice(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build(**kwargs)


def test_a_refused_group_is_not_added():
    opt = build(epsilon=1e-6)
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(
        TypeError,
        match=r"parameter group got an unexpected keyword argument 'lrr'.*did you mean 'lr'",
    ):
        opt.add_param_group({"params": [extra], "lrr": 0.1})
    with pytest.raises(ValueError, match=r"a parameter group's distributed_config must equal"):
        opt.add_param_group({"params": [extra], "distributed_config": ds.DDPDistributedConfig()})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (
            lambda: ds.AdamPreconditionerConfig(beta2=1.5),
            ValueError,
            r"Invalid AdamPreconditionerConfig\.beta2=1\.5",
        ),
        (
            lambda: ds.AdaGradPreconditionerConfig(epsilon=0.0),
            ValueError,
            r"Invalid AdaGradPreconditionerConfig\.epsilon=0\.0",
        ),
        (
            lambda: ds.ClassicMomentumConfig(momentum=0.0),
            ValueError,
            r"Invalid ClassicMomentumConfig\.momentum=0\.0",
        ),
        (
            lambda: ds.EigenConfig(tolerance=0.5),
            ValueError,
            r"Invalid EigenConfig\.tolerance=0\.5: must be 0\.0",
        ),
        (
            lambda: ds.DDPDistributedConfig(num_trainers_per_group=0),
            ValueError,
            r"num_trainers_per_group=0",
        ),
        (
            lambda: ds.PreconditionerConfig(),
            TypeError,
            r"PreconditionerConfig is abstract; build one of its subclasses: "
            r".*AdamPreconditionerConfig",
        ),
        (lambda: mft.RootInvConfig(), TypeError, r"RootInvConfig is abstract"),
        (lambda: shampoo_types.DistributedConfig(), TypeError, r"DistributedConfig is abstract"),
    ],
)
def test_configs_check_their_fields(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_import_paths_mirror_the_reference():
    from secondorder.compat.distributed_shampoo.distributed_shampoo import DistributedShampoo
    from secondorder.compat.distributed_shampoo.shampoo_types import ClassicMomentumConfig

    assert DistributedShampoo is ds.DistributedShampoo
    assert ClassicMomentumConfig is ds.ClassicMomentumConfig
    assert mft.DefaultEigenConfig is ds.DefaultEigenConfig


def _trained(**kwargs):
    torch.manual_seed(0)
    model = cases.mlp(8)
    opt = ds.DistributedShampoo(model.parameters(), **kwargs)
    batches = list(cases.digits(3))
    for x, y in batches[:2]:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    x, y = batches[2]
    F.cross_entropy(model(x), y).backward()
    return model, opt


def _snapshot(model, opt):
    import copy

    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert sa["param_groups"] == sb["param_groups"]
    for k, entry in sa["state"].items():
        for name, v in entry.items():
            w = sb["state"][k][name]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (
            "weight_decay_type",
            ds.WeightDecayType.L2,
            r"param_groups\[0\]\['weight_decay_type'\]=.*would be ignored.*"
            r"Set use_decoupled_weight_decay=False instead and delete 'weight_decay_type'",
        ),
        (
            "weight_decay_type",
            ds.WeightDecayType.CORRECTED,
            r"weight_decay_type=.*is not supported.*keep the group's and delete",
        ),
        (
            "iterate_averaging_config",
            ds.ClassicMomentumConfig(momentum=0.5, use_nesterov=True),
            r"Set momentum=0\.5, dampening=0\.0, use_nesterov=True instead",
        ),
        ("beta3", 0.5, r"param_groups\[0\]\['beta3'\]=0\.5 .*The gradient filter is betas\[0\]"),
        (
            "preconditioner_config",
            ds.DefaultEigenvalueCorrectedShampooConfig,
            r"'preconditioner_config'\]=.*fixed when the group is added: build a new",
        ),
    ],
)
def test_a_distributed_shampoo_group_key_set_later_is_refused_before_the_step(key, value, match):
    # before: the groups hold so.Shampoo's translated options, so these were silently
    # ignored (DistributedShampoo itself switches to L2 weight decay when told to)
    kw = {
        "weight_decay": 1e-2,
        "iterate_averaging_config": ds.ClassicMomentumConfig(momentum=0.9),
        "grafting_config": ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
    }
    model, opt = _trained(**kw)
    before = _snapshot(model, opt)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=match):
        opt.step()
    del opt.param_groups[0][key]
    _same(_snapshot(model, opt), before)
    # a value that asks for what the group already does is not refused
    same_value = {
        "weight_decay_type": ds.WeightDecayType.DECOUPLED,
        "iterate_averaging_config": ds.ClassicMomentumConfig(momentum=0.9),
        "beta3": -1.0,
    }
    if key in same_value:
        opt.param_groups[0][key] = same_value[key]
        opt.step()
        del opt.param_groups[0][key]
        model2, twin = _trained(**kw)
        twin.step()
        _same(_snapshot(model, opt), _snapshot(model2, twin))
