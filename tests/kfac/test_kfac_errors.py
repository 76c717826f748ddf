"""Every bad input is refused with a message naming the argument, before anything changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from secondorder.distributed import LocalReducer
from secondorder.kfac import KFAC, KFACConfig, KFACOptimizer, LMDampingRule, assign_work


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))


BAD = [
    (
        dict(compute_method="cholesky"),
        ValueError,
        r"^Invalid compute_method='cholesky': must be one of 'eigen', 'inverse' \(any case, "
        r"'-' or '_'\) or a member of ComputeMethod such as ComputeMethod\.EIGEN\.$",
    ),
    (dict(damping=-1e-3), ValueError, r"Invalid damping=-0.001: must be a finite number > 0"),
    (dict(damping=float("nan")), ValueError, r"Invalid damping=nan: must be a finite number > 0"),
    (
        dict(damping="big"),
        TypeError,
        r"^Invalid damping='big': must be a finite number > 0, or a callable of the step\.$",
    ),
    (
        dict(factor_decay=1.0),
        ValueError,
        r"Invalid factor_decay=1.0: must be a finite number in \[0, 1\)",
    ),
    (
        dict(factor_decay=-0.1),
        ValueError,
        r"Invalid factor_decay=-0.1: must be a finite number in \[0, 1\)",
    ),
    (
        dict(kl_clip=0.0),
        ValueError,
        r"^Invalid kl_clip=0.0: must be a finite number > 0, None \(no clipping\) or a callable\.$",
    ),
    (dict(lr=-0.1), ValueError, r"Invalid lr=-0.1: must be a finite number >= 0"),
    (
        dict(factor_update_steps=0),
        ValueError,
        r"Invalid factor_update_steps=0: must be an integer >= 1",
    ),
    (dict(inv_update_steps=1.5), ValueError, r"Invalid inv_update_steps=1.5"),
    (dict(accumulation_steps=0), ValueError, r"Invalid accumulation_steps=0"),
    (
        dict(assignment_strategy="fast"),
        ValueError,
        r"Invalid assignment_strategy='fast': must be one of 'compute', 'memory'",
    ),
    (dict(loss_reduction="none"), ValueError, r"Unknown loss_reduction='none'"),
    (dict(inv_dtype=torch.int32), ValueError, r"Invalid inv_dtype=torch.int32: must be a floating"),
    (dict(factor_dtype="float"), ValueError, r"Invalid factor_dtype='float': must be None or a"),
    (dict(skip_layers=[1]), TypeError, r"Invalid skip_layers=\(1,\): must be a list of module"),
    (dict(grad_worker_fraction=0.0), ValueError, r"Invalid grad_worker_fraction=0.0: must be a"),
    (dict(grad_worker_fraction=1.5), ValueError, r"Invalid grad_worker_fraction=1.5"),
    (
        dict(grad_worker_fraction="best"),
        ValueError,
        r"^Invalid grad_worker_fraction='best': must be one of 'comm_opt', 'mem_opt', "
        r"'hybrid_opt' .* A number in \(0, 1\] is a HYBRID-OPT fraction\.$",
    ),
    (dict(symmetry_aware=1), TypeError, r"Invalid symmetry_aware=1: must be a bool"),
    (
        dict(modules=["1"]),
        TypeError,
        r"Invalid modules entry '1': it is a LayerNorm, which K-FAC does not support",
    ),
    (dict(modules=["nope"]), ValueError, r"\['nope'\] are not submodule names of the model"),
    (dict(grad_scaler=3), TypeError, r"Invalid grad_scaler=3: must be a torch.amp.GradScaler"),
    (dict(reducer="local"), TypeError, r"reducer must be a secondorder.distributed.Reducer"),
]


@pytest.mark.parametrize(("kwargs", "exc", "match"), BAD)
def test_bad_argument_is_refused_before_hooks_exist(
    kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    model = mlp()
    with pytest.raises(exc, match=match):
        KFAC(model, **kwargs)  # type: ignore[arg-type]
    assert all(not m._forward_hooks for m in model.modules())


def test_model_without_supported_layers() -> None:
    with pytest.raises(
        ValueError,
        match=r"the model has no layer K-FAC can precondition.*"
        r"'0': 'LayerNorm is not supported'",
    ):
        KFAC(nn.Sequential(nn.LayerNorm(3)))
    with pytest.raises(ValueError, match="no layer K-FAC can precondition"):
        KFAC(nn.Sequential(nn.Linear(2, 2)), skip_layers=["linear"])
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str"):
        KFAC("model")  # type: ignore[arg-type]


def test_sparse_embedding_is_refused() -> None:
    with pytest.raises(ValueError, match=r"layer '0': nn.Embedding\(sparse=True\) gives sparse"):
        KFAC(nn.Sequential(nn.Embedding(4, 2, sparse=True)))


def test_functional_child_cannot_be_forced_in() -> None:
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2)})
    with pytest.raises(ValueError, match=r"Invalid modules entry 'attn.out_proj': its parent"):
        KFAC(model, modules=["attn.out_proj"])


def test_callable_returning_bad_value_raises_at_step_before_grads_change() -> None:
    model = mlp()
    k = KFAC(model, damping=lambda s: -1.0)
    model(torch.randn(4, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(
        ValueError, match=r"Invalid damping=-1.0.*returned by the callable damping at step 0"
    ):
        k.step()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    assert k.steps == 0


def test_hybrid_fraction_must_divide_world() -> None:
    cfg = KFACConfig(grad_worker_fraction=0.75)
    with pytest.raises(ValueError, match=r"grad_worker_fraction=0.75 for 4 ranks: it gives 3"):
        cfg.grad_workers(4)
    assert cfg.grad_workers(1) == 1
    assert KFACConfig(grad_worker_fraction="mem-opt").grad_workers(8) == 1
    assert KFACConfig(grad_worker_fraction=0.5).grad_workers(8) == 4


def test_assignment_and_damping_rule_arguments() -> None:
    with pytest.raises(ValueError, match=r"Invalid world_size=0: must be an integer >= 1"):
        assign_work({"a": 1.0}, 0, 1)
    with pytest.raises(ValueError, match=r"Invalid grad_workers=3: must be a divisor of"):
        assign_work({"a": 1.0}, 4, 3)
    with pytest.raises(ValueError, match=r"Invalid damping_adaptation_interval=0"):
        LMDampingRule(interval=0)
    with pytest.raises(ValueError, match=r"Invalid damping_adaptation_decay=1.0"):
        LMDampingRule(decay=1.0)
    with pytest.raises(ValueError, match=r"Invalid min_damping=1.0, max_damping=0.1"):
        LMDampingRule(min_damping=1.0, max_damping=0.1)


def test_optimizer_arguments() -> None:
    model = mlp()
    opt = KFACOptimizer(model, adaptive_damping=True)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"adaptive_damping needs step\(closure\)"):
        opt.step()


def test_load_state_dict_checks_everything_first() -> None:
    k = KFAC(mlp())
    good = k.state_dict()
    with pytest.raises(ValueError, match=r"lacks \['steps'\]"):
        k.load_state_dict({"layers": {}})
    with pytest.raises(ValueError, match=r"holds layers \['0'\] but this model's"):
        k.load_state_dict({"steps": 3, "layers": {"0": {}}})
    bad = {"steps": 5, "layers": {"0": {"A": torch.eye(2)[None], "G": torch.eye(4)[None]}, "2": {}}}
    with pytest.raises(ValueError, match=r"layer '0' factor A has shape \(1, 2, 2\), expected"):
        k.load_state_dict(bad)
    assert k.steps == 0 and good["steps"] == 0
    with pytest.raises(ValueError, match="has no 'kfac' entry"):
        KFACOptimizer(mlp()).load_state_dict({"state": {}, "param_groups": []})


def test_reducer_collective_arguments_on_one_process() -> None:
    r = LocalReducer()
    with pytest.raises(ValueError, match=r"Invalid src=1: a single process has only"):
        r.broadcast_from_([torch.zeros(1)], 1)
    with pytest.raises(ValueError, match=r"Invalid groups=\[\[0, 1\]\]: must be non-empty"):
        r.split([[0, 1]])


def _trained(compute_method: str = "eigen", **kw: Any) -> tuple[nn.Sequential, KFACOptimizer]:
    model = mlp()
    opt = KFACOptimizer(model, compute_method=compute_method, **kw)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_next_steps_schedule_value_is_checked_before_anything_changes() -> None:
    model = mlp()
    k = KFAC(model, factor_update_steps=lambda s: 1 if s < 1 else 0, kl_clip=None)
    model(torch.randn(4, 3)).sum().backward()
    state = k.state_dict()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(
        ValueError,
        match=r"Invalid factor_update_steps=0.*returned by the callable factor_update_steps "
        r"at step 1",
    ):
        k.step()
    assert _same(k.state_dict(), state) and k.steps == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_optimizer_load_refused_by_sgd_part_changes_neither_part() -> None:
    _, source = _trained()
    _, opt = _trained()
    bad = source.state_dict()
    bad["param_groups"] = [*bad["param_groups"], dict(bad["param_groups"][0], params=[99])]
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"different number of parameter groups"):
        opt.load_state_dict(bad)
    assert _same(opt.state_dict(), before)
    # a bad K-FAC part leaves the SGD part (momentum buffers) alone too
    bad = source.state_dict()
    bad["kfac"] = dict(bad["kfac"], steps=-1)
    with pytest.raises(ValueError, match=r"K-FAC state_dict: steps=-1 must be an integer >= 0"):
        opt.load_state_dict(bad)
    assert _same(opt.state_dict(), before)


def test_load_state_dict_checks_decompositions_and_factor_pairs_first() -> None:
    _, eigen = _trained("eigen")
    _, inverse = _trained("inverse")
    k = inverse.kfac
    before = k.state_dict()
    with pytest.raises(
        ValueError,
        match=r"layer '0' holds decomposition \['QA', 'QG', 'dA', 'dG'\], which "
        r"compute_method='inverse' cannot use",
    ):
        k.load_state_dict(eigen.kfac.state_dict())
    assert _same(k.state_dict(), before)
    good = eigen.kfac.state_dict()
    # layer '0' is fine, layer '2' lacks G: nothing may be loaded
    bad = dict(good, layers={"0": good["layers"]["0"], "2": {"A": good["layers"]["2"]["A"]}})
    with pytest.raises(ValueError, match=r"layer '2' has factor A but no G: both or neither"):
        eigen.kfac.load_state_dict(bad)
    assert _same(eigen.kfac.state_dict(), good)
    wrong = {k_: v.clone() for k_, v in good["layers"]["2"]["inv"].items()}
    wrong["dG"] = wrong["dG"][..., :1]
    bad = dict(good, layers={"0": good["layers"]["0"], "2": dict(good["layers"]["2"], inv=wrong)})
    with pytest.raises(
        ValueError, match=r"layer '2' decomposition dG has shape \(1, 1\), expected"
    ):
        eigen.kfac.load_state_dict(bad)
    with pytest.raises(
        ValueError, match=r"K-FAC state_dict: damping_override=-1.0 must be a finite number > 0"
    ):
        eigen.kfac.load_state_dict(dict(good, damping_override=-1.0))
    assert _same(eigen.kfac.state_dict(), good)
