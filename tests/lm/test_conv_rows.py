"""Per-sample convolution rows (secondorder.lm.conv_rows) against torch.func.

The reference is ``vmap(jacrev(f))`` of a per-sample residual through the layer
(conv, tanh, a fixed linear read-out with k outputs); the rule's rows come from one
batched forward and one backward per residual component, as a Jacobian strategy
would run them.  float64 throughout, so agreement is to rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from secondorder.lm.conv_rows import bias_rows, check_call, is_conv, patches, weight_rows

K = 3  # residuals per sample


def _rows_by_rule(conv: nn.Module, x: Tensor, readout: Tensor) -> list[tuple[Tensor, Tensor]]:
    """For each residual j: (weight rows, bias rows or empty) from the rule."""
    z = conv(x).detach().requires_grad_()
    r = torch.tanh(z).flatten(1) @ readout  # (N, K)
    out = []
    for j in range(K):
        (g,) = torch.autograd.grad(r[:, j].sum(), z, retain_graph=True)
        w = weight_rows(conv, x, g)
        b = bias_rows(conv, g) if conv.bias is not None else torch.empty(0)
        out.append((w, b))
    return out


def _rows_by_jacrev(conv: nn.Module, x: Tensor, readout: Tensor) -> dict[str, Tensor]:
    params = {k: v.detach() for k, v in conv.named_parameters()}

    def f(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        z = functional_call(conv, p, (xi.unsqueeze(0),))
        return torch.tanh(z).flatten(1)[0] @ readout

    jac: dict[str, Tensor] = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    return jac


CASES_2D: list[Any] = [
    {"kernel_size": 3},
    {"kernel_size": 3, "padding": 1},
    {"kernel_size": (2, 3), "stride": (2, 1), "padding": (1, 0)},
    {"kernel_size": 3, "dilation": 2, "padding": 2},
    {"kernel_size": 3, "padding": "same", "dilation": (1, 2)},
    pytest.param(  # even kernel: the extra pad goes after (torch warns of its own copy)
        {"kernel_size": 2, "padding": "same"},
        marks=pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel"),
    ),
    {"kernel_size": 3, "padding": "valid", "stride": 2},
    {"kernel_size": 3, "groups": 2},
    {"kernel_size": 1, "groups": 4},  # depthwise over 4 channels
    {"kernel_size": 3, "bias": False, "padding": 1},
    {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
    {"kernel_size": 3, "padding": 2, "padding_mode": "circular"},
    {"kernel_size": (3, 2), "padding": 1, "padding_mode": "replicate", "groups": 2},
]

CASES_1D: list[dict[str, Any]] = [
    {"kernel_size": 3},
    {"kernel_size": 4, "stride": 2, "padding": 1},
    {"kernel_size": 3, "dilation": 3, "padding": "same"},
    {"kernel_size": 3, "groups": 4, "bias": False},
    {"kernel_size": 3, "padding": 1, "padding_mode": "circular"},
]


def _check(conv: nn.Module, x: Tensor) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        features = conv(x)[0].numel()
    readout = torch.randn(features, K, dtype=torch.float64)
    ref = _rows_by_jacrev(conv, x, readout)
    for j, (w, b) in enumerate(_rows_by_rule(conv, x, readout)):
        expected_w = ref["weight"][:, j].reshape(x.shape[0], -1)
        torch.testing.assert_close(w, expected_w, rtol=1e-10, atol=1e-12)
        if conv.bias is not None:
            torch.testing.assert_close(b, ref["bias"][:, j], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", CASES_2D)
def test_conv2d_rows_match_jacrev(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, **options).double()
    _check(conv, torch.randn(5, 4, 7, 6, dtype=torch.float64))


@pytest.mark.parametrize("options", CASES_1D)
def test_conv1d_rows_match_jacrev(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    conv = nn.Conv1d(4, 8, **options).double()
    _check(conv, torch.randn(5, 4, 11, dtype=torch.float64))


def test_rows_written_into_a_strided_view_of_j_and_accumulated() -> None:
    """J's rows for residual j are a strided view: written in place, then added to."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 4, 3, padding=1, groups=2).double()
    conv1 = nn.Conv2d(2, 4, 3, padding=1).double()
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    g = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    for layer in (conv, conv1):
        numel = layer.weight.numel()
        jac = torch.full((3, 2, numel + 7), float("nan"), dtype=torch.float64)
        view = jac[:, 1, 7:]
        weight_rows(layer, x, g, out=view)
        expected = weight_rows(layer, x, g)
        torch.testing.assert_close(view, expected, rtol=0, atol=0)
        weight_rows(layer, x, 2 * g, out=view, accumulate=True)
        torch.testing.assert_close(view, 3 * expected, rtol=1e-12, atol=1e-12)
        assert torch.isnan(jac[:, 0]).all() and torch.isnan(jac[:, 1, :7]).all()


def test_patches_layout_matches_the_weight() -> None:
    """``W·patch`` at every position reproduces the convolution (the layout the rows use)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, (3, 2), stride=(1, 2), padding=(1, 1), groups=2).double()
    x = torch.randn(2, 4, 6, 7, dtype=torch.float64)
    cols = patches(conv, x)  # (N, G, Kg, L)
    w = conv.weight.reshape(2, 3, -1)  # (G, C_out/G, Kg)
    z = torch.einsum("gok,ngkl->ngol", w, cols).reshape(2, 6, -1) + conv.bias[:, None]
    torch.testing.assert_close(z, conv(x).flatten(2), rtol=1e-12, atol=1e-12)


def test_check_call_and_is_conv() -> None:
    conv = nn.Conv2d(3, 5, 3)
    x = torch.randn(4, 3, 6, 6)
    z = conv(x)
    assert check_call(conv, x, z, 4)
    assert not check_call(conv, x, z, 3)
    assert not check_call(conv, x[0], z[0], 4)  # unbatched call
    assert is_conv(conv) and is_conv(nn.Conv1d(1, 1, 1))
    assert not is_conv(nn.Conv3d(1, 1, 1)) and not is_conv(nn.Linear(2, 2))

    class MyConv(nn.Conv2d):
        pass

    assert not is_conv(MyConv(1, 1, 1))


def test_bad_arguments_are_refused_with_a_clear_message() -> None:
    conv = nn.Conv2d(3, 5, 3)
    x = torch.randn(4, 3, 6, 6)
    g = torch.randn(4, 5, 4, 4)
    with pytest.raises(TypeError, match=r"module=Linear has no per-sample convolution rule"):
        weight_rows(nn.Linear(2, 2), x, g)
    with pytest.raises(TypeError, match=r"module=Conv3d has no per-sample convolution rule"):
        bias_rows(nn.Conv3d(1, 1, 1), g)
    with pytest.raises(ValueError, match=r"inputs of shape \(3, 6, 6\) do not fit Conv2d"):
        weight_rows(conv, x[0], g)
    with pytest.raises(ValueError, match=r"inputs of shape \(4, 2, 6, 6\) .*in_channels=3"):
        patches(conv, x[:, :2])
    with pytest.raises(ValueError, match=r"grad_output of shape \(4, 4, 4, 4\) does not fit"):
        weight_rows(conv, x, g[:, :4])
    with pytest.raises(ValueError, match=r"grad_output of shape \(5, 4, 4\) does not fit"):
        bias_rows(conv, g[0])
    out = torch.zeros(4, 10)
    with pytest.raises(ValueError, match=r"out has shape \(4, 10\), expected \(4, 135\)"):
        weight_rows(conv, x, g, out=out)
    assert not out.any()  # refused before anything was written
