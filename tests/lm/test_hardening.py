"""Hardening: numerical faults, rank deficiency, checkpoints, interruptions.

Faults are injected for real, at a chosen stage of a step, by residual functions and
models that count their calls: with an explicit per-sample Jacobian and
``slice_size=10`` on a batch of 40, the first step of an input signature (the step
most tests here fault) calls the residual function once to validate the batch (call
1), three times to check the forced strategy on a probe of the first slice (calls 2-4,
autograd on; later steps of the signature skip it), once per slice to linearise (calls
5-8, autograd on) and once per slice for every trial point (calls 9-12 for the first
attempt, 13-16 for the second, ...).  ``test_call_schedule`` pins that schedule so the
other tests can rely on it.  Every test compares with a reference: the parameters
before the step (bitwise), a clean optimizer in the state the faulty one should be in, or
``torch.linalg.lstsq``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from unchanged import same_state

import secondorder as so
from secondorder.lm import optimizer as lm_module
from secondorder.lm.checkpoint import as_format1, entries

F64 = torch.float64
BATCH, SLICE = 40, 10
N_SLICES = BATCH // SLICE
VALIDATE_CALL = 1
PROBE_CALLS = range(2, 5)  # the first step of a signature only
LINEARIZE_CALLS = range(5, 5 + N_SLICES)  # 5..8
FIRST_TRIAL_CALLS = range(5 + N_SLICES, 5 + 2 * N_SLICES)  # 9..12


# -- helpers ---------------------------------------------------------------------------------


def params_of(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(model: nn.Module, before: list[Tensor]) -> None:
    now = list(model.parameters())
    assert len(now) == len(before)
    for p, q in zip(now, before, strict=True):
        assert torch.equal(p.detach(), q), "parameters changed"


def mlp(seed: int = 0, hidden: int = 8, dtype: torch.dtype = F64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)


def sine_data(batch: int = BATCH) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1, 1, batch, dtype=F64).reshape(-1, 1)
    return x, torch.sin(3 * x)


class FaultyResidual:
    """``outputs - targets``, with a fault injected at chosen (1-based) calls of a step.

    ``plan`` maps a call number to ``"nan"``, ``"inf"``, ``"raise"`` or
    ``"interrupt"``.  The counter is reset by :meth:`arm`.
    """

    def __init__(self, plan: dict[int, str] | None = None) -> None:
        self.arm(plan)

    def arm(self, plan: dict[int, str] | None = None) -> FaultyResidual:
        self.plan: dict[int, str] = dict(plan or {})
        self.calls = 0
        self.grad_enabled: list[bool] = []
        return self

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        self.calls += 1
        self.grad_enabled.append(torch.is_grad_enabled())
        r = outputs - targets
        kind = self.plan.get(self.calls)
        if kind == "nan":
            return r * math.nan
        if kind == "inf":
            return r + math.inf
        if kind == "raise":
            raise RuntimeError(f"injected failure at residual call {self.calls}")
        if kind == "interrupt":
            raise KeyboardInterrupt(f"injected interrupt at residual call {self.calls}")
        return r


class FailingNet(nn.Module):
    """A Tanh MLP whose forward raises ``exc`` on its ``fail_at``-th call."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.calls = 0
        self.fail_at: int | None = None
        self.exc: type[BaseException] = RuntimeError

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise self.exc(f"injected failure at forward call {self.calls}")
        out: Tensor = self.body(x)
        return out


def lm(model: nn.Module, residual_fn: Any = so.residuals.mse, **options: Any) -> Any:
    options.setdefault("slice_size", SLICE)
    options.setdefault("jacobian", "reverse")
    return so.LevenbergMarquardt(model, residual_fn, **options)


# -- the schedule the fault tests rely on ------------------------------------------------------


@pytest.mark.parametrize("jacobian", ["reverse", "forward"])
def test_call_schedule(jacobian):
    x, y = sine_data()
    res = FaultyResidual()
    info = lm(mlp(), res, jacobian=jacobian).step(x, y)
    assert info.accepted and info.attempts >= 1
    probe = len(PROBE_CALLS)
    assert res.calls == 1 + probe + N_SLICES + N_SLICES * info.attempts
    # validation (no grad), probe and linearisation (autograd), trials (no grad)
    assert res.grad_enabled == (
        [False] + [True] * (probe + N_SLICES) + [False] * N_SLICES * info.attempts
    )


# -- faults at the current point: one slice only ------------------------------------------------


@pytest.mark.parametrize("jacobian", ["reverse", "forward"])
@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("slice_index", [0, N_SLICES - 1])
def test_nonfinite_residuals_in_one_slice_are_rejected(jacobian, kind, slice_index):
    x, y = sine_data()
    model = mlp()
    res = FaultyResidual({LINEARIZE_CALLS[slice_index]: kind})
    opt = lm(model, res, jacobian=jacobian)
    before, lam0 = params_of(model), opt.damping
    info = opt.step(x, y)
    assert res.calls == 1 + len(PROBE_CALLS) + N_SLICES, "the step must stop after linearising"
    assert not info.accepted and info.attempts == 1 and not info.terminated
    assert "non-finite residuals or Jacobian" in info.reason
    assert not math.isfinite(info.loss)
    assert opt.damping == 2 * lam0  # Nielsen: λ·ν with ν = 2
    assert_bitwise(model, before)
    # The fault is gone: the next step is bitwise that of a clean optimizer at 2λ₀.
    res.arm()
    nxt = opt.step(x, y)
    ref = mlp()
    ref_info = lm(ref, jacobian=jacobian, damping=2 * lam0).step(x, y)
    assert nxt.accepted and nxt.loss < nxt.loss_before
    assert (nxt.loss, nxt.damping) == (ref_info.loss, ref_info.damping)
    assert_bitwise(model, params_of(ref))


def test_nan_targets_in_one_sample_of_one_slice():
    """A corrupt sample in the data: the same outcome as a faulty residual function."""
    x, y = sine_data()
    bad = y.clone()
    bad[SLICE + 3] = math.nan
    model = mlp()
    opt = lm(model)
    before, lam0 = params_of(model), opt.damping
    info = opt.step(x, bad)
    assert not info.accepted and "non-finite" in info.reason
    assert opt.damping > lam0
    assert_bitwise(model, before)
    assert opt.step(x, y).accepted


class JacobianPoison:
    """Finite residuals whose derivative is NaN for flagged samples.

    ``targets[:, 1] == 1`` flags a sample: ``0·sqrt(u)`` with ``u = 0`` there adds 0 to
    the residual but ``0·∞ = NaN`` to its derivative, in reverse and forward mode.
    """

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        y, flag = targets[:, :1], targets[:, 1:]
        return outputs - y + 0.0 * torch.sqrt((outputs - outputs) + 1.0 - flag)


@pytest.mark.parametrize("jacobian", ["reverse", "forward", "batch_reverse", "batch_forward"])
def test_nan_only_in_the_jacobian_is_rejected(jacobian):
    x, y = sine_data()
    flags = torch.zeros_like(y)
    flags[2 * SLICE + 5] = 1.0  # one sample of the third slice
    model = mlp()
    opt = lm(model, JacobianPoison(), jacobian=jacobian)
    with torch.no_grad():
        clean_loss = float(((model(x) - y) ** 2).mean())
    before, lam0 = params_of(model), opt.damping
    info = opt.step(x, torch.cat([y, flags], 1))
    assert not info.accepted and "non-finite residuals or Jacobian" in info.reason
    # The residuals themselves were finite: the loss is reported correctly.
    assert info.loss == pytest.approx(clean_loss, rel=1e-12)
    assert opt.damping > lam0
    assert_bitwise(model, before)
    nxt = opt.step(x, torch.cat([y, torch.zeros_like(y)], 1))
    assert nxt.accepted and nxt.loss < clean_loss


# -- faults at a trial point only -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("slice_index", [0, 2])
def test_nonfinite_at_one_trial_slice_ends_the_step_cleanly(kind, slice_index):
    x, y = sine_data()
    model = mlp()
    res = FaultyResidual({FIRST_TRIAL_CALLS[slice_index]: kind})
    opt = lm(model, res, max_attempts=1)
    before, lam0 = params_of(model), opt.damping
    info = opt.step(x, y)
    assert not info.accepted and info.attempts == 1
    assert info.reason == "1 attempts exhausted; last: non-finite residuals at the trial point"
    assert math.isfinite(info.loss) and info.loss == info.loss_before
    assert opt.damping == 2 * lam0  # Nielsen: λ·ν with ν = 2
    assert_bitwise(model, before)
    res.arm()
    assert opt.step(x, y).accepted


def test_trial_fault_then_success_equals_a_clean_run_at_the_raised_damping():
    """A NaN at the first trial costs one attempt and nothing else: the accepted step is
    bitwise the one a clean optimizer takes from λ = 2λ₀."""
    x, y = sine_data()
    faulty, clean = mlp(), mlp()
    res = FaultyResidual({FIRST_TRIAL_CALLS[1]: "nan"})
    a = lm(faulty, res).step(x, y)
    b = lm(clean, damping=2e-3).step(x, y)
    assert a.accepted and a.attempts == 2 and b.attempts == 1
    assert a.damping == b.damping and a.loss == b.loss
    assert_bitwise(faulty, params_of(clean))


# -- exceptions and interrupts mid-step -------------------------------------------------------

STAGES = {
    "validate": VALIDATE_CALL,
    "probe": PROBE_CALLS[0],
    "linearize-first-slice": LINEARIZE_CALLS[0],
    "linearize-last-slice": LINEARIZE_CALLS[-1],
    "trial-first-slice": FIRST_TRIAL_CALLS[0],
    "trial-last-slice": FIRST_TRIAL_CALLS[-1],
}


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("stage", list(STAGES))
def test_model_exception_mid_step_leaves_everything_as_before(stage, exc):
    x, y = sine_data()
    torch.manual_seed(0)
    model = FailingNet().double()
    reference = copy.deepcopy(model)
    opt = lm(model)
    ids = [id(p) for p in model.parameters()]
    before, state = params_of(model), opt.state_dict()
    model.calls, model.fail_at, model.exc = 0, STAGES[stage], exc
    with pytest.raises(exc, match=f"injected failure at forward call {STAGES[stage]}"):
        opt.step(x, y)
    assert_bitwise(model, before)
    # The user's Parameter objects are back in their modules, untouched and graph-free.
    assert [id(p) for p in model.parameters()] == ids
    assert all(isinstance(p, nn.Parameter) and p.grad is None for p in model.parameters())
    # A failure in the first attempt leaves the optimizer's own state alone too ...
    assert same_state(entries(opt.state_dict()), entries(state))
    # ... so the next step is bitwise the step of an optimizer that never saw it.
    model.fail_at = None
    info = opt.step(x, y)
    ref_info = lm(reference).step(x, y)
    assert info.accepted and info.loss == ref_info.loss
    assert_bitwise(model, params_of(reference))


@pytest.mark.parametrize("kind", ["raise", "interrupt"])
@pytest.mark.parametrize("jacobian", ["reverse", "forward", "batch_reverse"])
@pytest.mark.parametrize("call", [LINEARIZE_CALLS[1], FIRST_TRIAL_CALLS[2]])
def test_residual_function_exception_mid_step(kind, jacobian, call):
    x, y = sine_data()
    model = mlp()
    res = FaultyResidual({call: kind})
    opt = lm(model, res, jacobian=jacobian)
    before = params_of(model)
    exc = RuntimeError if kind == "raise" else KeyboardInterrupt
    # batch_* strategies never slice: linearisation is call 2, the trial call 3.
    if jacobian.startswith("batch"):
        res.arm({2 if call in LINEARIZE_CALLS else 3: kind})
    with pytest.raises(exc, match="injected"):
        opt.step(x, y)
    assert_bitwise(model, before)
    res.arm()
    info = opt.step(x, y)
    assert info.accepted and info.loss < info.loss_before


def test_exception_mid_step_restores_batchnorm_and_its_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)).double()
    bn = model[1]
    x, y = sine_data()
    res = FaultyResidual({3: "raise"})  # the whole-batch trial evaluation
    opt = so.LevenbergMarquardt(model, res)
    stats = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    before = params_of(model)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step(x, y)
    assert bn.track_running_stats is True and bn.training
    assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])
    assert int(bn.num_batches_tracked) == stats[2]
    assert_bitwise(model, before)
    res.arm()
    assert opt.step(x, y).accepted
    assert int(bn.num_batches_tracked) == stats[2] + 1


# -- the same faults in least_squares ------------------------------------------------------------


def test_least_squares_rejects_trial_points_outside_the_domain():
    """log(x) is NaN for x < 0, where the first Gauss-Newton steps from x0 = 10 land."""
    target = 0.01
    seen: list[float] = []

    def fun(x: Tensor) -> Tensor:
        seen.append(float(x.detach()[0]))
        return torch.log(x) - math.log(target)

    res = so.least_squares(fun, torch.tensor([10.0], dtype=F64))
    assert any(v < 0 for v in seen), "the fault was never hit"
    assert res.success and res.x.item() == pytest.approx(target, rel=1e-10)
    assert math.isfinite(res.cost) and res.cost < 1e-20


def _nan_jacobian_away_from_zero(x: Tensor) -> Tensor:
    """(x-2)³ + (x-2): finite everywhere, but its derivative is NaN wherever x != 0."""
    poison = 0.0 * torch.sqrt((x - x) + (x == 0).to(x.dtype))
    return (x - 2) ** 3 + (x - 2) + poison


def _nan_jacobian_everywhere(x: Tensor) -> Tensor:
    return x - 1 + 0.0 * torch.sqrt(x - x)


@pytest.mark.parametrize("fun", [_nan_jacobian_everywhere, _nan_jacobian_away_from_zero])
@pytest.mark.parametrize("solver", ["qr", "cholesky"])
def test_least_squares_never_reports_success_with_a_nan_jacobian(fun, solver):
    x0 = torch.zeros(1, dtype=F64)
    try:
        res = so.least_squares(fun, x0, solver=solver)
    except ValueError as exc:
        assert "jac" in str(exc).lower()
        return
    assert not res.success, (res.x, res.cost, res.message)


# -- overflow, denormals, aliasing -------------------------------------------------------------


def _affine_lstsq(X: Tensor, y: Tensor) -> Tensor:
    A = torch.cat([X.double(), torch.ones(X.shape[0], 1, dtype=F64)], 1)
    return torch.linalg.lstsq(A, y.double()).solution[:, 0]


def _affine_params(model: nn.Linear) -> Tensor:
    return torch.cat([model.weight.detach()[0], model.bias.detach()]).double()


def test_large_residuals_in_float32_step_like_float64():
    """Residuals near 1e20 are finite in float32, but ``gᵀδ`` and ``‖δ‖²`` are not: the
    predicted reduction and the step norms are taken in float64, so the float32 model
    takes the float64 model's steps (one attempt each, no spurious xtol stop) and both
    reach lstsq's solution."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(50, 3, generator=g)
    y = 1e20 * (1 + torch.randn(50, 1, generator=g))
    ref = _affine_lstsq(X, y)
    params = {}
    for dtype in (torch.float32, F64):
        torch.manual_seed(0)
        model = nn.Linear(3, 1).to(dtype)
        opt = so.LevenbergMarquardt(model)
        for k in range(2):
            info = opt.step(X.to(dtype), y.to(dtype))
            assert info.accepted and info.attempts == 1, (dtype, k, info.reason)
            assert not info.terminated
            # A linear problem: the model predicts the reduction (up to float32 rounding
            # of residuals near 1e20 once the remaining reduction is 1e-6 of the loss).
            assert info.gain_ratio == pytest.approx(1.0, abs=1e-5 if k == 0 else 0.05)
            params[dtype, k] = _affine_params(model)
        err = (params[dtype, 1] - ref).norm() / ref.norm()
        assert float(err) < 1e-5, dtype
    for k in range(2):
        gap = (params[torch.float32, k] - params[F64, k]).norm() / params[F64, k].norm()
        assert float(gap) < 1e-6, k


def test_overflowing_normal_equations_in_float32_are_rejected_cleanly():
    """J and r near 1e19 in float32: Jᵀr and diag(JᵀJ) overflow float32.  No exception,
    nothing applied, λ raised, and the step says why."""
    g = torch.Generator().manual_seed(0)
    X = 1e19 * torch.randn(50, 3, generator=g)
    y = 1e19 * torch.randn(50, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = so.LevenbergMarquardt(model)
    before, lam0 = params_of(model), opt.damping
    for _ in range(3):
        info = opt.step(X, y)
        assert not info.accepted and "non-finite" in info.reason
        assert math.isfinite(info.loss_before)  # the loss itself is summed in float64
    assert opt.damping > lam0
    assert_bitwise(model, before)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_subnormal_inputs_and_targets(dtype):
    tiny = torch.finfo(dtype).tiny
    g = torch.Generator().manual_seed(0)
    X = (torch.randn(50, 3, generator=g, dtype=F64) * tiny * 1e-3).to(dtype)
    y = (torch.randn(50, 1, generator=g, dtype=F64) * tiny * 1e-3).to(dtype)
    assert bool((X.abs() < tiny).all())  # every input is subnormal
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(dtype)
    opt = so.LevenbergMarquardt(model)
    first = None
    for _ in range(8):
        info = opt.step(X, y)
        first = first if first is not None else info.loss_before
        assert info.loss <= info.loss_before
        if info.terminated:
            break
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # The bias alone fits subnormal targets: the loss falls by many orders.
    assert info.loss < 1e-20 * first


@pytest.mark.parametrize("jacobian", ["reverse", "forward", "batch_reverse", "batch_forward"])
def test_residual_function_returning_its_own_argument(jacobian):
    """``lambda o, t: o`` and an in-place ``o.sub_(t)`` alias the model output: the step is
    bitwise the plain mse step."""
    x, y = sine_data(16)
    ref = mlp()
    lm(ref, jacobian=jacobian).step(x, torch.zeros_like(y))
    for fn, targets in ((lambda o, t: o, None), (lambda o, t: o.sub_(t), torch.zeros_like(y))):
        model = mlp()
        info = lm(model, fn, jacobian=jacobian).step(x, targets)
        assert info.accepted
        assert_bitwise(model, params_of(ref))
    assert torch.equal(y, torch.sin(3 * x))  # the caller's tensors are left alone


# -- rank deficiency --------------------------------------------------------------------------


def dead_relu_net(seed: int = 1) -> nn.Module:
    """Four of eight ReLU units are dead on [-1, 1]: their weights are zero columns of J."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    with torch.no_grad():
        net[0].bias[:4] = -100.0
    return net


@pytest.mark.parametrize(
    ("solver", "form"),
    [
        ("cholesky", "primal"),
        ("eigh", "primal"),
        ("qr", "primal"),
        ("cg", "primal"),
        ("cholesky", "dual"),
        ("eigh", "dual"),
        ("qr", "dual"),
    ],
)
@pytest.mark.parametrize("rule", ["nielsen", "multiplicative"])
def test_dead_relu_units_do_not_stall(solver, form, rule):
    """cuPyLMA's JᵀJ + λ·diag(JᵀJ) is singular for every λ here and never moves."""
    batch = 64 if form == "primal" else 6  # 6 residuals < 25 parameters: dual form
    x = torch.linspace(-1, 1, batch, dtype=F64).reshape(-1, 1)
    y = torch.sin(3 * x)
    net = dead_relu_net()
    dead = (net[0].weight[:4].clone(), net[0].bias[:4].clone(), net[2].weight[:, :4].clone())
    opt = so.LevenbergMarquardt(net, solver=solver, form=form, damping_rule=rule)
    infos = [opt.step(x, y) for _ in range(10)]
    assert all(i.form == form for i in infos)
    assert sum(i.accepted for i in infos) >= 8
    assert infos[-1].loss < 0.6 * infos[0].loss_before
    # Zero columns get a zero update (to rounding of the eigenvectors for eigh).
    atol = 1e-10 if solver == "eigh" else 0.0
    torch.testing.assert_close(net[0].weight[:4].detach(), dead[0], rtol=0, atol=atol)
    torch.testing.assert_close(net[0].bias[:4].detach(), dead[1], rtol=0, atol=atol)
    torch.testing.assert_close(net[2].weight[:, :4].detach(), dead[2], rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("solver", "form"),
    [
        ("cholesky", "primal"),
        ("eigh", "primal"),
        ("qr", "primal"),
        ("cg", "primal"),
        ("cholesky", "dual"),
        ("qr", "dual"),
    ],
)
def test_dead_relu_units_do_not_stall_with_damping_at_its_minimum(solver, form):
    """At ``damping_min`` the relative floor is lifted; zero columns keep theirs."""
    batch = 64 if form == "primal" else 6
    x = torch.linspace(-1, 1, batch, dtype=F64).reshape(-1, 1)
    y = torch.sin(3 * x)
    net = dead_relu_net()
    dead = (net[0].weight[:4].clone(), net[0].bias[:4].clone(), net[2].weight[:, :4].clone())
    opt = so.LevenbergMarquardt(net, solver=solver, form=form, damping=1.0, damping_min=1.0)
    infos = [opt.step(x, y) for _ in range(10)]
    assert sum(i.damping == 1.0 for i in infos) >= 3  # these steps start at the minimum
    assert sum(i.accepted for i in infos) >= 8
    assert infos[-1].loss < 0.6 * infos[0].loss_before
    assert all(i.loss <= i.loss_before for i in infos)
    atol = 1e-10 if solver == "eigh" else 0.0  # rounding of the eigenvectors
    for now, before in zip(
        (net[0].weight[:4], net[0].bias[:4], net[2].weight[:, :4]), dead, strict=True
    ):
        torch.testing.assert_close(now.detach(), before, rtol=0, atol=atol)


@pytest.mark.parametrize("name", ["marquardt", "more"])
def test_damping_floor_above_and_at_damping_min(name):
    """Above ``damping_min``: ``d ≥ floor·max(d)``.  At it: only zero, subnormal and
    non-finite columns are raised to ``floor·max``; every other column keeps its own."""
    tiny = torch.finfo(F64).tiny
    DS = so.damping.DampingState

    def d(col_sq: list[float], damping: float) -> Tensor:
        matrix = so.damping.make_damping_matrix(name)  # a fresh Moré running maximum
        return matrix.diagonal(torch.tensor(col_sq, dtype=F64), DS(damping), 1e-12)

    cols = [4.0, 0.0, 1e-30, tiny / 4, 1.0]
    above = torch.tensor([4.0, 4e-9, 4e-9, 4e-9, 1.0], dtype=F64)
    torch.testing.assert_close(d(cols, 1e-6), above, rtol=0, atol=0)
    at_min = torch.tensor([4.0, 4e-9, 1e-30, 4e-9, 4e-9, 4e-9, 1.0], dtype=F64)
    torch.testing.assert_close(d([*cols[:4], math.nan, math.inf, 1.0], 1e-12), at_min)
    # Nothing usable: the identity, above the minimum and at it.
    for damping in (1e-6, 1e-12):
        assert torch.equal(d([0.0, 0.0, 0.0], damping), torch.ones(3, dtype=F64))


class TiedBranches(nn.Module):
    """``a(x) + b(x)`` where ``b.weight`` *is* ``a.weight`` (one Parameter, two modules)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, 1, bias=False)
        self.b = nn.Linear(d, 1)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.a(x) + self.b(x)
        return out


@pytest.mark.parametrize("solver", ["cholesky", "qr", "eigh"])
def test_parameter_shared_between_modules_gets_the_summed_column(solver):
    g = torch.Generator().manual_seed(2)
    X = torch.randn(30, 3, generator=g, dtype=F64)
    y = torch.randn(30, 1, generator=g, dtype=F64)
    torch.manual_seed(0)
    model = TiedBranches(3).double()
    shared = model.a.weight
    opt = so.LevenbergMarquardt(model, solver=solver, damping=0.0, damping_min=1e-300)
    assert opt.num_parameters == 3 + 1  # the shared weight once, b's bias
    info = opt.step(X, y)
    assert info.accepted
    ref = _affine_lstsq(2 * X, y)  # y ≈ 2·Xw + c
    got = torch.cat([model.a.weight.detach()[0], model.b.bias.detach()])
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    assert model.b.weight is shared and model.a.weight is shared


class TwoBiases(nn.Module):
    """Two parameters with identical Jacobian columns: JᵀJ is singular."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.extra = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lin(x) + self.extra
        return out


@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr", "cg"])
def test_duplicated_parameters_reach_the_least_squares_fit(solver):
    g = torch.Generator().manual_seed(3)
    X = torch.randn(30, 3, generator=g, dtype=F64)
    y = torch.randn(30, 1, generator=g, dtype=F64)
    torch.manual_seed(0)
    model = TwoBiases().double()
    b1, b2 = float(model.lin.bias.detach()), float(model.extra.detach())
    opt = so.LevenbergMarquardt(model, solver=solver)
    for _ in range(20):
        info = opt.step(X, y)
        if info.terminated:
            break
    ref = _affine_lstsq(X, y)
    got = torch.cat([model.lin.weight[0], model.lin.bias + model.extra]).detach()
    torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-10)
    # Equal columns get equal damping, so the two biases moved by the same amount.
    moved = float(model.lin.bias.detach()) - b1, float(model.extra.detach()) - b2
    assert moved[0] == pytest.approx(moved[1], abs=1e-9)


# -- ill-conditioning ---------------------------------------------------------------------------


def column_scaled(dtype: torch.dtype, log_cond: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """X = Q·diag(s), orthonormal Q, s from 1 to 10^-log_cond; y = X w* with w* = v/s.

    cond(X) = 10^log_cond, yet every column matters equally to y.  Returns X, y, s, w*.
    """
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(60, 6, generator=g, dtype=F64))
    s = torch.logspace(0, -log_cond, 6, dtype=F64)
    X = (Q * s).to(dtype)
    w_star = torch.randn(6, generator=g, dtype=F64) / s
    y = (X.double() @ w_star).to(dtype).unsqueeze(1)
    return X, y, s, w_star


def fit_linear(X: Tensor, y: Tensor, steps: int, **options: Any) -> tuple[nn.Linear, list[Any]]:
    torch.manual_seed(0)
    model = nn.Linear(X.shape[1], 1, bias=False).to(X.dtype)
    opt = so.LevenbergMarquardt(model, **options)
    infos = []
    for _ in range(steps):
        infos.append(opt.step(X, y))
        if infos[-1].terminated:
            break
    return model, infos


CONDITIONED = [
    pytest.param(torch.float32, 12.0, id="float32-cond1e12"),
    pytest.param(F64, 16.0, id="float64-cond1e16"),
]


@pytest.mark.parametrize(("dtype", "log_cond"), CONDITIONED)
@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr", "cg"])
def test_column_scaled_problem_reaches_lstsq_with_a_small_damping_floor(dtype, log_cond, solver):
    X, y, s, _ = column_scaled(dtype, log_cond)
    ref = torch.linalg.lstsq(X.double(), y.double(), rcond=1e-30).solution[:, 0]
    ref_loss = float(((X.double() @ ref - y.double()[:, 0]) ** 2).mean())
    model, infos = fit_linear(X, y, 60, solver=solver, damping_min=1e-300)
    assert all(i.loss <= i.loss_before for i in infos)
    w = model.weight.detach().double()[0]
    # Relative error in the scaled coordinates, where every column weighs the same.
    err = float(((w - ref) * s).norm() / (ref * s).norm())
    assert err < (1e-6 if dtype == torch.float32 else 1e-10)
    assert infos[-1].loss <= ref_loss + 1e-14 * infos[0].loss_before


@pytest.mark.parametrize(("dtype", "log_cond"), CONDITIONED)
@pytest.mark.parametrize("damping_matrix", ["marquardt", "more"])
@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr", "cg"])
def test_column_scaled_problem_does_not_stall_with_defaults(
    dtype, log_cond, damping_matrix, solver
):
    """The default damping floor applies to zero columns only, so a column whose norm is
    1e-12 (float32) or 1e-16 (float64) of the largest is damped by its own curvature
    and the default optimizer reaches lstsq as with no floor at all."""
    X, y, s, _ = column_scaled(dtype, log_cond)
    ref = torch.linalg.lstsq(X.double(), y.double(), rcond=1e-30).solution[:, 0]
    model, infos = fit_linear(X, y, 60, solver=solver, damping_matrix=damping_matrix)
    assert all(i.loss <= i.loss_before for i in infos)
    assert infos[-1].loss < 1e-10 * infos[0].loss_before
    w = model.weight.detach().double()[0]
    err = float(((w - ref) * s).norm() / (ref * s).norm())
    assert err < (1e-6 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize(("dtype", "log_cond"), CONDITIONED)
@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr", "cg"])
def test_rotated_ill_conditioned_problem_makes_progress(dtype, log_cond, solver):
    """X = U·diag(s)·Vᵀ: no column scaling helps.  Progress to within 5% of lstsq's loss,
    never an increase, never an exception or a non-finite parameter."""
    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(60, 6, generator=g, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=F64))
    s = torch.logspace(0, -log_cond, 6, dtype=F64)
    X = ((U * s) @ V.T).to(dtype)
    y = torch.randn(60, 1, generator=g, dtype=F64).to(dtype)
    ref = torch.linalg.lstsq(X.double(), y.double(), driver="gelsd").solution
    ref_loss = float(((X.double() @ ref - y.double()) ** 2).mean())
    model, infos = fit_linear(X, y, 50, solver=solver)
    assert all(i.loss <= i.loss_before for i in infos)
    assert bool(torch.isfinite(model.weight).all())
    # The weights' loss in exact (float64) arithmetic lies between lstsq's and 5% above.
    # The reported loss is evaluated in the model's dtype: with weights near 1e7 the
    # float32 products X·w cancel, and it may then fall a little below lstsq's minimum.
    w = model.weight.detach().double()
    loss64 = float(((X.double() @ w.T - y.double()) ** 2).mean())
    assert ref_loss <= loss64 <= 1.05 * ref_loss
    assert infos[-1].loss <= 1.05 * ref_loss


# -- checkpoints -------------------------------------------------------------------------------


class TwoOutputs(nn.Module):
    """Six residuals per sample with 18 parameters: ``jacobian="auto"`` runs its timed probe."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 6)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.tanh(self.lin(x))
        return out


def _checkpoint_case(name: str) -> tuple[Callable[[], nn.Module], dict[str, Any], Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    if name == "auto-probe-float32":
        x = torch.randn(48, 2, generator=g)
        y = torch.tanh(x @ torch.randn(2, 6, generator=g))
        return (lambda: TwoOutputs()), {"jacobian": "auto", "slice_size": 16}, x, y
    x = torch.linspace(-1, 1, 48, dtype=F64).reshape(-1, 1)
    y = torch.sin(3 * x)
    options = {
        "more-eigh": {"damping_matrix": "more", "solver": "eigh"},
        "multiplicative-geodesic": {"damping_rule": "multiplicative", "geodesic": True},
        "dual-qr": {"form": "dual", "solver": "qr"},
    }[name]
    return (
        (lambda: mlp(hidden=8)),
        options,
        x[:16] if name == "dual-qr" else x,
        (y[:16] if name == "dual-qr" else y),
    )


@pytest.mark.parametrize(
    "case", ["more-eigh", "multiplicative-geodesic", "dual-qr", "auto-probe-float32"]
)
def test_checkpoint_file_resumes_bitwise_after_a_fault(case, tmp_path):
    make, options, x, y = _checkpoint_case(case)
    torch.manual_seed(0)
    model = make().to(x.dtype)
    res = FaultyResidual()
    opt = so.LevenbergMarquardt(model, res, max_attempts=1, **options)
    opt.step(x, y)
    # Two faulty linearisations in a row: λ and Nielsen's ν are mid-streak when we save.
    # The linearisation is call 1 when the batch's probe is cached (these steps), call 2
    # after a probe; a NaN probe passes (it checks shapes), so both calls are faulty.
    for _ in range(2):
        res.arm({1: "nan", 2: "nan"})
        info = opt.step(x, y)
        assert not info.accepted and "non-finite" in info.reason
    res.arm()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    ckpt = torch.load(path, weights_only=True)
    torch.manual_seed(123)
    clone = make().to(x.dtype)
    clone.load_state_dict(ckpt["model"])
    resumed = so.LevenbergMarquardt(clone, FaultyResidual(), max_attempts=1, **options)
    resumed.load_state_dict(ckpt["optimizer"])
    assert same_state(entries(resumed.state_dict()), entries(opt.state_dict()))
    for _ in range(6):
        a, b = opt.step(x, y), resumed.step(x, y)
        assert (a.loss, a.damping, a.attempts, a.accepted, a.jacobian) == (
            b.loss,
            b.damping,
            b.attempts,
            b.accepted,
            b.jacobian,
        )
        assert_bitwise(clone, params_of(model))


def test_checkpoint_of_a_model_with_other_shapes_is_refused():
    """Same parameter count (8), different shapes: refused, naming both."""
    opt = so.LevenbergMarquardt(nn.Linear(3, 2).double())
    other = so.LevenbergMarquardt(nn.Linear(1, 4).double())
    assert opt.num_parameters == other.num_parameters == 8
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"shapes \[\[2, 3\], \[2\]\].*shapes \[\[4, 1\], \[4\]\]"):
        other.load_state_dict(opt.state_dict())
    assert other.state_dict() == before


def test_checkpoint_with_a_frozen_parameter_is_refused_by_the_unfrozen_model():
    model = nn.Linear(3, 2).double()
    full = so.LevenbergMarquardt(model)
    model.bias.requires_grad_(False)
    partial = so.LevenbergMarquardt(model)
    with pytest.raises(ValueError, match="state_dict is for a model with 6 parameters"):
        full.load_state_dict(partial.state_dict())


@pytest.mark.parametrize("version", [lm_module.STATE_FORMAT_VERSION + 1, 0, "1"])
def test_checkpoint_of_another_format_version_is_refused(version):
    opt = so.LevenbergMarquardt(mlp())
    sd = {**opt.state_dict(), "format_version": version}
    with pytest.raises(ValueError, match=f"format_version={version!r}"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("key", ["num_parameters", "damping", "nu", "steps", "scale"])
def test_checkpoint_missing_a_key_is_refused_naming_it(key):
    opt = so.LevenbergMarquardt(mlp())
    sd = {k: v for k, v in as_format1(opt.state_dict()).items() if k != key}
    with pytest.raises((KeyError, ValueError), match=key):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("damping", [math.nan, math.inf])
def test_checkpoint_with_a_non_finite_damping_is_refused(damping):
    opt = so.LevenbergMarquardt(mlp())
    with pytest.raises(ValueError, match="damping"):
        opt.load_state_dict({**as_format1(opt.state_dict()), "damping": damping})


@pytest.mark.parametrize("bad", [{"lr": [1.0, 2.0]}, {"steps": "x"}])
def test_failed_load_state_dict_changes_nothing(bad):
    x, y = sine_data(16)
    donor = so.LevenbergMarquardt(mlp())
    donor.step(x, y)
    opt = so.LevenbergMarquardt(mlp(), damping=5.0)
    before = opt.state_dict()
    with pytest.raises((ValueError, TypeError), match=r"lr|steps"):
        opt.load_state_dict({**as_format1(donor.state_dict()), **bad})
    assert opt.state_dict() == before
