"""``nn.Conv1d`` / ``nn.Conv2d`` by the KFC rule: every output position is a row.

The patches are taken from the input *after* the padding that the module applies
(``padding_mode`` zeros, reflect, replicate or circular, and the asymmetric split of
``padding="same"``), with the module's stride and dilation, so that
``W_flat @ patch + b`` reproduces each output value exactly.  KAISA unfolded the
unpadded input with stride and padding only: dilated kernels and non-zero padding
modes got wrong A factors.  Groups are independent blocks: group ``k`` sees input
channels ``k·C/groups ...`` and produces output channels ``k·O/groups ...``, so A and
G are stacks of ``groups`` matrices.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import KroneckerLayer

__all__ = ["ConvLayer", "conv_patches"]


def conv_patches(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """The input patches of ``module`` on ``x``: ``(N, C·k, positions)``, channel-major.

    Row ``c·K + j`` of a patch is input channel ``c`` at kernel offset ``j`` (row-major
    over the kernel), the layout of ``weight.reshape(O, -1)``.
    """
    pad = module._reversed_padding_repeated_twice
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, list(pad), mode=mode)
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(-2)
        kernel, dilation, stride = (
            (1, *module.kernel_size),
            (1, *module.dilation),
            (1, *module.stride),
        )
    else:
        kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    return F.unfold(x, kernel_size=kernel, dilation=dilation, stride=stride)


class ConvLayer(KroneckerLayer):
    """K-FAC block of an ``nn.Conv1d`` or ``nn.Conv2d`` (any stride/padding/dilation/groups)."""

    def __init__(
        self, name: str, module: nn.Conv1d | nn.Conv2d, factor_dtype: torch.dtype | None
    ) -> None:
        super().__init__(name, module, factor_dtype)
        self.kind = type(module).__name__
        self.conv = module
        self.groups = module.groups
        self.has_bias = module.bias is not None
        k = math.prod(module.kernel_size)
        self.n_in = module.in_channels // module.groups * k + int(self.has_bias)
        self.n_out = module.out_channels // module.groups

    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:  # noqa: D102
        g = self.groups
        return (g, self.n_in, self.n_in), (g, self.n_out, self.n_out)

    def a_stats(self, x: Tensor) -> tuple[Tensor, int]:  # noqa: D102
        p = conv_patches(self.conv, x)  # (N, C·k, L)
        n, ck, length = p.shape
        g = self.groups
        # (groups, N·L, C/g·k): rows are (sample, position) pairs.
        a = p.reshape(n, g, ck // g, length).permute(1, 0, 3, 2).reshape(g, n * length, ck // g)
        if self.has_bias:
            a = torch.cat([a, a.new_ones(g, n * length, 1)], dim=2)
        return a.mT @ a, n * length

    def g_stats(self, g: Tensor) -> Tensor:  # noqa: D102
        n, o = g.shape[:2]
        k = self.groups
        rows = g.reshape(n, k, o // k, -1).permute(1, 0, 3, 2).reshape(k, -1, o // k)
        return rows.mT @ rows

    def grad(self) -> Tensor | None:  # noqa: D102
        w = self.conv.weight.grad
        if w is None:
            return None
        k = self.groups
        m = w.reshape(k, self.n_out, -1)
        if self.has_bias:
            assert self.conv.bias is not None
            b = self.conv.bias.grad
            b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
            m = torch.cat([m, b.reshape(k, self.n_out, 1)], dim=2)
        return m

    def set_grad(self, p: Tensor) -> None:  # noqa: D102
        weight = self.conv.weight
        assert weight.grad is not None
        n_w = self.n_in - int(self.has_bias)
        weight.grad.copy_(p[:, :, :n_w].reshape(weight.shape))
        if self.has_bias:
            bias = self.conv.bias
            assert bias is not None
            if bias.grad is None:
                bias.grad = torch.empty_like(bias)
            bias.grad.copy_(p[:, :, -1].reshape(-1))
