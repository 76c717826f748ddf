"""KFACOptimizer.step: torch.optim's closure, and a step that raises changes nothing.

The closure is compared with ``torch.optim.SGD``'s (called under ``enable_grad``, its
loss returned) on a twin run of :class:`KFAC` followed by SGD.  The failures are
Ctrl-Cs injected into real steps (:class:`~tests.kfac.faults.Fault`): in SGD's update
of the second parameter, and in the adaptive path while ρ is computed; the state
afterwards must be bitwise the state before, and the retry the twin's clean step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from secondorder.kfac import KFAC, KFACOptimizer
from tests.kfac.faults import Fault, same, state_of

DT = torch.float64


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g, dtype=DT), torch.randn(8, 3, generator=g, dtype=DT)


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    x, y = data(i)
    return 0.5 * (model(x) - y).pow(2).sum(1).mean()


def backprop(model: nn.Module, i: int) -> None:
    model.zero_grad()
    loss_of(model, i).backward()


def test_step_calls_the_closure_under_enable_grad_and_returns_its_loss_as_sgd_does() -> None:
    # before: without adaptive damping the closure was never called, the weights did
    # not move and step returned None
    model, ref_model = net(), net()
    opt = KFACOptimizer(model, lr=0.1, momentum=0.9, damping=0.1, inv_dtype=DT)
    kfac = KFAC(ref_model, lr=0.1, damping=0.1, inv_dtype=DT)
    sgd = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):

        def closure(m: nn.Module = model, i: int = i) -> torch.Tensor:
            m.zero_grad()
            loss = loss_of(m, i)
            loss.backward()
            return loss

        def ref_closure(i: int = i) -> torch.Tensor:
            ref_model.zero_grad()
            loss = loss_of(ref_model, i)
            loss.backward()
            return loss

        # the caller's no_grad does not reach the closure, as with torch.optim
        with torch.no_grad():
            got = opt.step(closure)
            want = sgd.step(lambda: (ref_closure(), kfac.step())[0])
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.kfac.steps == 3


def test_a_closure_that_raises_changes_no_optimizer_state() -> None:
    model = net()
    opt = KFACOptimizer(model, lr=0.1, damping=0.1, inv_dtype=DT)
    backprop(model, 0)
    opt.step()
    backprop(model, 1)
    before = {"kfac": state_of(opt.kfac, model), "sgd": copy.deepcopy(opt.state_dict())}

    def closure() -> torch.Tensor:
        raise KeyboardInterrupt("Ctrl-C in the closure")

    with pytest.raises(KeyboardInterrupt, match="Ctrl-C in the closure"):
        opt.step(closure)
    assert same({"kfac": state_of(opt.kfac, model), "sgd": copy.deepcopy(opt.state_dict())}, before)


def updates_a_param(model: nn.Module) -> Any:
    """A ``when`` for ``Tensor.add_``: SGD's in-place update of a parameter."""
    return lambda args: any(args[0] is p for p in model.parameters())


def full_state(model: nn.Module, opt: KFACOptimizer) -> dict[str, Any]:
    return {
        "kfac": state_of(opt.kfac, model),
        "sgd": copy.deepcopy(torch.optim.SGD.state_dict(opt)),
        "rho": opt.last_rho,
    }


@pytest.mark.parametrize("first", [True, False], ids=["first step", "with momentum"])
def test_an_interrupt_in_sgds_update_leaves_everything_as_before(first: bool) -> None:
    # before: K-FAC's step was committed before SGD's ran; the interrupt left the step
    # count advanced, the factors updated and .grad preconditioned (a retry did it twice)
    runs = []
    for _ in range(2):
        model = net()
        opt = KFACOptimizer(model, lr=0.1, momentum=0.9, damping=0.1, inv_dtype=DT)
        for i in range(0 if first else 2):
            backprop(model, i)
            opt.step()
        backprop(model, 2)
        runs.append((model, opt))
    (model, opt), (ref_model, ref) = runs
    before = full_state(model, opt)
    fault = Fault(torch.Tensor.add_, KeyboardInterrupt("Ctrl-C in SGD"), 2, updates_a_param(model))
    with fault, pytest.raises(KeyboardInterrupt, match="Ctrl-C in SGD"):
        opt.step()
    assert fault.calls == 2  # the first parameter was updated when it came
    assert same(full_state(model, opt), before)
    opt.step()  # the retry equals a step that never failed
    ref.step()
    assert same(full_state(model, opt), full_state(ref_model, ref))


@pytest.mark.parametrize("where", ["sgd", "rho"])
def test_an_interrupt_in_an_adaptive_step_leaves_everything_and_lambda_as_before(
    where: str,
) -> None:
    # before: a Ctrl-C while ρ was computed (after the update) left the step applied
    # but λ not adapted
    runs = []
    for _ in range(2):
        model = net()
        opt = KFACOptimizer(
            model, lr=0.1, damping=0.1, inv_dtype=DT, adaptive_damping=True,
            damping_adaptation_interval=1,
        )  # fmt: skip
        for i in range(2):
            backprop(model, i)
            opt.step(lambda m=model, i=i: loss_of(m, i))
        backprop(model, 2)
        runs.append((model, opt))
    (model, opt), (ref_model, ref) = runs
    before = full_state(model, opt)
    if where == "sgd":
        fault = Fault(torch.Tensor.add_, KeyboardInterrupt("Ctrl-C"), 2, updates_a_param(model))
    else:
        # the step taken, δ = new - old (of the second parameter), read for ρ after the
        # closure's second call; the closure's own subtraction has the batch's shape
        shapes = {p.shape for p in model.parameters()}
        fault = Fault(
            torch.Tensor.sub, KeyboardInterrupt("Ctrl-C"), 2, lambda a: a[0].shape in shapes
        )
    with fault, pytest.raises(KeyboardInterrupt, match="Ctrl-C"):
        opt.step(lambda: loss_of(model, 2))
    assert fault.calls == 2
    assert same(full_state(model, opt), before)
    assert opt.kfac.steps == 2
    opt.step(lambda: loss_of(model, 2))
    ref.step(lambda: loss_of(ref_model, 2))
    assert same(full_state(model, opt), full_state(ref_model, ref))
    assert opt.kfac.damping == ref.kfac.damping != 0.1 and opt.last_rho == ref.last_rho
