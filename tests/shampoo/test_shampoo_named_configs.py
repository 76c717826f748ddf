"""DistributedShampoo's config names taken natively, and unknown keywords named.

The diagonal methods under DistributedShampoo's names are checked against closed
forms and torch.optim (Shampoo that never preconditions is its grafted method); the
refusals are checked by their messages.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import secondorder.compat.distributed_shampoo as ds
from secondorder.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    FSDPDistributedConfig,
    FullyShardDistributedConfig,
    RMSpropGraftingConfig,
    RMSpropPreconditionerConfig,
    SGDPreconditionerConfig,
    Shampoo,
    SingleDeviceDistributedConfig,
)
from secondorder.shampoo.named_configs import FSDPParamAssignmentStrategy

NEVER = 10**9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _train(opt_for, steps: int = 4) -> torch.Tensor:
    model = _model()
    opt = opt_for(model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    y = torch.randn(16, 3, generator=g, dtype=torch.float64)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_compat_package_re_exports_the_one_definition() -> None:
    assert ds.AdamPreconditionerConfig is AdamPreconditionerConfig
    assert ds.FullyShardDistributedConfig is FullyShardDistributedConfig
    assert ds.shampoo_types.DDPDistributedConfig is DDPDistributedConfig


@pytest.mark.parametrize(
    ("config", "reference"),
    [
        (
            AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
            lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8),
        ),
        (
            AdaGradPreconditionerConfig(epsilon=1e-10),
            lambda ps: torch.optim.Adagrad(ps, lr=0.01, eps=1e-10),
        ),
        (SGDPreconditionerConfig(), lambda ps: torch.optim.SGD(ps, lr=0.01)),
    ],
    ids=["adam", "adagrad", "sgd"],
)
def test_reference_names_graft_as_torch_optim(config, reference) -> None:
    beta1 = 0.9 if isinstance(config, AdamPreconditionerConfig) else 0.0
    got = _train(
        lambda ps: Shampoo(
            ps,
            lr=0.01,
            betas=(beta1, 1.0),
            grafting_config=config,
            start_preconditioning_step=NEVER,
        )
    )
    want = _train(reference)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def _rmsprop_by_hand(beta2: float, weight: float, eps: float, steps: int = 4) -> torch.Tensor:
    model = _model()
    params = list(model.parameters())
    v = [torch.zeros_like(p) for p in params]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    y = torch.randn(16, 3, generator=g, dtype=torch.float64)
    for _ in range(steps):
        for p in params:
            p.grad = None
        ((model(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p, vi in zip(params, v, strict=True):
                vi.mul_(beta2).add_(weight * p.grad**2)
                p.sub_(0.01 * p.grad / (vi.sqrt() + eps))
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize(
    ("config", "beta2", "weight", "eps"),
    [
        (RMSpropPreconditionerConfig(), 0.99, 0.01, 1e-10),  # the reference's defaults
        (
            RMSpropPreconditionerConfig(beta2=0.9, drop_weighting_factor_on_gsquare=True),
            0.9,
            1,
            1e-10,
        ),
        (RMSpropPreconditionerConfig(beta2=1.0), 1.0, 0.0, 1e-10),  # v stays 0, as there
        (AdamPreconditionerConfig(beta2=0.9, drop_weighting_factor_on_gsquare=True), 0.9, 1, 1e-10),
    ],
    ids=["defaults", "dropped-weight", "beta2-one", "adam-dropped-weight-no-bias-correction"],
)
def test_rmsprop_names_keep_the_references_defaults_and_weights(config, beta2, weight, eps) -> None:
    got = _train(
        lambda ps: Shampoo(
            ps, lr=0.01, betas=(0.0, 1.0), grafting_config=config, start_preconditioning_step=NEVER
        )
    )
    # beta2=1 divides by epsilon alone: steps of 1e16, hence the relative tolerance
    torch.testing.assert_close(got, _rmsprop_by_hand(beta2, weight, eps), rtol=1e-13, atol=1e-13)


def test_rmsprop_preconditioner_config_is_not_the_grafting_config() -> None:
    # epsilon 1e-10 against 1e-8: the defaults differ, so the runs do
    a = _train(lambda ps: Shampoo(ps, grafting_config=RMSpropPreconditionerConfig()))
    b = _train(lambda ps: Shampoo(ps, grafting_config=RMSpropGraftingConfig()))
    assert not torch.equal(a, b)


def test_reference_names_survive_a_weights_only_state_dict() -> None:
    model = _model()
    opt = Shampoo(model.parameters(), grafting_config=AdamPreconditionerConfig(beta2=0.95))
    model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    again = Shampoo(model.parameters(), grafting_config=AdamPreconditionerConfig(beta2=0.95))
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert again.param_groups[0]["grafting_config"] == AdamPreconditionerConfig(beta2=0.95)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"lrr": 0.1},
            r"so\.Shampoo got an unexpected keyword argument 'lrr' \(a typo\?\); "
            r"did you mean 'lr'\?",
        ),
        (
            {"precondition_frequncy": 2},
            r"'precondition_frequncy' \(a typo\?\); did you mean 'precondition_frequency'\?",
        ),
        (
            {"preconditioner_config": ds.DefaultShampooConfig},
            r"so\.Shampoo does not support DistributedShampoo's option 'preconditioner_config': "
            r"pass preconditioner='root_inverse'.*compat\.distributed_shampoo",
        ),
        (
            {"iterate_averaging_config": ds.ClassicMomentumConfig()},
            r"option 'iterate_averaging_config': pass ClassicMomentumConfig's fields as momentum=",
        ),
        (
            {"weight_decay_type": ds.WeightDecayType.L2},
            r"option 'weight_decay_type': pass use_decoupled_weight_decay=True",
        ),
        ({"beta3": 0.9}, r"option 'beta3': the gradient filter is betas\[0\]"),
        (
            {"weight_decay_typ": 1},  # nearer DistributedShampoo's name than 'weight_decay'
            r"unexpected keyword argument 'weight_decay_typ'; it is not an option here \(did "
            r"you mean DistributedShampoo's 'weight_decay_type', which is not supported: pass "
            r"use_decoupled_weight_decay",
        ),
        ({"xyzzy": 1}, r"unexpected keyword argument 'xyzzy'; valid keywords are .*betas"),
    ],
)
def test_unknown_keywords_are_named(kwargs, match) -> None:
    with pytest.raises(TypeError, match=match):
        Shampoo(_model().parameters(), **kwargs)


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (
            "weight_decya",
            r"parameter group got an unexpected keyword argument 'weight_decya'.*'weight_decay'",
        ),
        ("beta3", r"parameter group does not support DistributedShampoo's option 'beta3'"),
    ],
)
def test_group_keys_that_look_meant_are_refused_before_the_group_is_added(key, match) -> None:
    model = _model()
    opt = Shampoo([model[0].weight])
    with pytest.raises(TypeError, match=match):
        opt.add_param_group({"params": [model[0].bias], key: 0.5})
    assert len(opt.param_groups) == 1


def test_other_group_keys_pass_as_in_torch_optim() -> None:
    model = _model()
    opt = Shampoo([{"params": model.parameters(), "name": "all"}])
    assert opt.param_groups[0]["name"] == "all"


def test_single_device_config_is_a_local_optimizer() -> None:
    got = _train(lambda ps: Shampoo(ps, distributed_config=SingleDeviceDistributedConfig()))
    want = _train(lambda ps: Shampoo(ps))
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"distributed_config": FSDPDistributedConfig(param_to_metadata={})},
            ValueError,
            r"Invalid distributed_config=FSDPDistributedConfig\(\.\.\.\): the "
            r"FullyShardedDataParallel \(FSDP1\) distributors are not supported; .*fully_shard",
        ),
        (
            {"distributed_config": FullyShardDistributedConfig()},
            ValueError,
            r"Invalid distributed_config=FullyShardDistributedConfig\(\.\.\.\): the parameters "
            r"are not DTensors",
        ),
        (
            {"distributed_config": DDPDistributedConfig(target_parameter_dimensionality=2)},
            ValueError,
            r"Invalid DDPDistributedConfig\.target_parameter_dimensionality=2: must be 1",
        ),
        (
            {
                "distributed_config": FullyShardDistributedConfig(
                    param_assignment_strategy=FSDPParamAssignmentStrategy.REPLICATE
                )
            },
            ValueError,
            r"param_assignment_strategy=FSDPParamAssignmentStrategy\.REPLICATE: must be "
            r"FSDPParamAssignmentStrategy\.DEFAULT",
        ),
        (
            {"distributed_config": FullyShardDistributedConfig(num_sub_groups=2)},
            ValueError,
            r"Invalid FullyShardDistributedConfig\.num_sub_groups=2: must be 1",
        ),
        (
            {"distributed_config": "ddp"},
            TypeError,
            r"Invalid distributed_config='ddp': must be None",
        ),
    ],
)
def test_distributed_configs_we_cannot_run_are_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        Shampoo(_model().parameters(), **kwargs)


def test_ddp_config_sets_the_communication_dtype() -> None:
    opt = Shampoo(
        _model().parameters(),
        distributed_config=DDPDistributedConfig(communication_dtype=torch.bfloat16),
    )
    assert opt.communication_dtype == torch.bfloat16
