"""``nn.Embedding``: a Linear layer on one-hot inputs, so A is diagonal.

For token ``t`` the "input" is the one-hot vector ``e_t``; ``E[e_t e_tᵀ]`` is the
diagonal of token frequencies (positions holding ``padding_idx`` get no weight gradient,
so they count neither in A nor in G), kept as a vector (``num_embeddings`` numbers instead of
its square).  In the ``(o, i)`` layout the gradient is ``weight.grad.T``
(``embedding_dim × num_embeddings``), and the eigenvectors of A are the identity.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..sharding import write_grad
from .base import KFACLayer
from .linalg import spd_inverse, sym_eigh

__all__ = ["EmbeddingLayer"]


class EmbeddingLayer(KFACLayer):
    """K-FAC block of an ``nn.Embedding`` with a diagonal A (token frequencies)."""

    kind = "Embedding"

    def __init__(self, name: str, module: nn.Embedding, factor_dtype: torch.dtype | None) -> None:
        if module.sparse:
            raise ValueError(
                f"layer {name!r}: nn.Embedding(sparse=True) gives sparse gradients, which K-FAC "
                "cannot precondition; build it with sparse=False or pass it in skip_layers."
            )
        super().__init__(name, module, factor_dtype)
        self.embedding = module
        self.num = module.num_embeddings
        self.dim = module.embedding_dim

    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:  # noqa: D102
        return (1, self.num), (1, self.dim, self.dim)

    def identity_factors(self) -> tuple[Tensor, Tensor]:  # noqa: D102
        dt, dev = self.factor_dtype, self.device
        return (
            torch.ones(1, self.num, dtype=dt, device=dev),
            torch.eye(self.dim, dtype=dt, device=dev).unsqueeze(0),
        )

    def position_mask(self, x: Tensor) -> Tensor | None:  # noqa: D102
        pad = self.embedding.padding_idx
        return None if pad is None else x != pad

    def a_stats(self, x: Tensor) -> tuple[Tensor, int]:  # noqa: D102
        idx = x.reshape(-1).long()
        counts = torch.bincount(idx, minlength=self.num).to(self.factor_dtype)
        rows = idx.numel()
        pad = self.embedding.padding_idx
        if pad is not None:
            # padding positions get no weight gradient: they are not rows of A
            rows -= int(counts[pad])
            counts[pad] = 0.0
        return counts.unsqueeze(0), rows

    def a_input(self, x: Tensor) -> Tensor:  # noqa: D102
        # indices are integers: counted without casting to the factor dtype first
        return x.detach()

    def g_stats(self, g: Tensor) -> Tensor:  # noqa: D102
        g = g.reshape(-1, g.shape[-1])
        return (g.T @ g).unsqueeze(0)

    def grad(self, whole: Mapping[Tensor, Tensor] | None = None) -> Tensor | None:  # noqa: D102
        w = self.param_grad(self.embedding.weight, whole)
        return None if w is None else w.T.unsqueeze(0)

    def set_grad(self, p: Tensor) -> None:  # noqa: D102
        weight = self.embedding.weight
        assert weight.grad is not None
        write_grad(weight, p[0].T)

    def inverse_shapes(self, method: str, uses: int = 1) -> dict[str, tuple[int, ...]]:  # noqa: D102
        if method == "eigen":
            return {"dA": (1, self.num), "QG": (1, self.dim, self.dim), "dG": (1, self.dim)}
        return {"A_inv": (1, self.num), "G_inv": (1, self.dim, self.dim)}

    def decomposition(  # noqa: D102
        self,
        method: str,
        damping: float,
        dtype: torch.dtype,
        uses: int = 1,
        factors: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        a, g = self._factors(factors)
        if method == "eigen":
            dG, QG = sym_eigh(g, dtype)
            inv = {"dA": a.to(dtype).clamp(min=0.0), "QG": QG, "dG": dG}
        else:
            eye = torch.eye(self.dim, dtype=dtype, device=self.device)
            inv = {
                "A_inv": 1.0 / (a.to(dtype) + damping),
                "G_inv": spd_inverse(g.to(dtype) + damping * eye),
            }
        return self.contiguous(inv)

    def precondition(  # noqa: D102
        self, grad: Tensor, method: str, damping: float, inv: dict[str, Tensor] | None = None
    ) -> Tensor:
        inv = self.inv if inv is None else inv
        if method == "eigen":
            dA, QG, dG = inv["dA"], inv["QG"], inv["dG"]
            v = QG.mT @ grad.to(QG.dtype)
            v = v / (dG.unsqueeze(-1) * dA.unsqueeze(-2) + damping)
            p = QG @ v
        else:
            p = (inv["G_inv"] @ grad.to(inv["G_inv"].dtype)) * inv["A_inv"].unsqueeze(-2)
        return p.to(grad.dtype)

    def curvature(self, delta: Tensor) -> Tensor:  # noqa: D102
        assert self.A is not None and self.G is not None
        d = delta.to(self.G.dtype)
        return (d * ((self.G @ d) * self.A.unsqueeze(-2))).sum()
