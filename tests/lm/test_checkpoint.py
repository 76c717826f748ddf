"""Checkpoints in torch.optim's schema (format 2), format 1 still loading, and internals().

References: a run that never stopped (resumed optimizers must step in lockstep with it,
bitwise), a checkpoint file written by secondorder before format 2, torch.func for the
problem ``internals()`` exposes, and the closed form of the λ-after-failure rule.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import secondorder as so
from secondorder.lm import LMInternals
from secondorder.lm.checkpoint import STATE_FORMAT_VERSION, as_format1, entries, saved_settings
from secondorder.lm.damping import DampingState, make_damping_rule, raise_damping

F64 = torch.float64
FORMAT1_FILE = Path(__file__).parent / "data" / "lm_state_format1.pt"
# What the checkpoint file was made with (by secondorder before format 2).
FORMAT1_OPTIONS: dict[str, Any] = {
    "damping_matrix": "more",
    "damping_rule": "multiplicative",
    "jacobian": "auto",
}


def small() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.linspace(-2, 2, 8, dtype=F64)[:, None]
    return model, x, torch.sin(2 * x)


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)
    return loaded


def assert_lockstep(
    a: so.LevenbergMarquardt, b: so.LevenbergMarquardt, x: Tensor, y: Tensor
) -> None:
    """Both optimizers take the same steps, bit for bit, for several steps."""
    for _ in range(4):
        ia, ib = a.step(x, y), b.step(x, y)
        assert (ia.loss, ia.damping, ia.attempts, ia.accepted, ia.reason) == (
            ib.loss,
            ib.damping,
            ib.attempts,
            ib.accepted,
            ib.reason,
        )
        assert torch.equal(flat(a.model), flat(b.model))
    assert a.damping == b.damping


def test_state_dict_has_torch_optim_schema() -> None:
    model, x, y = small()
    opt = so.LevenbergMarquardt(model, damping_matrix="more", lr=0.5)
    opt.step(x, y)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "format_version"}
    assert sd["format_version"] == STATE_FORMAT_VERSION == 2
    assert list(sd["state"]) == [0]
    assert set(sd["state"][0]) == {"damping", "nu", "scale", "steps", "auto_jacobian"}
    assert sd["state"][0]["damping"] == opt.damping and sd["state"][0]["steps"] == 1
    (group,) = sd["param_groups"]
    assert group["params"] == [0, 1, 2, 3] and group["lr"] == 0.5
    assert group["num_parameters"] == 13 and group["parameter_shapes"] == [[4, 1], [4], [1, 4], [1]]
    assert group["config"]["damping_matrix"] == "more"
    torch.testing.assert_close(sd["state"][0]["scale"], opt.internals().damping_state.scale)


@pytest.mark.parametrize("fmt", ["format2", "format1"])
def test_reloaded_optimizer_steps_in_lockstep(fmt: str) -> None:
    model, x, y = small()
    opt = so.LevenbergMarquardt(model, **FORMAT1_OPTIONS)
    for _ in range(3):
        opt.step(x, y)
    sd = opt.state_dict() if fmt == "format2" else as_format1(opt.state_dict())
    ckpt = roundtrip({"model": model.state_dict(), "optimizer": sd})
    clone = small()[0]
    clone.load_state_dict(ckpt["model"])
    resumed = so.LevenbergMarquardt(clone, **FORMAT1_OPTIONS)
    resumed.load_state_dict(ckpt["optimizer"])
    after = resumed.state_dict()
    assert after["format_version"] == 2  # format 1 loads, format 2 is written
    assert torch.equal(entries(after)["scale"], entries(sd)["scale"])
    assert {k: v for k, v in entries(after).items() if k != "scale"} == {
        k: v for k, v in entries(sd).items() if k != "scale"
    }
    assert_lockstep(opt, resumed, x, y)


def test_checkpoint_file_of_format1_loads() -> None:
    """A file saved by secondorder before format 2 restores exactly what it holds."""
    ckpt = torch.load(FORMAT1_FILE, weights_only=True)
    old = ckpt["optimizer"]
    assert old["format_version"] == 1 and "state" not in old
    model, x, y = small()
    model.load_state_dict(ckpt["model"])
    # The file's own settings (robust to later changes of the defaults).
    settings = saved_settings(old)
    assert FORMAT1_OPTIONS.items() <= settings.items()
    opt = so.LevenbergMarquardt(model, **settings)
    opt.load_state_dict(old)
    new = entries(opt.state_dict())
    assert torch.equal(new.pop("scale"), old["scale"])
    assert new == {k: v for k, v in old.items() if k not in ("format_version", "scale")}
    # The same checkpoint in format 2 resumes the same run.
    twin_model = small()[0]
    twin_model.load_state_dict(ckpt["model"])
    twin = so.LevenbergMarquardt(twin_model, **settings)
    twin.load_state_dict(roundtrip(opt.state_dict()))
    assert_lockstep(opt, twin, x, y)


@pytest.mark.parametrize("key", ["damping", "nu", "steps", "scale", "auto_jacobian"])
def test_format2_missing_state_entry_is_refused_naming_it(key: str) -> None:
    model, x, y = small()
    opt = so.LevenbergMarquardt(model, damping_matrix="more")
    opt.step(x, y)  # Moré's scale is a tensor now
    sd = opt.state_dict()
    sd["state"][0].pop(key)
    before = opt.state_dict()
    with pytest.raises(KeyError, match=key):
        opt.load_state_dict(sd)
    after = entries(opt.state_dict())
    assert torch.equal(after.pop("scale"), entries(before).pop("scale"))
    assert after == {k: v for k, v in entries(before).items() if k != "scale"}


def clone_tree(tree: Any) -> Any:
    """A deep copy of a state dict; tensors cloned."""
    if isinstance(tree, Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone_tree(v) for v in tree]
    return tree


def assert_same_tree(a: Any, b: Any) -> None:
    """Equal structure and values; tensors bitwise (torch.equal) with the same dtype."""
    assert type(a) is type(b)
    if isinstance(a, Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert_same_tree(u, v)
    else:
        assert a == b


def set_entry(sd: dict[str, Any], where: str, value: Any) -> None:
    """``where``: "state.KEY", "group.KEY" or "config.KEY" of the format-2 dict."""
    part, key = where.split(".")
    target = {
        "state": sd["state"][0],
        "group": sd["param_groups"][0],
        "config": sd["param_groups"][0]["config"],
    }[part]
    target[key] = value


N = 13  # parameters of small()
BAD_ENTRIES = [
    (
        "state.damping",
        math.nan,
        ValueError,
        r"state_dict has damping=nan: must be a finite number >= 0",
    ),
    (
        "state.damping",
        "0.1",
        ValueError,
        r"state_dict has damping='0.1': must be a finite number >= 0",
    ),
    (
        "state.damping",
        1e13,
        ValueError,
        r"state_dict has damping=1e\+13: must be <= damping_max=1e\+12",
    ),
    ("state.nu", -1.0, ValueError, r"state_dict has nu=-1.0: must be a finite number >= 2"),
    ("state.nu", math.inf, ValueError, r"state_dict has nu=inf: must be a finite number >= 2"),
    ("state.steps", 1.5, ValueError, r"state_dict has steps=1.5: must be an integer >= 0"),
    (
        "group.lr",
        math.inf,
        ValueError,
        r"state_dict has param_groups\[0\]\['lr'\]=inf: must be a finite number > 0",
    ),
    (
        "group.lr",
        "0.5",
        ValueError,
        r"state_dict has param_groups\[0\]\['lr'\]='0.5': must be a finite number > 0",
    ),
    (
        "group.lr",
        0.0,
        ValueError,
        r"state_dict has param_groups\[0\]\['lr'\]=0.0: must be a finite number > 0",
    ),
    (
        "state.scale",
        torch.full((N,), math.nan, dtype=F64),
        ValueError,
        r"scale with 13 of 13 entries NaN, infinite or negative",
    ),
    (
        "state.scale",
        -torch.ones(N, dtype=F64),
        ValueError,
        r"scale with 13 of 13 entries NaN, infinite or negative",
    ),
    (
        "state.scale",
        torch.ones(N + 1, dtype=F64),
        ValueError,
        r"scale of shape \(14,\): must have shape \(13,\)",
    ),
    (
        "state.scale",
        torch.ones(N, dtype=torch.int64),
        ValueError,
        r"scale of dtype torch.int64: must be a floating tensor of 13",
    ),
    ("state.scale", [1.0] * N, ValueError, r"scale of list: must be a floating tensor of 13"),
    (
        "state.auto_jacobian",
        {"sig": "sideways"},
        ValueError,
        r"auto_jacobian=\{'sig': 'sideways'\}: must map input signatures",
    ),
    (
        "config.damping_matrix",
        "marquardt",
        ValueError,
        r"damping_matrix='marquardt' in the checkpoint, 'more' here",
    ),
    (
        "config.damping_rule",
        "multiplicative",
        ValueError,
        r"damping_rule='multiplicative' in the checkpoint, 'nielsen' here",
    ),
    (
        "config.max_attempts",
        5,
        ValueError,
        r"max_attempts=5 in the checkpoint, 10 here.*saved_settings\(state_dict\)\).*strict=False",
    ),
    (
        "config.gram_dtype",
        "torch.float64",
        ValueError,
        r"gram_dtype='torch.float64' in the checkpoint, 'auto' here",
    ),
    (
        "config.from_the_future",
        1,
        ValueError,
        r"from_the_future=1 in the checkpoint, not a setting of this secondorder",
    ),
    ("group.config", None, ValueError, r"state_dict has config=None: must be a dict of settings"),
    ("group.num_parameters", 12, ValueError, r"state_dict is for a model with 12 parameters"),
]


@pytest.mark.parametrize(("where", "value", "error", "pattern"), BAD_ENTRIES)
def test_refused_checkpoint_leaves_optimizer_and_model_as_before(
    where: str, value: Any, error: type[Exception], pattern: str
) -> None:
    """Every bad entry is refused before anything changes: state_dict() and the model bitwise."""
    model, x, y = small()
    opt = so.LevenbergMarquardt(model, damping_matrix="more")
    for _ in range(2):
        opt.step(x, y)  # Moré's scale is a tensor, λ, ν and steps moved
    other = small()[0]
    donor = so.LevenbergMarquardt(other, damping_matrix="more", lr=0.25)
    donor.step(x * 0.5, y)  # a valid checkpoint whose every entry differs from opt's
    sd = clone_tree(donor.state_dict())
    set_entry(sd, where, value)
    before, params = clone_tree(opt.state_dict()), clone_tree(list(model.state_dict().values()))
    with pytest.raises(error, match=pattern):
        opt.load_state_dict(sd)
    assert_same_tree(opt.state_dict(), before)
    assert_same_tree(list(model.state_dict().values()), params)
    # The optimizer still steps as one that never saw the checkpoint.
    twin_model = small()[0]
    twin_model.load_state_dict(model.state_dict())
    twin = so.LevenbergMarquardt(twin_model, damping_matrix="more")
    twin.load_state_dict(before)
    assert_lockstep(opt, twin, x, y)


def test_the_same_checkpoint_unmodified_loads() -> None:
    """The control of the test above: the donor's checkpoint itself is accepted, exactly."""
    model, x, y = small()
    opt = so.LevenbergMarquardt(model, damping_matrix="more")
    donor = so.LevenbergMarquardt(small()[0], damping_matrix="more", lr=0.25)
    donor.step(x * 0.5, y)
    sd = donor.state_dict()
    opt.load_state_dict(clone_tree(sd))
    # The state and lr come from the checkpoint; config records this optimizer's lr=1.
    mine, theirs = entries(opt.state_dict()), entries(sd)
    assert mine.pop("config")["lr"] == 1.0 and theirs.pop("config")["lr"] == 0.25
    assert_same_tree(mine, theirs)


def test_strict_false_keeps_our_settings_but_not_another_damping_matrix() -> None:
    model, x, y = small()
    saved = so.LevenbergMarquardt(model, damping_matrix="more", max_attempts=5, xtol=0.0)
    saved.step(x, y)
    sd = saved.state_dict()
    opt = so.LevenbergMarquardt(small()[0], damping_matrix="more")
    with pytest.raises(ValueError, match=r"max_attempts=5 in the checkpoint, 10 here; xtol=0.0"):
        opt.load_state_dict(sd)
    opt.load_state_dict(sd, strict=False)
    assert opt.config.max_attempts == 10 and opt.damping == saved.damping
    assert_same_tree(entries(opt.state_dict())["scale"], entries(sd)["scale"])
    plain = so.LevenbergMarquardt(small()[0])
    message = r"damping_matrix='more' in the checkpoint, 'marquardt' here\. Build the optimizer"
    with pytest.raises(ValueError, match=message):
        plain.load_state_dict(sd, strict=False)


def test_saved_settings_rebuild_an_optimizer_that_resumes_the_run() -> None:
    model, x, y = small()
    opt = so.LevenbergMarquardt(
        model, damping_rule="multiplicative", damping_up=4.0, gram_dtype=torch.float64
    )
    for _ in range(2):
        opt.step(x, y)
    sd = roundtrip(opt.state_dict())
    settings = saved_settings(sd)
    assert settings["gram_dtype"] is torch.float64 and settings["damping_up"] == 4.0
    clone = small()[0]
    clone.load_state_dict(model.state_dict())
    resumed = so.LevenbergMarquardt(clone, **settings)
    resumed.load_state_dict(sd)
    assert_lockstep(opt, resumed, x, y)
    with pytest.raises(ValueError, match=r"state_dict holds no settings \(config=None\)"):
        saved_settings({"format_version": 1, "config": None})


def test_constructor_refuses_damping_above_its_maximum() -> None:
    with pytest.raises(ValueError, match=r"Invalid damping=10.0 > damping_max=1.0: the initial"):
        so.LevenbergMarquardt(small()[0], damping=10.0, damping_max=1.0)


def test_format2_of_another_model_and_unknown_version_are_refused() -> None:
    opt = so.LevenbergMarquardt(small()[0])
    other = so.LevenbergMarquardt(nn.Linear(2, 3).double())
    with pytest.raises(ValueError, match=r"state_dict is for a model with 9 parameters"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(
        ValueError, match=r"format_version=3; this secondorder reads versions 1 and 2"
    ):
        opt.load_state_dict({**opt.state_dict(), "format_version": 3})


# -- internals() -------------------------------------------------------------------------------


def test_internals_expose_the_last_problem_and_the_live_damping_state() -> None:
    model, x, y = small()
    opt = so.LevenbergMarquardt(model, damping_matrix="identity")
    assert opt.internals().problem is None
    info = opt.step(x, y)
    parts = opt.internals()
    assert isinstance(parts, LMInternals)
    with pytest.raises(AttributeError):
        parts.problem = None  # type: ignore[misc]
    prob = parts.problem
    assert prob is not None
    assert (prob.form, prob.solver.name, prob.strategy.name) == (
        info.form,
        info.solver,
        info.jacobian,
    )
    assert prob.params == list(model.parameters())
    assert parts.damping_state.damping == opt.damping == info.damping
    assert parts.damping_rule.name == "nielsen"
    # The problem at the model's current point against torch.func.
    xv = flat(model)
    names = [k for k, _ in model.named_parameters()]

    def residuals(v: Tensor) -> Tensor:
        params = dict(
            zip(names, torch.split(v, [p.numel() for p in model.parameters()]), strict=True)
        )
        params = {k: t.view_as(dict(model.named_parameters())[k]) for k, t in params.items()}
        return (functional_call(model, params, (x,)) - y).reshape(-1)

    r, jac = residuals(xv), jacrev(residuals)(xv)
    system = prob.linearize(xv)
    torch.testing.assert_close(system.grad, jac.T @ r, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(prob.loss_sum(xv), torch.dot(r, r), rtol=1e-13, atol=0)
    assert sum(a.shape[0] for a, _ in prob.slices()) == x.shape[0]
    assert set(prob.unflatten(xv)) == set(names)
    d = parts.damping_matrix.diagonal(system.col_sq, parts.damping_state)
    assert torch.equal(d, torch.ones_like(system.col_sq))  # identity: D = I


# -- the λ-after-failure rule -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "restart", "ceiling", "expected"),
    [
        (0.0, 1e-3, None, 1e-3),  # the attempt loop: a rejected Gauss-Newton step restarts
        (0.0, None, 1e12, 1e-12),  # a non-finite linearisation: λ = 0 rises to damping_min
        (1.0, 1e-3, None, 10.0),  # multiplicative up-factor 10
        (1e12, None, 1e12, 1e12),  # clamped at damping_max
        (1e12, 1e-3, None, 1e13),  # left above the maximum for the caller to stop
    ],
)
def test_raise_damping_closed_form(
    start: float, restart: float | None, ceiling: float | None, expected: float
) -> None:
    state = DampingState(damping=start)
    rule = make_damping_rule("multiplicative", 10.0, 0.1)
    raise_damping(rule, state, damping_min=1e-12, damping_max=ceiling, restart=restart)
    assert state.damping == expected
