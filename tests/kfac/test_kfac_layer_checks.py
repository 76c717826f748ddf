"""Layers K-FAC must treat with care: frozen biases, tied and lazy weights, unbatched
inputs, skip_layers that match nothing, models on the meta device.

References: factors by hand (``A = mean a aᵀ`` without the frozen bias's column), the
same input as a batch of one, and a plain SGD step for what K-FAC must not touch.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from secondorder.kfac import KFAC

DT = torch.float64


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_frozen_bias_gets_no_gradient_and_no_factor_column(kind: str) -> None:
    torch.manual_seed(0)
    layer: nn.Module
    if kind == "linear":
        layer = nn.Linear(3, 2).to(DT)
        x = torch.randn(5, 3, dtype=DT)
    else:
        layer = nn.Conv2d(2, 3, 2).to(DT)
        x = torch.randn(5, 2, 3, 3, dtype=DT)
    assert isinstance(layer.bias, Tensor)
    layer.bias.requires_grad_(False)
    net = nn.Sequential(layer)
    k = KFAC(net, factor_decay=0.0, kl_clip=None, inv_dtype=DT)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    bias = layer.bias.detach().clone()
    net(x).pow(2).mean().backward()
    k.step()
    opt.step()
    assert layer.bias.grad is None
    assert torch.equal(layer.bias, bias)
    # A is the weight's alone: the inputs (or patches), no column of ones
    rows = x if kind == "linear" else nn.functional.unfold(x, 2).transpose(1, 2).reshape(-1, 8)
    a = k.layers["0"].A
    assert a is not None and a.shape == (1, rows.shape[1], rows.shape[1])
    torch.testing.assert_close(a[0], rows.T @ rows / rows.shape[0], rtol=1e-13, atol=1e-14)


def test_tied_weight_is_refused_naming_both_modules() -> None:
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    net = nn.Sequential(a, nn.Tanh(), b)
    with pytest.raises(
        ValueError,
        match=r"layer '0': its parameter is shared by \['0.weight', '2.weight'\] \(tied "
        r"weights\).*Pass skip_layers with every module that shares it",
    ):
        KFAC(net)
    assert not a._forward_hooks
    with pytest.raises(ValueError, match="no layer K-FAC can precondition"):
        KFAC(net, skip_layers=["0", "2"])


def test_one_module_under_two_names_is_one_layer_not_a_tie() -> None:
    lin = nn.Linear(3, 3)
    net = nn.Sequential(lin, nn.Tanh(), lin)  # called twice: weight sharing
    k = KFAC(net)
    assert list(k.layers) == ["0"]


def _one_sample(unbatched: bool, kind: str) -> KFAC:
    torch.manual_seed(0)
    if kind == "linear":
        net: nn.Module = nn.Sequential(nn.Linear(3, 4)).to(DT)
        x = torch.randn(3, dtype=DT)
    else:
        net = nn.Sequential(nn.Conv2d(2, 3, 2)).to(DT)
        x = torch.randn(2, 4, 4, dtype=DT)
    k = KFAC(net, factor_decay=0.0, kl_clip=None, inv_dtype=DT)
    net(x if unbatched else x.unsqueeze(0)).pow(2).sum().backward()
    k.step()
    return k


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_unbatched_input_is_one_sample(kind: str) -> None:
    # a 1-D input to a Linear used to scale G by out_features; an unbatched Conv2d
    # input raised an IndexError
    got, want = _one_sample(True, kind).layers["0"], _one_sample(False, kind).layers["0"]
    assert got.A is not None and want.A is not None and got.G is not None and want.G is not None
    torch.testing.assert_close(got.A, want.A, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(got.G, want.G, rtol=1e-13, atol=1e-14)


def test_unbatched_linear_g_is_the_samples_own_gradient() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4)).to(DT)
    k = KFAC(net, factor_decay=0.0, kl_clip=None)
    x = torch.randn(3, dtype=DT)
    out = net(x)
    out.pow(2).sum().backward()
    g = 2 * out.detach()  # ∂(Σ out²)/∂out
    k.step()
    assert k.layers["0"].G is not None
    torch.testing.assert_close(k.layers["0"].G[0], torch.outer(g, g), rtol=1e-14, atol=1e-15)


def test_lazy_layer_is_refused_until_materialized() -> None:
    net = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(
        ValueError,
        match=r"layer '0' \(LazyLinear\) has uninitialized parameters: run the model once "
        "on a sample batch",
    ):
        KFAC(net)
    net(torch.randn(2, 5))
    assert KFAC(net).layers["0"].factor_shapes() == ((1, 6, 6), (1, 3, 3))


def test_meta_device_model_is_refused() -> None:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(
        ValueError,
        match=r"layer '0' has its parameters on the meta device \(shapes without values\): "
        r"materialize the model first",
    ):
        KFAC(net)


def test_skip_layers_entry_that_matches_nothing_is_refused() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(
        ValueError,
        match=r"Invalid skip_layers=\['fc9'\]: \['fc9'\] match no submodule name or class "
        "name of the model",
    ):
        KFAC(net, skip_layers=["fc9"])
    assert not any(m._forward_hooks for m in net.modules())
    # names and class names (any case) of any module match, supported or not
    assert list(KFAC(net, skip_layers=["2", "TANH"]).layers) == ["0"]
