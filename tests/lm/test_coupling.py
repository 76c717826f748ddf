"""Samples that interact through anything but BatchNorm: detected, never a wrong Jacobian.

A residual minus its batch mean, a module computing ``x - x.mean(0)`` and functional
``F.batch_norm(training=True)`` make sample i's residuals depend on the other samples.
Under ``jacobian="auto"`` the normal equations a step is built from must equal those
of :func:`torch.func.jacrev` of the whole residual vector (built here with
``functional_call``, not with the package's evaluation code); a forced ``"reverse"``
or ``"forward"`` raises before anything changes, on any model (all ``nn.Linear`` or
not, one rank or two), and otherwise runs as asked.  Also here: a ``residual_fn``
that does not depend on the parameters, under every strategy and with a
``ModelResidual``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev
from unchanged import assert_unchanged, state_of

import secondorder as so

DT = torch.float64


class Center(nn.Module):
    """``x - x.mean(0)``: every sample's output depends on the whole batch."""

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0)


class FunctionalBatchNorm(nn.Module):
    """``F.batch_norm`` with batch statistics and no module the optimizer could spot."""

    def forward(self, x: Tensor) -> Tensor:
        return F.batch_norm(x, None, None, training=True)


def centered_residual(outputs: Tensor, targets: Tensor) -> Tensor:
    return outputs - targets - (outputs - targets).mean()


class Scale(nn.Module):
    """A trainable per-feature scale: a parameter outside nn.Linear, so ``"reverse"``
    runs ``vmap`` instead of the outer-product rule."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def mlp(middle: nn.Module | None = None, seed: int = 1, scale: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(3, 6)]
    if middle is not None:
        layers.append(middle)
    if scale:
        layers.append(Scale())
    layers += [nn.Tanh(), nn.Linear(6, 2)]
    return nn.Sequential(*layers).to(DT)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., Tensor]]] = {
    "residual-minus-mean": (mlp, centered_residual),
    "module-x-minus-mean": (lambda: mlp(Center()), so.residuals.mse),
    "functional-batch-norm": (lambda: mlp(FunctionalBatchNorm()), so.residuals.mse),
}


def data(n: int = 24) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g, dtype=DT)
    return x, torch.stack([torch.sin(x.sum(1)), torch.cos(x[:, 0])], 1)


def reference(
    model: nn.Module, residual_fn: Callable[..., Tensor], x: Tensor, y: Tensor
) -> tuple[Tensor, Tensor]:
    """J and r of the whole batch by jacrev over functional_call."""
    params = {k: p.detach() for k, p in model.named_parameters()}

    def r(p: dict[str, Tensor]) -> Tensor:
        return residual_fn(functional_call(model, p, (x,)), y).reshape(-1)

    jac = jacrev(r)(params)
    J = torch.cat([jac[k].reshape(-1, params[k].numel()) for k in params], 1)
    return J, r(params)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("slice_size", [None, 5])
def test_auto_builds_the_whole_batch_normal_equations(case: str, slice_size: int | None) -> None:
    make, residual_fn = CASES[case]
    model = make()
    x, y = data()
    opt = so.LevenbergMarquardt(model, residual_fn, slice_size=slice_size)
    opt.plan(x, y)
    problem = opt.internals().problem
    assert problem is not None
    assert problem.strategy.name in ("batch_reverse", "batch_forward")
    x0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    system = problem.linearize(x0)
    J, r = reference(model, residual_fn, x, y)
    torch.testing.assert_close(system.loss_sum, r @ r)
    torch.testing.assert_close(system.grad, J.T @ r)
    gram = system.gram if system.gram is not None else system.jac.T @ system.jac
    torch.testing.assert_close(gram, J.T @ J)


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_reports_the_true_loss_and_no_false_convergence(case: str) -> None:
    make, residual_fn = CASES[case]
    model = make()
    x, y = data()
    opt = so.LevenbergMarquardt(model, residual_fn)
    for _ in range(3):
        J, r = reference(model, residual_fn, x, y)
        info = opt.step(x, y)
        torch.testing.assert_close(info.loss_before, float(r @ r) / r.numel())
        if info.reason.startswith("gtol"):
            # A declared convergence must hold for the true problem: gtol's measure on
            # the whole batch's Jacobian at the point the step started from.
            cos = (J.T @ r).abs() / (J.norm(dim=0) * r.norm()).clamp_min(1e-300)
            assert float(cos.max()) <= opt.config.gtol
    # Three accepted or rejected steps from a poor start reduce the true loss.
    _, r_end = reference(model, residual_fn, x, y)
    _, r_start = reference(make(), residual_fn, x, y)
    assert float(r_end @ r_end) < float(r_start @ r_start)


@pytest.mark.parametrize("case", ["residual-minus-mean", "module-x-minus-mean"])
def test_forced_reverse_refuses_interacting_samples(case: str) -> None:
    # These models hold only nn.Linear parameters: the outer-product rule's own check
    # fails, and the vmap rows it used to fall back to are compared with the batch.
    make, residual_fn = CASES[case]
    model = make()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data()
    opt = so.LevenbergMarquardt(model, residual_fn, jacobian="reverse")
    with pytest.raises(ValueError, match=r"jacobian='reverse' would compute a wrong Jacobian"):
        opt.step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class Counting:
    """``outputs - targets``, counting its calls."""

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        self.calls += 1
        return self.fn(outputs, targets)


def test_the_check_runs_once_per_signature() -> None:
    # After the first step, "auto" calls residual_fn exactly as often as the strategy
    # it chose would when forced (validation, one linearisation, one per trial).
    x, y = data()
    auto_fn, forced_fn = Counting(centered_residual), Counting(centered_residual)
    auto = so.LevenbergMarquardt(mlp(), auto_fn)
    first = auto.step(x, y)
    forced = so.LevenbergMarquardt(mlp(), forced_fn, jacobian=first.jacobian)
    forced.step(x, y)
    assert auto_fn.calls > forced_fn.calls  # the probe ran on the first batch
    auto_fn.calls = forced_fn.calls = 0
    a, b = auto.step(x, y), forced.step(x, y)
    assert a.attempts == b.attempts
    assert auto_fn.calls == forced_fn.calls


def test_independent_samples_keep_the_per_sample_strategy() -> None:
    x, y = data()
    info = so.LevenbergMarquardt(mlp(), so.residuals.mse).step(x, y)
    assert info.jacobian == "reverse"


@pytest.mark.parametrize(
    "residual_fn",
    [
        lambda o, t: (o - t).detach(),
        lambda o, t: torch.as_tensor((o - t).detach().numpy()),
    ],
    ids=["detach", "numpy"],
)
def test_residuals_that_ignore_the_parameters_are_refused(residual_fn: Callable) -> None:
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data()
    opt = so.LevenbergMarquardt(model, residual_fn)
    with pytest.raises(
        ValueError,
        match=r"residuals do not depend on the model's trainable parameters.*residual_fn",
    ):
        opt.step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- forced per-sample strategies: checked once per input signature ---------------------------


#: What each forced per-sample strategy says about each interaction.  A functional
#: batch norm sees one sample at a time, whose single value per channel it refuses.
FORCED_MESSAGES = {
    "residual-minus-mean": "would compute a wrong Jacobian: the residuals differ",
    "module-x-minus-mean": "would compute a wrong Jacobian: the residuals differ",
    "functional-batch-norm": (
        r"cannot compute this model's per-sample Jacobian: it raised sample by sample.*"
        r"samples that interact.*Expected more than 1 value per channel"
    ),
}


MIDDLES: dict[str, Callable[[], nn.Module | None]] = {
    "residual-minus-mean": lambda: None,
    "module-x-minus-mean": Center,
    "functional-batch-norm": FunctionalBatchNorm,
}


#: Every case but the two of ``test_forced_reverse_refuses_interacting_samples`` above.
FORCED_CASES = [
    pytest.param(case, jacobian, scale, id=f"{case}-{jacobian}-{'scale' if scale else 'linear'}")
    for case in sorted(CASES)
    for jacobian in ("reverse", "forward")
    for scale in (False, True)
    if scale or jacobian == "forward" or case == "functional-batch-norm"
]


@pytest.mark.parametrize(("case", "jacobian", "scale"), FORCED_CASES)
def test_forced_per_sample_refuses_interacting_samples(
    case: str, jacobian: str, scale: bool
) -> None:
    _, residual_fn = CASES[case]
    model = mlp(MIDDLES[case](), scale=scale)
    x, y = data()
    opt = so.LevenbergMarquardt(model, residual_fn, jacobian=jacobian)
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    whole = "batch_forward" if jacobian == "forward" else "batch_reverse"
    with pytest.raises(
        ValueError, match=rf"jacobian='{jacobian}' {FORCED_MESSAGES[case]}.*'{whole}'.*'auto'"
    ):
        opt.step(x, y)
    assert_unchanged(model, before, opt, state)


@pytest.mark.parametrize("jacobian", ["reverse", "forward"])
def test_forced_per_sample_runs_as_asked_and_is_checked_once_per_signature(jacobian: str) -> None:
    # Independent samples, a parameter outside nn.Linear: the forced strategy is kept.
    # The first step of an input signature evaluates a probe of its first slice three
    # more times (twice at once: residuals, weighted gradient, repeatability; once
    # with the strategy); later steps call residual_fn as the step's schedule says:
    # one linearisation per slice, one evaluation per slice per trial (the validation
    # probe of the first batch of a signature is not repeated).
    model, res = mlp(scale=True), Counting(so.residuals.mse)
    opt = so.LevenbergMarquardt(model, res, jacobian=jacobian, slice_size=8)
    x, y = data()
    J, r = reference(model, so.residuals.mse, x, y)
    opt.plan(x, y)
    problem = opt.internals().problem
    assert problem is not None
    system = problem.linearize(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(system.grad, J.T @ r)
    gram = system.gram if system.gram is not None else system.jac.T @ system.jac
    torch.testing.assert_close(gram, J.T @ J)
    assert opt.step(x, y).jacobian == jacobian
    model2, res2 = mlp(scale=True), Counting(so.residuals.mse)
    opt2 = so.LevenbergMarquardt(model2, res2, jacobian=jacobian, slice_size=8)
    info = opt2.step(x, y)
    assert res2.calls == 1 + 3 + 3 * (1 + info.attempts)
    res2.calls = 0
    info = opt2.step(x, y)
    assert res2.calls == 3 * (1 + info.attempts)
    # A new signature (two positions per sample: nn.Linear maps the last dimension) is
    # probed again, once, and validated on its first batch only.
    x2, y2 = x.reshape(12, 2, 3), y.reshape(12, 2, 2)
    for validate, probe in ((1, 3), (0, 0)):
        res2.calls = 0
        info = opt2.step(x2, y2)
        assert info.jacobian == jacobian
        assert res2.calls == validate + probe + 2 * (1 + info.attempts)


# -- residuals that ignore the parameters, under every strategy ---------------------------------

INDEPENDENT: dict[str, Callable[..., Tensor]] = {
    "targets-minus-mean": lambda o, t: t - t.mean(),
    "detached-output": lambda o, t: o.detach() - t,
}
INDEPENDENT_MESSAGE = (
    r"residuals do not depend on the model's trainable parameters: residual_fn\(model\(inputs\), "
    r"targets\) returned a tensor with no gradient \(requires_grad=False\), so J would be zero "
    r"and the fit would stop at once with a false convergence"
)


@pytest.mark.parametrize("jacobian", ["batch_reverse", "batch_forward", "reverse", "forward"])
@pytest.mark.parametrize("residual", sorted(INDEPENDENT))
def test_residuals_that_ignore_the_parameters_are_refused_by_every_strategy(
    residual: str, jacobian: str
) -> None:
    model = mlp(scale=True)
    x, y = data()
    opt = so.LevenbergMarquardt(model, INDEPENDENT[residual], jacobian=jacobian)
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    with pytest.raises(ValueError, match=INDEPENDENT_MESSAGE):
        opt.step(x, y)
    assert_unchanged(model, before, opt, state)


def detached_model_residual(f: Callable[[Tensor], Tensor], x: Tensor, t: Tensor) -> Tensor:
    return (f(x).detach() - t).reshape(-1)


@pytest.mark.parametrize("jacobian", ["auto", "batch_reverse", "batch_forward"])
def test_a_model_residual_that_ignores_the_parameters_is_refused(jacobian: str) -> None:
    model = mlp()
    x, y = data()
    opt = so.LevenbergMarquardt(
        model, so.residuals.ModelResidual(detached_model_residual), jacobian=jacobian
    )
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    with pytest.raises(
        ValueError,
        match=r"residuals do not depend on the model's trainable parameters: the ModelResidual's "
        r"fn\(model, inputs, targets\) returned a tensor with no gradient",
    ):
        opt.step(x, y)
    assert_unchanged(model, before, opt, state)


@pytest.mark.parametrize("jacobian", ["batch_reverse", "batch_forward"])
def test_the_whole_batch_check_costs_an_evaluation_only_for_a_zero_jacobian(
    jacobian: str,
) -> None:
    # A J with a nonzero entry shows the residuals depend on the parameters: no extra
    # call.  ``0·o - t`` does depend on them (autograd tracks it) and its J is exactly
    # zero, which only one more evaluation, with autograd on, can tell from a detached
    # residual: that evaluation runs once, and the step goes on as asked.  Validation
    # (first step only), linearisation and trials are one call each (the batch modes do
    # not slice).
    for fn, check in ((so.residuals.mse, 0), (lambda o, t: 0.0 * o - t, 1)):
        res = Counting(fn)
        opt = so.LevenbergMarquardt(mlp(), res, jacobian=jacobian)
        x, y = data()
        info = opt.step(x, y)
        assert res.calls == 1 + 1 + check + info.attempts
        res.calls = 0
        info = opt.step(x, y)
        assert res.calls == 1 + info.attempts
    assert info.reason.startswith("gtol")  # J = 0 is this problem's true Jacobian


# -- two ranks: the check is local to each rank, and every rank raises ---------------------------


class Toggle(nn.Module):
    """``x - x.mean(0)`` while ``on``, the identity otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0) if self.on else x


def rank_forced_coupling(rank: int, world: int) -> list[tuple[str, bool, float, Tensor]]:
    """Per forced strategy: rank 1's samples interact in the first step, then not."""
    x, y = data()
    share = len(x) // world
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    out = []
    for jacobian in ("reverse", "forward"):
        toggle = Toggle()
        model = mlp(toggle, scale=True)
        opt = so.LevenbergMarquardt(model, so.residuals.mse, jacobian=jacobian)
        toggle.on = rank == 1
        before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
        message = ""
        try:
            opt.step(xs, ys)
        except (ValueError, RuntimeError) as exc:
            message = f"{type(exc).__name__}: {exc}"
        assert_unchanged(model, before, opt, state)
        toggle.on = False
        info = opt.step(xs, ys)  # the group is still usable
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out.append((message, info.accepted, info.loss, flat))
    return out


@pytest.mark.distributed
def test_a_rank_whose_samples_interact_makes_every_rank_raise() -> None:
    from secondorder.testing import run_ranks

    results = {r: v.unwrap() for r, v in run_ranks(rank_forced_coupling, 2).items()}
    x, y = data()
    for i, jacobian in enumerate(("reverse", "forward")):
        assert results[1][i][0].startswith(
            f"CouplingError: jacobian='{jacobian}' would compute a wrong Jacobian"
        )
        assert results[0][i][0].startswith("RankFailedError: 1 of 2 ranks raised while linearising")
        # The next step equals one process on the concatenated batch.
        model = mlp(Toggle(), scale=True)
        ref = so.LevenbergMarquardt(model, so.residuals.mse, jacobian=jacobian).step(x, y)
        ref_flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        for rank in (0, 1):
            _, accepted, loss, flat = results[rank][i]
            assert accepted and ref.accepted
            assert loss == pytest.approx(ref.loss, rel=1e-9)
            torch.testing.assert_close(flat, ref_flat, rtol=1e-9, atol=1e-12)
