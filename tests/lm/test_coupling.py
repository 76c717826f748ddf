"""Samples that interact through anything but BatchNorm: detected, never a wrong Jacobian.

A residual minus its batch mean, a module computing ``x - x.mean(0)`` and functional
``F.batch_norm(training=True)`` make sample i's residuals depend on the other samples.
Under ``jacobian="auto"`` the normal equations a step is built from must equal those
of :func:`torch.func.jacrev` of the whole residual vector (built here with
``functional_call``, not with the package's evaluation code); a forced ``"reverse"``
raises.  Also here: a ``residual_fn`` that does not depend on the parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev

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


def mlp(middle: nn.Module | None = None, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(3, 6)]
    if middle is not None:
        layers.append(middle)
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
