"""``nn.Linear``: ``a`` is the input row (and a 1 for the bias), ``g`` the output gradient.

Inputs with extra dimensions ``(N, ..., in)`` (tokens of a sequence) count each
position as one row of A and add its gradient to the sample's G, as convolutions do;
an unbatched input ``(in,)`` is one sample.  A bias that is frozen when K-FAC is built
is left out of the factors: the weight's block is then the Fisher block of the
trainable parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..sharding import write_grad
from .base import KroneckerLayer

__all__ = ["LinearLayer"]


class LinearLayer(KroneckerLayer):
    """K-FAC block of an ``nn.Linear`` layer (weight and bias preconditioned together)."""

    kind = "Linear"

    def __init__(self, name: str, module: nn.Linear, factor_dtype: torch.dtype | None) -> None:
        super().__init__(name, module, factor_dtype)
        self.linear = module
        self.has_bias = module.bias is not None and module.bias.requires_grad
        self.n_in = module.in_features + int(self.has_bias)
        self.n_out = module.out_features

    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:  # noqa: D102
        return (1, self.n_in, self.n_in), (1, self.n_out, self.n_out)

    def batch_size(self, x: Tensor) -> int:  # noqa: D102
        return 1 if x.ndim == 1 else int(x.shape[0])

    def a_rows_of(self, x: Tensor) -> Tensor:  # noqa: D102
        return x.reshape(1, -1, x.shape[-1])

    def g_rows_of(self, g: Tensor) -> Tensor:  # noqa: D102
        return g.reshape(1, -1, g.shape[-1])

    def grad(self, whole: Mapping[Tensor, Tensor] | None = None) -> Tensor | None:  # noqa: D102
        w = self.param_grad(self.linear.weight, whole)
        if w is None:
            return None
        if self.has_bias:
            b = self.param_grad(self.linear.bias, whole)
            b = torch.zeros_like(w[:, 0]) if b is None else b
            w = torch.cat([w, b.unsqueeze(1)], dim=1)
        return w.unsqueeze(0)

    def set_grad(self, p: Tensor) -> None:  # noqa: D102
        p = p[0]
        weight = self.linear.weight
        assert weight.grad is not None
        write_grad(weight, p[:, : weight.shape[1]])
        bias = self.linear.bias
        if self.has_bias and bias is not None and bias.requires_grad:
            write_grad(bias, p[:, -1])
