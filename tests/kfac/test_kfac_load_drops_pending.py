"""Loading a checkpoint replaces the statistics gathered since the last step too.

A training loop that rolls back (a loss spike after the backward, then the last
checkpoint reloaded into the same model and K-FAC) must go on exactly as a fresh
K-FAC loaded from that checkpoint would: the rejected batch must not enter the next
factor update.  The reference is a fresh model and K-FAC loaded from the same state
(bitwise), for :class:`KFAC`, :class:`KFACOptimizer` and KAISA's drop-in.  Before,
the rejected batch's statistics survived the load and were folded into the factors.

Loading between a backward and the step (KAISA's hooks would already have folded
that batch into the factors the load then replaced) preconditions the gradient with
the loaded factors and folds in nothing: compared with a hand-computed eigen-method
step from the loaded factors.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from secondorder.compat.kfac import KAISAConventionWarning, KFACPreconditioner
from secondorder.kfac import KFAC, KFACOptimizer
from tests.kfac.faults import same, state_of

DT = torch.float64


def net_() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def backprop(net: nn.Module, i: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 4, generator=g, dtype=DT) * scale
    y = torch.randn(8, 3, generator=g, dtype=DT)
    net.zero_grad()
    (0.5 * (net(x) - y).pow(2).sum(1).mean()).backward()


def native(net: nn.Module) -> Any:
    return KFAC(net, damping=0.1, kl_clip=None, inv_dtype=DT, factor_decay=0.5)


def optimizer(net: nn.Module) -> Any:
    return KFACOptimizer(net, lr=0.1, damping=0.1, inv_dtype=DT, factor_decay=0.5)


def kaisa(net: nn.Module) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KAISAConventionWarning)
        return KFACPreconditioner(net, damping=0.1, inv_dtype=DT, factor_decay=0.5)


def kfac_of(obj: Any) -> KFAC:
    return obj if isinstance(obj, KFAC) else obj.kfac


BUILDERS: dict[str, Callable[[nn.Module], Any]] = {
    "KFAC": native,
    "KFACOptimizer": optimizer,
    "KAISA drop-in": kaisa,
}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_a_rolled_back_batch_does_not_enter_the_factors(kind: str) -> None:
    build = BUILDERS[kind]
    net = net_()
    obj = build(net)
    for i in range(2):
        backprop(net, i)
        obj.step()
    saved_state, saved_params = copy.deepcopy(obj.state_dict()), copy.deepcopy(net.state_dict())

    backprop(net, 50, scale=30.0)  # the rejected batch: rolled back before its step
    net.load_state_dict(saved_params)
    obj.load_state_dict(copy.deepcopy(saved_state))
    backprop(net, 2)
    obj.step()

    ref_net = net_()
    ref = build(ref_net)
    ref_net.load_state_dict(saved_params)
    ref.load_state_dict(copy.deepcopy(saved_state))
    backprop(ref_net, 2)
    ref.step()
    assert same(state_of(kfac_of(obj), net), state_of(kfac_of(ref), ref_net))


def test_a_load_between_backward_and_step_preconditions_with_the_loaded_factors() -> None:
    net = net_()
    kfac = native(net)
    for i in range(2):
        backprop(net, i)
        kfac.step()
    saved = copy.deepcopy(kfac.state_dict())
    backprop(net, 2)
    kfac.load_state_dict(saved, recompute=True)
    grads = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    kfac.step()
    assert kfac.steps == saved["steps"] + 1
    for (w, b), layer, name in zip(
        (grads[0:2], grads[2:4]), (net[0], net[2]), ("0", "2"), strict=True
    ):
        grad = torch.cat([w, b.unsqueeze(1)], dim=1)
        a, g = saved["layers"][name]["A"][0], saved["layers"][name]["G"][0]
        assert torch.equal(kfac.layers[name].A, saved["layers"][name]["A"])  # not updated
        # (A ⊗ G + λI)⁻¹ vec ∇ through dense linear algebra
        fisher = torch.kron(a, g) + 0.1 * torch.eye(a.shape[0] * g.shape[0], dtype=DT)
        want = torch.linalg.solve(fisher, grad.T.reshape(-1)).reshape(a.shape[0], -1).T
        torch.testing.assert_close(layer.weight.grad, want[:, :-1], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(layer.bias.grad, want[:, -1], rtol=1e-10, atol=1e-12)
