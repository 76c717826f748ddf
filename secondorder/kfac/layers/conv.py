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
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..._conv import padded, windows
from ..sharding import write_grad
from .base import KroneckerLayer

__all__ = ["ConvLayer", "conv_patch_rows", "conv_patches"]


def conv_patches(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """The input patches of ``module`` on ``x``: ``(N, C·k, positions)``, channel-major.

    Row ``c·K + j`` of a patch is input channel ``c`` at kernel offset ``j`` (row-major
    over the kernel), the layout of ``weight.reshape(O, -1)``.
    """
    x = padded(module, x)
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


def conv_patch_rows(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """The patches of :func:`conv_patches` as rows: ``(groups, N·positions, C/groups·k)``.

    Row ``n·P + p`` is sample ``n`` at output position ``p`` (row-major), column
    ``c·K + j`` input channel ``c`` of the group at kernel offset ``j``.  Cut from a
    strided view of the padded input and copied once into this layout: ``F.unfold``
    would write the patches once and the permutation to rows copy them again.
    """
    v = windows(module, x)  # (N, C, *positions, *kernel)
    nd = len(module.kernel_size)
    n, c = v.shape[:2]
    g = module.groups
    v = v.reshape(n, g, c // g, *v.shape[2:])
    # (g, N, *positions, C/g, *kernel)
    order = (1, 0, *range(3, 3 + nd), 2, *range(3 + nd, 3 + 2 * nd))
    rows = v.permute(order)
    k = c // g * math.prod(module.kernel_size)
    return rows.reshape(g, -1, k)


class ConvLayer(KroneckerLayer):
    """K-FAC block of an ``nn.Conv1d`` or ``nn.Conv2d`` (any stride/padding/dilation/groups)."""

    def __init__(
        self, name: str, module: nn.Conv1d | nn.Conv2d, factor_dtype: torch.dtype | None
    ) -> None:
        super().__init__(name, module, factor_dtype)
        self.kind = type(module).__name__
        self.conv = module
        self.groups = module.groups
        self.has_bias = module.bias is not None and module.bias.requires_grad
        k = math.prod(module.kernel_size)
        self.n_in = module.in_channels // module.groups * k + int(self.has_bias)
        self.n_out = module.out_channels // module.groups

    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:  # noqa: D102
        g = self.groups
        return (g, self.n_in, self.n_in), (g, self.n_out, self.n_out)

    def _unbatched(self, t: Tensor) -> bool:
        # an unbatched input or output gradient is (C, *spatial): one sample
        return t.ndim == len(self.conv.kernel_size) + 1

    def batch_size(self, x: Tensor) -> int:  # noqa: D102
        return 1 if self._unbatched(x) else int(x.shape[0])

    def a_rows_of(self, x: Tensor) -> Tensor:  # noqa: D102
        return conv_patch_rows(self.conv, x.unsqueeze(0) if self._unbatched(x) else x)

    def g_rows_of(self, g: Tensor) -> Tensor:  # noqa: D102
        if self._unbatched(g):
            g = g.unsqueeze(0)
        n, o = g.shape[:2]
        k = self.groups
        # (groups, N·positions, o/groups), rows in the order of conv_patch_rows
        return g.reshape(n, k, o // k, -1).permute(1, 0, 3, 2).reshape(k, -1, o // k)

    def grad(self, whole: Mapping[Tensor, Tensor] | None = None) -> Tensor | None:  # noqa: D102
        w = self.param_grad(self.conv.weight, whole)
        if w is None:
            return None
        k = self.groups
        m = w.reshape(k, self.n_out, -1)
        if self.has_bias:
            assert self.conv.bias is not None
            b = self.param_grad(self.conv.bias, whole)
            b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
            m = torch.cat([m, b.reshape(k, self.n_out, 1)], dim=2)
        return m

    def set_grad(self, p: Tensor) -> None:  # noqa: D102
        weight = self.conv.weight
        assert weight.grad is not None
        n_w = self.n_in - int(self.has_bias)
        write_grad(weight, p[:, :, :n_w].reshape(weight.shape))
        bias = self.conv.bias
        if self.has_bias and bias is not None and bias.requires_grad:
            write_grad(bias, p[:, :, -1].reshape(-1))
