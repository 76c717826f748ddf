"""Issue 15: LM steps that would silently go wrong, or leave state behind when they fail.

Faults are injected at a chosen call of the residual function.  With the per-sample
``"reverse"`` Jacobian and ``slice_size=10`` on a batch of 40, the first step of an input
signature calls it once to validate the batch (call 1), three times to check the forced
strategy on a probe of the first slice (calls 2-4), once per slice to linearise (calls
5-8) and once per slice for every trial point (9-12 for the first attempt, 13-16 for the
second, ...); a later step of the same signature has no probe (its calls are 3 lower);
see ``test_call_schedule`` in ``test_hardening.py``.  The references are the parameters
and ``state_dict()`` before the step (bitwise) and an optimizer that never saw the fault.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.checkpoint import entries

F64 = torch.float64
BATCH, SLICE = 40, 10
PROBE_CALLS = 3  # the first step of a signature only
FIRST_TRIAL = 6 + PROBE_CALLS
SECOND_TRIAL = 10 + PROBE_CALLS


def params_of(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_params_bitwise(model: nn.Module, before: list[Tensor]) -> None:
    now = [p.detach() for p in model.parameters()]
    assert len(now) == len(before)
    assert all(torch.equal(p, q) for p, q in zip(now, before, strict=True)), "parameters changed"


def assert_state_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two optimizer state dicts are equal, tensors compared bitwise."""
    ea, eb = entries(a), entries(b)
    assert ea.keys() == eb.keys()
    for k in ea:
        x, y = ea[k], eb[k]
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            assert isinstance(x, Tensor) and isinstance(y, Tensor), k
            assert x.dtype == y.dtype and torch.equal(x, y), k
        else:
            assert x == y, k


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)


def sine_data() -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1, 1, BATCH, dtype=F64).reshape(-1, 1)
    return x, torch.sin(3 * x)


class Injected:
    """``outputs - targets``, changed at chosen (1-based) calls.

    ``plan`` maps a call number, or ``"trials"`` (every call after the linearisation),
    to ``"double"``, ``"zero"``, ``"shrink"``, ``"raise"`` or ``"interrupt"``.
    """

    def __init__(self, plan: dict[Any, str] | None = None) -> None:
        self.plan = dict(plan or {})
        self.calls = 0

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        self.calls += 1
        r = outputs - targets
        kind = self.plan.get(self.calls)
        if kind is None and self.calls >= FIRST_TRIAL:
            kind = self.plan.get("trials")
        if kind == "double":
            return torch.cat([r, r])
        if kind == "zero":
            return r[:0]
        if kind == "shrink":
            return r[: len(r) // 2]
        if kind == "raise":
            raise RuntimeError(f"injected failure at residual call {self.calls}")
        if kind == "interrupt":
            raise KeyboardInterrupt(f"injected interrupt at residual call {self.calls}")
        return r


def lm(model: nn.Module, residual_fn: Any, **options: Any) -> so.LevenbergMarquardt:
    options.setdefault("slice_size", SLICE)
    options.setdefault("jacobian", "reverse")
    return so.LevenbergMarquardt(model, residual_fn, **options)


# -- item 2: the number of residuals changes between linearisation and trial -------------------


@pytest.mark.parametrize(
    ("plan", "trial"),
    [
        ({"trials": "double"}, 80),
        ({"trials": "zero"}, 0),
        ({"trials": "shrink"}, 20),
        ({FIRST_TRIAL + 1: "shrink"}, 35),  # one slice only
    ],
)
@pytest.mark.parametrize("form", ["primal", "dual"])
def test_residual_count_change_at_trial_raises_and_changes_nothing(plan, trial, form):
    x, y = sine_data()
    model = mlp()
    reference = copy.deepcopy(model)
    res = Injected(plan)
    opt = lm(model, res, form=form, damping_matrix="more")
    before, state = params_of(model), opt.state_dict()
    match = f"returned {trial} residuals at a trial point but 40 at the linearisation"
    with pytest.raises(ValueError, match=match):
        opt.step(x, y)
    assert_params_bitwise(model, before)
    assert_state_bitwise(opt.state_dict(), state)
    # The next, clean step is bitwise the step of an optimizer that never saw the fault.
    res.plan = {}
    res.calls = 0
    info = opt.step(x, y)
    ref_info = lm(reference, Injected(), form=form, damping_matrix="more").step(x, y)
    assert info.accepted and (info.loss, info.damping) == (ref_info.loss, ref_info.damping)
    assert_params_bitwise(model, params_of(reference))


def test_residual_count_change_at_second_attempt_leaves_damping_alone():
    """A trial that is rejected first (λ raised), then a count change: λ is restored."""
    x, y = sine_data()
    model = mlp()
    # Attempt 1: residuals blown up so the loss rises (rejected, λ raised); attempt 2:
    # half the residuals.
    res = Injected({SECOND_TRIAL: "shrink"})
    res_scale = {FIRST_TRIAL + i: 1e3 for i in range(4)}

    def residual(outputs: Tensor, targets: Tensor) -> Tensor:
        r = res(outputs, targets)
        return r * res_scale.get(res.calls, 1.0)

    opt = lm(model, residual, damping_rule="nielsen")
    before, state = params_of(model), opt.state_dict()
    with pytest.raises(ValueError, match="returned 35 residuals at a trial point but 40"):
        opt.step(x, y)
    assert res.calls == SECOND_TRIAL + 3  # the second attempt ran (the first was rejected)
    assert_params_bitwise(model, before)
    assert_state_bitwise(opt.state_dict(), state)


def rank_count_change(rank: int, world: int) -> tuple[str, bool, bool, float, str]:
    """Rank 1's residual count doubles at the first trial, then its model changes.

    Every rank must raise each time, and the group must stay usable.
    """
    x, y = sine_data()
    share = BATCH // world
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    model = mlp()
    # Call 1 validates, calls 2-4 check the forced strategy on a probe, call 5
    # linearises the one slice, call 6 is the first trial.
    res = Injected({6: "double"} if rank == 1 else {})
    opt = lm(model, res, slice_size=share)
    before, state = params_of(model), opt.state_dict()
    message = ""
    try:
        opt.step(xs, ys)
    except ValueError as exc:
        message = str(exc)
    same_params = all(
        torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before, strict=True)
    )
    assert_state_bitwise(opt.state_dict(), state)
    # The group is still usable: a clean step on every rank.
    res.plan = {}
    info = opt.step(xs, ys)
    # Item 3 in the same launch: rank 1 replaces a parameter; every rank must raise.
    original = model[0].weight
    if rank == 1:
        _replace_weight(model)
    changed = ""
    try:
        opt.step(xs, ys)
    except (RuntimeError, ValueError) as exc:
        changed = str(exc)
    model[0].weight = original
    opt.step(xs, ys)  # and the group still works
    return message, same_params, info.accepted, info.loss, changed


@pytest.mark.distributed
def test_count_or_model_change_on_one_rank_raises_on_every_rank():
    from secondorder.testing import run_ranks

    results = {r: v.unwrap() for r, v in run_ranks(rank_count_change, 2).items()}
    x, y = sine_data()
    reference = lm(mlp(), Injected(), slice_size=BATCH).step(x, y)
    assert (
        "the model changed after the optimizer was built: parameter '0.weight'" in (results[1][4])
    )
    assert "rejected the batch on rank(s) [1] of 2" in results[0][4]
    for message, same_params, accepted, loss, _ in results.values():
        want = "returned 60 residuals at a trial point but 40 at the linearisation of the batch"
        assert want in message
        assert same_params and accepted
        # The single process on the concatenated batch, up to the order of the sums.
        assert loss == pytest.approx(reference.loss, rel=1e-9)


# -- item 7: a failure in a later attempt leaves λ and the damping rule's state alone -----------


@pytest.mark.parametrize("kind", ["raise", "interrupt"])
@pytest.mark.parametrize(("rule", "matrix"), [("nielsen", "more"), ("multiplicative", "marquardt")])
@pytest.mark.parametrize("slice_in_attempt", [0, 3])
def test_failure_in_second_attempt_restores_damping_state(kind, rule, matrix, slice_in_attempt):
    x, y = sine_data()
    model = mlp()
    # The faulty step is the signature's second: no probe, so its calls are 3 lower.
    call = SECOND_TRIAL - PROBE_CALLS + slice_in_attempt
    res = Injected()
    blown = {FIRST_TRIAL - PROBE_CALLS + i: 1e3 for i in range(BATCH // SLICE)}
    seen_damping: list[float] = []

    def residual(outputs: Tensor, targets: Tensor) -> Tensor:
        if res.calls + 1 == SECOND_TRIAL - PROBE_CALLS:
            # The second attempt starts: the first was rejected and λ raised.
            seen_damping.append(opt.damping)
        r = res(outputs, targets)
        return r * blown.get(res.calls, 1.0)

    opt = lm(model, residual, damping_rule=rule, damping_matrix=matrix)
    opt.step(x, y)  # a clean first step, so ν, Moré's scale and the count are set
    state_obj = opt.internals().damping_state
    before, state = params_of(model), opt.state_dict()
    res.calls, res.plan, seen_damping[:] = 0, {call: kind}, []
    exc = RuntimeError if kind == "raise" else KeyboardInterrupt
    with pytest.raises(exc, match=f"injected (failure|interrupt) at residual call {call}"):
        opt.step(x, y)
    assert seen_damping and seen_damping[0] > state["state"][0]["damping"]
    assert_params_bitwise(model, before)
    assert_state_bitwise(opt.state_dict(), state)
    assert opt.internals().damping_state is state_obj


# -- item 3: the model changes after the optimizer was built -----------------------------------


def _replace_weight(m: nn.Module) -> None:
    m[0].weight = nn.Parameter(m[0].weight.detach() + 1.0)


def _replace_layer(m: nn.Module) -> None:
    m[2] = nn.Linear(8, 1).to(F64)


def _freeze(m: nn.Module) -> None:
    m[0].bias.requires_grad_(False)


def _reshape(m: nn.Module) -> None:
    m[2].bias.data = torch.zeros(2, dtype=F64)


def _to_float32(m: nn.Module) -> None:
    m.float()


def _remove_bias(m: nn.Module) -> None:
    m[2].bias = None


CHANGES = {
    "replaced parameter": (
        _replace_weight,
        "parameter '0.weight' was replaced by another Parameter object",
    ),
    "replaced layer": (_replace_layer, "parameter '2.weight' was replaced by another Parameter"),
    "frozen": (_freeze, r"parameter '0.bias' no longer requires grad \(requires_grad_\(False\)\)"),
    "reshaped": (_reshape, r"parameter '2.bias' changed shape from \(1,\) to \(2,\)"),
    "dtype": (_to_float32, "parameter '0.weight' moved from torch.float64 on cpu to torch.float32"),
    "removed": (_remove_bias, "parameter '2.bias' is no longer in the model"),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("call", ["step", "plan"])
def test_model_changed_after_construction_is_refused(change, call):
    x, y = sine_data()
    model = mlp()
    opt = lm(model, Injected())
    opt.step(x, y)
    old_params = list(opt.param_groups[0]["params"])
    state = opt.state_dict()
    edit, why = CHANGES[change]
    edit(model)
    # After the edit: a reshape or a dtype change edits the old Parameter objects.
    before, changed = [p.detach().clone() for p in old_params], params_of(model)
    match = f"the model changed after the optimizer was built: {why}.*build a new optimizer"
    with pytest.raises(RuntimeError, match=match):
        getattr(opt, call)(x.to(next(model.parameters()).dtype), y)
    # Neither the tensors it was built on nor the model's new ones were touched.
    assert all(torch.equal(p.detach(), q) for p, q in zip(old_params, before, strict=True))
    assert_params_bitwise(model, changed)
    assert_state_bitwise(opt.state_dict(), state)


def test_parameter_that_became_trainable_is_refused():
    x, y = sine_data()
    model = mlp()
    model[0].bias.requires_grad_(False)
    opt = lm(model, Injected())
    model[0].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameter '0\.bias' is new or became trainable"):
        opt.step(x, y)


def test_undoing_the_change_gives_the_step_of_an_untouched_optimizer():
    """The check refuses only real changes: put the Parameter back and the step is the same."""
    x, y = sine_data()
    model, reference = mlp(), mlp()
    opt = lm(model, Injected())
    original = model[0].weight
    _replace_weight(model)
    with pytest.raises(RuntimeError, match=r"'0\.weight' was replaced"):
        opt.step(x, y)
    model[0].weight = original
    info, ref = opt.step(x, y), lm(reference, Injected()).step(x, y)
    assert info.accepted and (info.loss, info.damping) == (ref.loss, ref.damping)
    assert_params_bitwise(model, params_of(reference))


def test_replicas_are_not_left_stale_after_a_refused_change():
    x, y = sine_data()
    model = mlp()
    opt = lm(model, Injected(), devices=["cpu", "cpu"])
    opt.step(x, y)
    replica = opt.replicas[1]
    replica_before = params_of(replica)
    _replace_layer(model)
    with pytest.raises(RuntimeError, match=r"parameter '2\.weight' was replaced"):
        opt.step(x, y)
    assert_params_bitwise(replica, replica_before)


def test_add_param_group_is_refused():
    model = mlp()
    opt = lm(model, Injected())
    extra = nn.Parameter(torch.zeros(3, dtype=F64))
    state = opt.state_dict()
    with pytest.raises(NotImplementedError, match="add_param_group is not supported: LM optimizes"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1
    assert_state_bitwise(opt.state_dict(), state)


@pytest.mark.parametrize("edit", ["append group", "append parameter"])
def test_param_groups_edited_by_hand_is_refused(edit):
    x, y = sine_data()
    model = mlp()
    opt = lm(model, Injected())
    extra = nn.Parameter(torch.zeros(3, dtype=F64))
    if edit == "append group":
        opt.param_groups.append({"params": [extra], "lr": 1.0})
    else:
        opt.param_groups[0]["params"].append(extra)
    before = params_of(model)
    with pytest.raises(RuntimeError, match=r"param_groups was changed after the optimizer was"):
        opt.step(x, y)
    assert_params_bitwise(model, before)
