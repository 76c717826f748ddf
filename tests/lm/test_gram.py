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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_slice_gram_of_j_and_r_carries_jtr(dtype: torch.dtype) -> None:
    """The primal Gram of one slice is the Gram of ``[J r]`` (the outer-product rule
    writes r as its rows' last column): ``JᵀJ`` and ``Jᵀr`` against ``jacrev``."""
    import secondorder as so
    from secondorder.lm import problem as problem_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    model = model.to(dtype)
    x = torch.randn(300, 2, dtype=dtype)
    y = torch.randn(300, 1, dtype=dtype)
    opt = so.LevenbergMarquardt(model, form="primal", solver="cholesky", gram_dtype=dtype)
    opt.plan(x, y)
    prob = opt.internals().problem
    assert prob is not None
    shapes: list[tuple[int, ...]] = []
    real = problem_module.gram_update

    def spy(gram, jac, *args):  # type: ignore[no-untyped-def]
        shapes.append(tuple(jac.shape))
        return real(gram, jac, *args)

    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    problem_module.gram_update = spy
    try:
        system = prob.linearize(theta)
    finally:
        problem_module.gram_update = real
    n = theta.numel()
    assert shapes == [(300, n + 1)]  # one product, of [J r]

    def r(t: torch.Tensor) -> torch.Tensor:
        return prob.batch_residuals(prob.unflatten(t), x, y)

    jac = torch.func.jacrev(r)(theta).double()
    res = r(theta).double()
    assert system.gram is not None and system.gram.shape == (n, n)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    scale = float((jac.T @ jac).abs().max())
    torch.testing.assert_close(system.gram.double(), jac.T @ jac, rtol=0, atol=tol * scale)
    torch.testing.assert_close(
        system.grad.double(), jac.T @ res, rtol=0, atol=tol * float((jac.T @ res).abs().max())
    )
    assert system.grad.dtype == dtype
    torch.testing.assert_close(system.col_sq.double(), (jac * jac).sum(0), rtol=tol, atol=0)
