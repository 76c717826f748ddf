"""Factor statistics of the outer-product rule.

``Jᵀr``, ``diag(JᵀJ)`` and ``J Jᵀ`` from a layer's factors instead of a pass over J.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

#: A layer's rows are taken from its factors only where its J block holds at least
#: this many times the factors' entries (fan_out·fan_in against fan_out + fan_in).
FACTOR_GAIN = 4
#: ... and only for slices of J with at least this many entries: below, a pass over J
#: costs about what the products' dozen extra operations do (measured at 256 × 1,370).
#: (J Jᵀ from the factors, :class:`FactorGram`, has no such floor.)
FACTOR_MIN_ENTRIES = 1 << 20


@dataclass(frozen=True)
class _Factors:
    """One ``nn.Linear`` call's rows for residual j: ``g_i a_iᵀ`` (weight) and ``g_i`` (bias)."""

    weight: int | None  # J's first column of the weight block, if trainable
    bias: int | None  # J's first column of the bias block, if trainable
    g: Tensor  # (batch, fan_out): ∂r_ij/∂z_i
    a: Tensor  # (batch, fan_in): the layer's input
    r: Tensor  # (batch,): r_ij


@dataclass(frozen=True)
class RowSums:
    """What :meth:`RowProducts.take` hands out for one slice's rows.

    Attributes:
        grad: ``Jᵀr``; ``None`` when ``augmented`` is handed out instead.
        col_sq: ``diag(JᵀJ)`` when asked for, else ``None``.
        outer: ``J Jᵀ`` from the layers' factors (:class:`FactorGram`) when every
            column of J is one outer product per row, else ``None``.
        augmented: ``[J r]`` (rows × (n + 1)), the buffer J lives in with r as its
            last column, when asked for: the Gram of it carries ``JᵀJ`` and ``Jᵀr``
            in one product, without a pass over J for ``Jᵀr``.
    """

    grad: Tensor | None
    col_sq: Tensor | None
    outer: FactorGram | None
    augmented: Tensor | None = None


class FactorGram:
    """``J Jᵀ`` (m × m) of outer-product rows, from the layers' factors.

    Row i of J holds ``vec(gᵢaᵢᵀ)`` and ``gᵢ`` for each layer, so
    ``Jᵢ·Jⱼ = Σ_layers (gᵢ·gⱼ)(aᵢ·aⱼ + 1)`` (the 1 for the bias): a Hadamard product
    of two small Grams per layer, m²(fan_out + fan_in) multiply-adds where the
    product of J's rows costs m²·n.  The few columns that are not one outer product
    per row (a convolution's, a narrow layer's) add their own block's product.  Cheap
    enough in float64 at any λ.
    """

    def __init__(
        self, factors: list[_Factors], rows: Tensor, blocks: list[tuple[int, int]]
    ) -> None:
        self.factors, self.rows, self.blocks = factors, rows, blocks

    def __call__(self, dtype: torch.dtype) -> Tensor:
        """``J Jᵀ`` in ``dtype``."""
        m = self.rows.shape[0]
        out = torch.zeros(m, m, dtype=dtype, device=self.rows.device)
        for lo, hi in self.blocks:
            block = self.rows[:, lo:hi].to(dtype)
            out.addmm_(block, block.T)
        for f in self.factors:
            if f.weight is None and f.bias is None:
                continue  # both blocks are read from J (a layer called twice, say)
            g = f.g.to(dtype)
            gg = g @ g.T
            if f.weight is None:
                out += gg  # the bias alone: its rows are gᵢ
                continue
            a = f.a.to(dtype)
            aa = a @ a.T
            if f.bias is not None:
                aa += 1.0
            out += gg * aa
        return out


class RowProducts:
    """``Jᵀr`` and ``diag(JᵀJ)`` of the rows the outer-product rule last wrote.

    A linear layer's rows are outer products ``g_i a_iᵀ``, so their products with r
    and their squared column norms are small products of the layer's factors:
    ``Σᵢ rᵢ gᵢ aᵢᵀ = gᵀ diag(r) a`` and ``Σᵢ gᵢ² (aᵢ²)ᵀ``, with batch × (fan_out +
    fan_in) reads instead of a pass over J's batch × fan_out × fan_in entries.  Blocks
    that are sums of outer products (a layer called twice, convolution windows, extra
    dimensions between the batch and the features) are read from J's columns, and so
    is all of a small J (below :data:`FACTOR_MIN_ENTRIES` a pass costs about what the
    products' extra operations do).  Where every column is a factor's, ``J Jᵀ`` comes
    from the factors too (:class:`FactorGram`).

    The rule records its factors with the rows it returns; :meth:`take` hands the
    products out once, for those rows only (recognised by identity, held weakly so
    that the rows' pooled buffer is not kept busy).
    """

    def __init__(self) -> None:
        self._rows: weakref.ref[Tensor] | None = None
        self._factors: list[_Factors] = []
        self._from_rows: list[tuple[int, int]] = []
        self._r: Tensor | None = None

    def record(
        self,
        rows: Tensor,
        r: Tensor,
        factors: list[_Factors],
        from_rows: list[tuple[int, int]],
    ) -> None:
        """Remember ``rows`` (J, 2-D), ``r`` and how J's column ranges were written.

        ``rows`` are the first n columns of a buffer whose last column is r.
        """
        self._rows = weakref.ref(rows)
        self._r, self._factors, self._from_rows = r, factors, from_rows

    def clear(self) -> None:
        """Forget the last rows (a strategy that returned other rows)."""
        self._rows, self._r = None, None
        self._factors, self._from_rows = [], []

    def take(
        self, rows: Tensor, col_sq: bool, outer: bool = False, augmented: bool = False
    ) -> RowSums | None:
        """:class:`RowSums` for ``rows`` if the rule recorded them, else ``None``.

        ``outer``: whether to hand out ``J Jᵀ`` too (it holds the rows: ask only where
        they are kept anyway, as the dual form keeps them).  ``augmented``: hand out
        ``[J r]`` in place of ``Jᵀr`` (for a Gram of one slice).
        """
        held = None if self._rows is None else self._rows()
        r, factors, from_rows = self._r, self._factors, self._from_rows
        self.clear()
        if held is None or held is not rows or r is None:
            return None
        m, n = rows.shape
        if augmented and rows.stride() == (n + 1, 1):
            # [J r]: the same storage, one column wider (the rule wrote r there).
            wide = rows.as_strided((m, n + 1), (n + 1, 1), rows.storage_offset())
            return RowSums(None, None, None, wide)
        if not factors:
            return None  # one pass over J each, as the caller makes them
        # One residual per sample and at most a quarter of the columns read from J:
        # J Jᵀ from the factors.
        read = sum(hi - lo for lo, hi in from_rows)
        per_sample = all(f.g.shape[0] == rows.shape[0] for f in factors)
        gram = (
            FactorGram(factors, rows, from_rows) if outer and per_sample and 4 * read <= n else None
        )
        if rows.numel() < FACTOR_MIN_ENTRIES:
            return RowSums(rows.T @ r, (rows * rows).sum(0) if col_sq else None, gram)
        grad = torch.zeros(n, dtype=rows.dtype, device=rows.device)
        col = torch.zeros(n, dtype=rows.dtype, device=rows.device) if col_sq else None
        for f in factors:
            _add_products(f, grad, col)
        for lo, hi in from_rows:
            block = rows[:, lo:hi]
            grad[lo:hi] += block.T @ r
            if col is not None:
                col[lo:hi] += (block * block).sum(0)
        return RowSums(grad, col, gram)


def _add_products(f: _Factors, grad: Tensor, col: Tensor | None) -> None:
    """Add one layer call's ``gᵀ diag(r) a``, ``gᵀr`` (and squared norms) into the vectors.

    The scaled factor is the narrower one, and the bias rides along as a column of
    ones (or a sum), so the wider factor is read once per vector.
    """
    g, a, r = f.g, f.a, f.r
    fan_out, fan_in = g.shape[1], a.shape[1]
    wsize = fan_out * fan_in
    for target, gg, aa, rr in (
        (grad, g, a, r),
        (col, None if col is None else g * g, None if col is None else a * a, None),
    ):
        if target is None or gg is None or aa is None:
            continue
        if fan_out <= fan_in:
            left = gg if rr is None else gg * rr[:, None]
            if f.weight is not None:
                target[f.weight : f.weight + wsize].view(fan_out, fan_in).addmm_(left.T, aa)
            if f.bias is not None:
                target[f.bias : f.bias + fan_out] += left.sum(0)
            continue
        right = aa if rr is None else aa * rr[:, None]
        ones = torch.ones_like(right[:, :1]) if rr is None else rr[:, None]
        # (narrow)ᵀ·(wide), then transposed: a thin right operand runs far below
        # the matrix-multiply kernel's speed (measured 5x slower at 2 columns).
        both = torch.cat([right, ones], 1).T @ gg
        if f.weight is not None:
            target[f.weight : f.weight + wsize].view(fan_out, fan_in).add_(both[:fan_in].T)
        if f.bias is not None:
            target[f.bias : f.bias + fan_out] += both[fan_in]
