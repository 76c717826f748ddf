"""Symmetric products of one LM iteration: the Gram ``JᵀJ`` and the dual ``Js Jsᵀ``.

Both are symmetric, so wide operands are multiplied block by block on and above the
diagonal and the blocks below are copied: fewer flops, and an exactly symmetric
result off the diagonal blocks.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

__all__ = ["dual_blocks", "gram_blocks", "gram_update", "symmetric_product"]


def gram_blocks(n: int) -> int:
    """Column blocks :func:`gram_update` splits an ``n``-column Jacobian into.

    ``JᵀJ`` is symmetric: with the columns in k blocks, only the k(k+1)/2 blocks on
    and above the diagonal need a product, ``(k+1)/2k`` of a general product's
    flops (75% for k = 2, 62.5% for k = 4), and the rest is a copy.  Each block
    product must stay wide enough for the matrix-multiply kernel to run near its
    peak: blocks are at least 96 columns, and at most 4
    (``python -m benchmarks.experiments.gram_blocks`` times the choices).
    """
    return max(1, min(4, n // 96))


def gram_update(
    gram: Tensor | None, jac: Tensor, dtype: torch.dtype | None = None, chunk: int | None = None
) -> Tensor:
    """Return ``gram + JᵀJ`` (``JᵀJ`` when ``gram`` is None), in ``dtype``.

    J (a slice of rows) is converted to ``dtype`` (default: its own) first; products
    of float32 entries are exact in float64, so a float64 Gram of a float32 J carries
    only the rounding of its sums.  With ``chunk``, a float64 Gram of a float32 J is
    instead summed from float32 products of ``chunk`` rows at a time (no float64 copy
    of J; :meth:`~secondorder.lm.precision.GramPrecision.chunk_rows` says when that is
    accurate enough).  ``gram`` is updated in place.  Wide Jacobians are multiplied
    block by block above the diagonal (:func:`gram_blocks`), a symmetric rank-k
    update written with general products so it runs on any device; the result is
    exactly symmetric off the diagonal blocks.
    """
    if chunk is not None and dtype == torch.float64 and jac.dtype == torch.float32:
        n = jac.shape[1]
        if gram is None:
            gram = torch.zeros(n, n, dtype=torch.float64, device=jac.device)
        for start in range(0, jac.shape[0], chunk):
            gram.add_(gram_update(None, jac[start : start + chunk]))
        return gram
    j = jac if dtype is None else jac.to(dtype)
    n = j.shape[1]
    k = gram_blocks(n)
    if k == 1:
        return j.T @ j if gram is None else gram.addmm_(j.T, j)
    if gram is None:
        gram = torch.zeros(n, n, dtype=j.dtype, device=j.device)
    return _add_blocked_aat(gram, j.T, k)


def _add_blocked_aat(out: Tensor, a: Tensor, blocks: int) -> Tensor:
    """``out += A Aᵀ``, A's rows in ``blocks`` blocks; returns ``out``.

    Products on and above the diagonal only; the blocks below are copies of those
    above, so the result is exactly symmetric off the diagonal blocks.  The Gram is
    this with ``A = Jᵀ``, the dual matrix with ``A = J D^-½``.
    """
    m = a.shape[0]
    edges = [(i * m) // blocks for i in range(blocks + 1)]
    for lo, hi in itertools.pairwise(edges):
        out[lo:hi, lo:].addmm_(a[lo:hi], a[lo:].T)
    for lo, hi in itertools.pairwise(edges[:-1]):
        out[hi:, lo:hi] = out[lo:hi, hi:].T
    return out


def dual_blocks(m: int, device: torch.device | None = None) -> int:
    """Row blocks :func:`symmetric_product` splits an m-row product into.

    As in :func:`gram_blocks`, only the blocks on and above the diagonal need a
    product: 75% of the flops with 2 blocks.  Two blocks from 64 rows on, no more (more
    blocks of few rows were no faster where it was measured), and one
    block off the CPU, where a single launch is cheaper at these sizes.
    """
    if device is not None and device.type != "cpu":
        return 1
    return max(1, min(2, m // 32))


def symmetric_product(js: Tensor) -> Tensor:
    """``Js Jsᵀ`` (m × m): the dual form's normal matrix, a row block at a time.

    Each row block is multiplied by the rows from its own onwards (one product per
    block, :func:`dual_blocks`), and the blocks below the diagonal are copies of those
    above, so the result is exactly symmetric off the diagonal blocks.
    """
    m = js.shape[0]
    blocks = dual_blocks(m, js.device)
    if blocks == 1:
        return js @ js.T
    return _add_blocked_aat(torch.zeros(m, m, dtype=js.dtype, device=js.device), js, blocks)
