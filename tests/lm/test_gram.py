"""The Gram accumulation helper against a float64 general product."""

from __future__ import annotations

import itertools

import pytest
import torch

from secondorder.lm.linalg import gram_blocks, gram_update


@pytest.mark.parametrize("n", [7, 255, 600, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gram_update_accumulates_slices_exactly_symmetric(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    slices = [torch.randn(rows, n, generator=g) for rows in (40, 3, 57)]
    gram = None
    for j in slices:
        gram = gram_update(gram, j, dtype)
    assert gram is not None and gram.dtype == dtype and gram.shape == (n, n)
    whole = torch.cat(slices).double()
    reference = whole.T @ whole
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(
        gram.double(), reference, rtol=0, atol=tol * float(reference.abs().max())
    )
    k = gram_blocks(n)
    if k > 1:
        # The blocks below the diagonal blocks are copies of those above: exactly equal.
        edges = [(i * n) // k for i in range(k + 1)]
        block = torch.zeros(n, dtype=torch.long)
        for b, (lo, hi) in enumerate(itertools.pairwise(edges)):
            block[lo:hi] = b
        off = block[:, None] > block[None, :]
        assert torch.equal(gram[off], gram.T[off])


def test_gram_update_keeps_the_slice_dtype_by_default_and_updates_in_place() -> None:
    j = torch.randn(30, 520)
    first = gram_update(None, j)
    assert first.dtype == torch.float32
    again = gram_update(first, j)
    assert again is first
    torch.testing.assert_close(again, 2 * (j.T @ j), rtol=1e-5, atol=1e-3)


def test_gram_blocks_by_width() -> None:
    widths = (1, 95, 191, 193, 287, 300, 769, 5000)
    assert [gram_blocks(n) for n in widths] == [1, 1, 1, 2, 2, 3, 4, 4]
