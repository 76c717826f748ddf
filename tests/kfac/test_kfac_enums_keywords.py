"""so.KFAC takes kfac-pytorch's enums and spellings, and names keywords it does not take."""

from __future__ import annotations

import enum

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.compat.kfac import enums as compat_enums
from secondorder.kfac import KFACConfig
from secondorder.kfac.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_compat_reexports_the_same_enums():
    assert compat_enums.ComputeMethod is ComputeMethod
    assert compat_enums.DistributedStrategy is DistributedStrategy
    assert compat_enums.AssignmentStrategy is AssignmentStrategy


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        (ComputeMethod.EIGEN, "eigen"),
        (ComputeMethod.INVERSE, "inverse"),
        ("EIGEN", "eigen"),
        ("Inverse", "inverse"),
        (" inverse ", "inverse"),
    ],
)
def test_compute_method_spellings(value, stored):
    assert so.KFAC(mlp(), compute_method=value).config.compute_method == stored


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        (DistributedStrategy.COMM_OPT, "comm-opt"),
        (DistributedStrategy.MEM_OPT, "mem-opt"),
        (DistributedStrategy.HYBRID_OPT, 0.5),
        ("comm_opt", "comm-opt"),
        ("COMM-OPT", "comm-opt"),
        ("COMM_OPT", "comm-opt"),
        ("mem-opt", "mem-opt"),
        ("Hybrid-Opt", 0.5),
        (0.25, 0.25),
    ],
)
def test_distributed_strategy_spellings(value, stored):
    cfg = KFACConfig(grad_worker_fraction=value)
    assert cfg.grad_worker_fraction == stored
    # one process: every strategy has one gradient worker, the process itself
    assert cfg.grad_workers(1) == 1


def test_strategies_give_kaisa_worker_counts():
    assert KFACConfig(grad_worker_fraction=DistributedStrategy.COMM_OPT).grad_workers(4) == 4
    assert KFACConfig(grad_worker_fraction=DistributedStrategy.MEM_OPT).grad_workers(4) == 1
    assert KFACConfig(grad_worker_fraction=DistributedStrategy.HYBRID_OPT).grad_workers(4) == 2


@pytest.mark.parametrize(
    ("value", "stored"),
    [(AssignmentStrategy.MEMORY, "memory"), ("COMPUTE", "compute"), ("Memory", "memory")],
)
def test_assignment_strategy_spellings(value, stored):
    assert so.KFAC(mlp(), assignment_strategy=value).config.assignment_strategy == stored


def test_a_member_of_kfac_pytorchs_own_enum_is_read_by_name():
    # kfac-pytorch's kfac.enums is another module with equally named classes
    foreign = enum.Enum("ComputeMethod", {"EIGEN": 1, "INVERSE": 2})
    assert so.KFAC(mlp(), compute_method=foreign.INVERSE).config.compute_method == "inverse"
    other = enum.Enum("Colour", {"EIGEN": 1})
    with pytest.raises(ValueError, match=r"^Invalid compute_method=<Colour\.EIGEN: 1>: must be"):
        so.KFAC(mlp(), compute_method=other.EIGEN)


def test_the_enum_changes_nothing_but_the_spelling():
    torch.manual_seed(1)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    grads = []
    for method in ("inverse", ComputeMethod.INVERSE):
        model = mlp()
        kfac = so.KFAC(model, compute_method=method, grad_worker_fraction="COMM_OPT")
        nn.functional.mse_loss(model(x), y).backward()
        kfac.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ("allreduce_bucket_cap_mb", r"all factors of a step travel in one call"),
        ("colocate_factors", r"one rank decomposes both factors of a layer"),
        (
            "compute_eigenvalue_outer_product",
            r"the damped outer product of the eigenvalues is always kept",
        ),
        ("update_factors_in_hook", r"the factors are updated in step\(\)"),
        ("loglevel", r"nothing is logged; print\(kfac\) lists the layers"),
    ],
)
@pytest.mark.parametrize("owner", ["so.KFAC", "KFACOptimizer"])
def test_kaisa_options_are_named_with_a_hint(option, why, owner):
    cls = so.KFAC if owner == "so.KFAC" else so.KFACOptimizer
    with pytest.raises(
        TypeError,
        match=rf"^{owner} does not support kfac-pytorch \(KAISA\)'s option '{option}': it "
        rf"changes nothing here \({why}\); drop it, or keep it with secondorder\.compat\.kfac\.$",
    ):
        cls(mlp(), **{option: 1})


@pytest.mark.parametrize(
    ("option", "hint"),
    [
        ("assignment", r"pass assignment_strategy='compute' or 'memory'"),
        ("tdc", r"communication goes through reducer= or process_group="),
        ("model_parallel_group", r"model parallelism is not supported"),
        (
            "factor_checkpoint_dir",
            r"save state_dict\(\) with torch\.save or torch\.distributed\.checkpoint\.",
        ),
    ],
)
def test_kaisa_options_of_other_classes_are_named(option, hint):
    with pytest.raises(TypeError, match=rf"^so\.KFAC does not support .*'{option}': {hint}"):
        so.KFAC(mlp(), **{option: None})


@pytest.mark.parametrize(
    ("cls", "typo", "meant"),
    [
        (so.KFAC, "dampnig", "damping"),
        (so.KFAC, "inv_update_step", "inv_update_steps"),
        (so.KFAC, "compute_methd", "compute_method"),
        (so.KFACOptimizer, "kl_clipp", "kl_clip"),
        (so.KFACOptimizer, "adaptive_dampin", "adaptive_damping"),
    ],
)
def test_a_typo_gets_the_closest_name(cls, typo, meant):
    owner = "so.KFAC" if cls is so.KFAC else "KFACOptimizer"
    with pytest.raises(
        TypeError,
        match=rf"^{owner} got an unexpected keyword argument '{typo}' \(a typo\?\); did you "
        rf"mean '{meant}'\?$",
    ):
        cls(mlp(), **{typo: 1})


def test_a_misspelt_kaisa_option_is_named_as_unsupported():
    with pytest.raises(
        TypeError, match=r"did you mean kfac-pytorch \(KAISA\)'s 'colocate_factors'"
    ):
        so.KFAC(mlp(), colocate_factor=True)


def test_nothing_close_lists_the_keywords():
    with pytest.raises(
        TypeError,
        match=r"^so\.KFAC got an unexpected keyword argument 'zzz'; valid keywords are "
        r"accumulation_steps, assignment_strategy, .*symmetry_aware\.$",
    ):
        so.KFAC(mlp(), zzz=1)


def test_a_refused_keyword_registers_no_hooks():
    model = mlp()
    with pytest.raises(TypeError):
        so.KFAC(model, colocate_factors=True)
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
