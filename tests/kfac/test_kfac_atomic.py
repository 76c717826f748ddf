"""A K-FAC step that fails changes nothing, and its retry equals a step that never failed.

Each case runs two identical models one step, gathers the second batch, then makes the
second step of one of them fail at a chosen point (a failing eigendecomposition, a
Ctrl-C in the Cholesky factorisation, in the factor update or while the gradients are
written): the state afterwards must be bitwise the state before, and the retried step
must be bitwise the other model's clean step (the batch enters the factors once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from secondorder.kfac import KFAC
from tests.kfac.faults import Fault, same, state_of, writes_a_grad

DT = torch.float64


def make(method: str) -> tuple[nn.Sequential, KFAC]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    k = KFAC(net, compute_method=method, damping=0.1, kl_clip=1e-2, inv_dtype=DT)
    return net, k


def backprop(net: nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 4, generator=g, dtype=DT), torch.randn(8, 3, generator=g, dtype=DT)
    net.zero_grad()
    (0.5 * (net(x) - y).pow(2).sum(1).mean()).backward()


#: (compute_method, the fault as a function of the model, the error it gives, its match)
FAULTS: list[tuple[str, Callable[[nn.Module], Fault], type[BaseException], str]] = [
    (
        "eigen",
        lambda _: Fault(torch.linalg.eigh, torch.linalg.LinAlgError("eigh failed to converge")),
        torch.linalg.LinAlgError,
        "eigh failed to converge",
    ),
    (
        "eigen",
        # the first layer's two eigendecompositions done, the second layer's A interrupted
        lambda _: Fault(torch.linalg.eigh, KeyboardInterrupt("in eigh"), at=3),
        KeyboardInterrupt,
        "in eigh",
    ),
    (
        "inverse",
        lambda _: Fault(torch.linalg.cholesky_ex, KeyboardInterrupt("in cholesky_ex"), at=2),
        KeyboardInterrupt,
        "in cholesky_ex",
    ),
    (
        "inverse",
        # inside the factor update, the second layer's A being folded in
        lambda _: Fault(torch.Tensor.add_, KeyboardInterrupt("folding the factors"), at=3),
        KeyboardInterrupt,
        "folding the factors",
    ),
    (
        "eigen",
        # the first layer's .grad written, the second's being written
        lambda net: Fault(
            torch.Tensor.copy_, KeyboardInterrupt("writing grads"), at=3, when=writes_a_grad(net)
        ),
        KeyboardInterrupt,
        "writing grads",
    ),
    (
        "inverse",
        lambda net: Fault(
            torch.Tensor.copy_, RuntimeError("writing grads"), at=2, when=writes_a_grad(net)
        ),
        RuntimeError,
        "writing grads",
    ),
]


IDS = [
    "eigh-fails",
    "eigh-interrupted",
    "cholesky-interrupted",
    "factor-update-interrupted",
    "grad-write-interrupted",
    "grad-write-fails",
]


@pytest.mark.parametrize(("method", "fault", "error", "match"), FAULTS, ids=IDS)
def test_failed_step_changes_nothing_and_its_retry_equals_a_clean_step(
    method: str, fault: Callable[[nn.Module], Fault], error: type[BaseException], match: str
) -> None:
    net, k = make(method)
    ref_net, ref = make(method)
    for m, kfac in ((net, k), (ref_net, ref)):
        backprop(m, 0)
        kfac.step()  # factors and decompositions exist: "unchanged" is a real check
        backprop(m, 1)
    before = state_of(k, net)
    injected = fault(net)
    with injected, pytest.raises(error, match=match):
        k.step()
    assert injected.calls >= injected.at  # the fault did strike
    assert same(state_of(k, net), before)
    k.step()
    ref.step()
    assert same(state_of(k, net), state_of(ref, ref_net))


def test_a_failed_step_on_a_fresh_kfac_leaves_no_factors() -> None:
    net, k = make("eigen")
    backprop(net, 0)
    before = state_of(k, net)
    with (
        Fault(torch.linalg.eigh, KeyboardInterrupt("first step")),
        pytest.raises(KeyboardInterrupt),
    ):
        k.step()
    assert same(state_of(k, net), before)
    assert all(layer.A is None and not layer.inv for layer in k.layers.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inv_dtype_is_refused_at_construction(dtype: torch.dtype) -> None:
    # it used to be accepted, then failed inside the first step with "linalg_eigh_cpu
    # not implemented for 'Half'", after the factors had changed
    net = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(
        ValueError,
        match=rf"Invalid inv_dtype={dtype}: the eigendecomposition and Cholesky "
        r"factorisation need torch.float32 or torch.float64",
    ):
        KFAC(net, inv_dtype=dtype)
    assert not net[0]._forward_hooks


def test_kfac_state_unchanged_by_a_callable_that_refuses_the_step() -> None:
    # a schedule that refuses its value at step 1: nothing changes, and the same
    # K-FAC steps on once the schedule is fixed
    values: dict[int, Any] = {1: -1.0}
    net, first = make("eigen")
    first.remove_hooks()
    k = KFAC(net, damping=lambda s: values.get(s, 0.1), inv_dtype=DT)
    backprop(net, 0)
    k.step()
    backprop(net, 1)
    before = state_of(k, net)
    with pytest.raises(
        ValueError, match=r"Invalid damping=-1.0: .* \(returned by the callable damping at step 1\)"
    ):
        k.step()
    assert same(state_of(k, net), before)
    values.clear()
    k.step()
    assert k.steps == 2
