"""Root inverses against closed forms and float64 eigh; blocking on hand-worked shapes; LPT."""

from __future__ import annotations

import math

import pytest
import torch

from secondorder.shampoo import assign_blocks
from secondorder.shampoo.blocking import block_slices, merge_dims
from secondorder.shampoo.preconditioner import mode_product
from secondorder.shampoo.root_inverse import (
    all_finite,
    batched_eigh,
    coupled_newton_root_inverse,
    eigh_root_inverse,
    finite_per_matrix,
)

D = torch.float64


def _spd(n: int, spectrum: list[float], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=D))
    return Q @ torch.diag(torch.tensor(spectrum, dtype=D)) @ Q.T


def test_closed_form_diag_1_4_inverse_square_root() -> None:
    A = torch.diag(torch.tensor([1.0, 4.0], dtype=D))[None]
    X, failed = eigh_root_inverse(A, 2, 1e-300)
    torch.testing.assert_close(
        X[0], torch.diag(torch.tensor([1.0, 0.5], dtype=D)), rtol=0, atol=1e-15
    )
    assert not failed.any()


def test_known_spectra_batched_equal_closed_form() -> None:
    spectra = [[1.0, 16.0, 81.0], [0.5, 2.0, 8.0]]
    A = torch.stack([_spd(3, s, i) for i, s in enumerate(spectra)])
    for root in (2, 4):
        X, _ = eigh_root_inverse(A, root, 0.0 + 1e-300)
        for i, s in enumerate(spectra):
            want = _spd(3, [v ** (-1.0 / root) for v in s], i)
            torch.testing.assert_close(X[i], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pseudo_inverse", [False, True])
def test_factored_root_d_transpose_d_equals_the_formed_root(pseudo_inverse: bool) -> None:
    # D = diag(λ^(-1/2p)) Qᵀ must satisfy DᵀD = (A + εI)^(-1/p) (and the pseudo-inverse root).
    A = torch.stack([_spd(5, [0.0, 1e-3, 0.5, 2.0, 9.0], 1), _spd(5, [-1e-4, 1, 2, 3, 4], 2)])
    eps = 0.0 if pseudo_inverse else 1e-6
    X, failed = eigh_root_inverse(A, 4, eps, pseudo_inverse=pseudo_inverse)
    Dm, failed_d = eigh_root_inverse(A, 4, eps, pseudo_inverse=pseudo_inverse, factored=True)
    torch.testing.assert_close(Dm.mT @ Dm, X, rtol=1e-12, atol=1e-12)
    assert not failed.any() and not failed_d.any()


def test_finite_per_matrix_equals_isfinite() -> None:
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4, 6, 6, generator=g, dtype=D)
    A[1, 5, 0] = float("nan")
    A[2, 0, 3] = float("inf")
    A[3, 4, 4] = -float("inf")
    A[0, 1, 2], A[0, 2, 1] = torch.finfo(D).max, -torch.finfo(D).max  # finite extremes
    want = torch.isfinite(A).flatten(1).all(dim=1)
    assert want.tolist() == [True, False, False, False]
    assert torch.equal(finite_per_matrix(A), want)
    # Column-major (as eigh returns eigenvectors) and vectors (B, n).
    assert torch.equal(finite_per_matrix(A.mT.contiguous().mT), want)
    assert torch.equal(finite_per_matrix(A[:, 0, :].contiguous()), torch.isfinite(A[:, 0]).all(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_finite_equals_isfinite(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.finfo(dtype).max
    for special in (None, float("nan"), float("inf"), -float("inf"), big, -big):
        L = torch.randn(3, 5, generator=g, dtype=dtype)
        Q = torch.randn(3, 5, 5, generator=g, dtype=dtype).mT  # column-major, as eigh's
        for target in (L, Q):
            if special is not None:
                T = target.clone()
                T[1, 2, ...] = special
                pair = (T, Q) if target is L else (L, T)
            else:
                pair = (L, Q)
            want = bool(torch.isfinite(pair[0]).all() and torch.isfinite(pair[1]).all())
            assert want == (special is None or abs(special) == big)
            got = all_finite(*pair)
            assert got.ndim == 0 and bool(got) == want
            assert bool(all_finite(pair[target is Q])) == bool(
                torch.isfinite(pair[target is Q]).all()
            )


def test_epsilon_shift_matches_eigh_reference() -> None:
    # An indefinite matrix (smallest eigenvalue -1e-3 < eps): every eigenvalue of A + eps I
    # is shifted so the smallest becomes eps, as DistributedShampoo does.
    eps = 1e-6
    A = _spd(4, [-1e-3, 0.1, 1.0, 3.0], 7)[None]
    L, Q = torch.linalg.eigh(A[0] + eps * torch.eye(4, dtype=D))
    L = L - L.min() + eps
    want = Q @ torch.diag(L ** (-1 / 4)) @ Q.T
    X, _ = eigh_root_inverse(A, 4, eps)
    torch.testing.assert_close(X[0], want, rtol=1e-12, atol=1e-12)
    # Positive definite: only epsilon is added.
    B = _spd(3, [0.2, 1.0, 5.0], 3)[None]
    want_b = _spd(3, [(0.2 + eps) ** -0.5, (1.0 + eps) ** -0.5, (5.0 + eps) ** -0.5], 3)
    torch.testing.assert_close(eigh_root_inverse(B, 2, eps)[0][0], want_b, rtol=1e-12, atol=1e-12)


def test_pseudo_inverse_drops_null_space() -> None:
    v = torch.tensor([3.0, 4.0], dtype=D) / 5
    A = (25.0 * torch.outer(v, v))[None]  # rank 1, eigenvalue 25 along v
    X, failed = eigh_root_inverse(A, 2, 0.0, pseudo_inverse=True)
    torch.testing.assert_close(X[0], torch.outer(v, v) / 5.0, rtol=0, atol=1e-14)
    assert not failed.any()


def test_coupled_newton_equals_eigh_float64() -> None:
    A = torch.stack([_spd(5, [0.5, 1.0, 2.0, 3.0, 4.0], 1), _spd(5, [1.0] * 5, 2)])
    for root in (2, 4):
        X, failed, converged = coupled_newton_root_inverse(A, root, 1e-12, tolerance=1e-13)
        ref, _ = eigh_root_inverse(A, root, 1e-12)
        assert not failed.any() and converged.all()
        torch.testing.assert_close(X, ref, rtol=1e-10, atol=1e-10)
    _, failed, converged = coupled_newton_root_inverse(A, 2, 0.0, max_iterations=1, tolerance=1e-13)
    assert not failed.any() and not converged.any()


def test_eigh_falls_back_to_float64_then_marks_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    import secondorder.shampoo.root_inverse as ri

    real = torch.linalg.eigh
    calls: list[torch.dtype] = []

    def flaky(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(A.dtype)
        if A.dtype == torch.float32:
            raise RuntimeError("linalg.eigh: the algorithm failed to converge")
        return real(A)

    monkeypatch.setattr(ri, "_eigh", flaky)
    A = torch.stack([_spd(3, [1.0, 2.0, 3.0], 0), _spd(3, [1.0, 4.0, 9.0], 1)]).float()
    res = batched_eigh(A)
    assert calls == [torch.float32, torch.float64] and not res.failed.any()
    torch.testing.assert_close(
        res.eigenvalues[1], torch.tensor([1.0, 4.0, 9.0]), rtol=1e-6, atol=1e-6
    )

    def fails_on_second(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if A.shape[0] > 1 or bool((A[0].diagonal().sum() - 14.0).abs() < 1e-3):
            raise RuntimeError("no convergence")
        return real(A)

    monkeypatch.setattr(ri, "_eigh", fails_on_second)
    res = batched_eigh(A)
    assert res.failed.tolist() == [False, True]
    assert torch.isnan(res.eigenvalues[1]).all() and torch.isfinite(res.eigenvalues[0]).all()


@pytest.mark.parametrize(
    ("shape", "max_dim", "merged"),
    [
        ((5, 3, 3, 3), 8, (5, 3, 3, 3)),  # 3·3 = 9 > 8: nothing merges
        ((5, 3, 3, 3), 9, (5, 3, 9)),  # the last two merge, 3·9 = 27 > 9
        ((5, 3, 3, 3), 27, (5, 27)),
        ((5, 3, 3, 3), 135, (135,)),
        ((1, 2, 5, 1), 10, (10,)),
        ((1, 2, 5, 1), 1, (2, 5)),
        ((32, 3, 64, 64), 8192, (96, 4096)),
        ((2, 3, 4), 12, (2, 12)),  # merging runs from the last dimension
        ((), 1024, (1,)),
        ((1, 1), 1024, (1,)),
        ((32, 32, 3), 1024, (32, 96)),
        ((256, 1280), 1024, (256, 1280)),
    ],
)
def test_merge_dims_hand_worked(
    shape: tuple[int, ...], max_dim: int, merged: tuple[int, ...]
) -> None:
    assert merge_dims(shape, max_dim) == merged


def test_block_slices_hand_worked() -> None:
    specs = block_slices((5, 3, 3, 3), 8)
    assert [s.shape for s in specs] == [(5, 3, 3, 3)]
    specs = block_slices((10, 3), 4)
    assert [(s.starts, s.shape) for s in specs] == [
        ((0, 0), (4, 3)),
        ((4, 0), (4, 3)),
        ((8, 0), (2, 3)),
    ]
    assert [s.shape for s in block_slices((256, 1280), 1024)] == [(256, 1024), (256, 256)]
    assert [s.shape for s in block_slices((7,), math.inf)] == [(7,)]
    # The blocks tile the tensor exactly once.
    t = torch.zeros(10, 7)
    for s in block_slices((10, 7), 3):
        t[s.slices()] += 1
    assert bool((t == 1).all())


def test_mode_product_equals_tensordot() -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 3, 4, 5, generator=g, dtype=D)
    mats = [torch.randn(2, d, d, generator=g, dtype=D) for d in (3, 4, 5)]
    for transpose in (False, True):
        got = mode_product(X, mats, transpose=transpose)
        for b in range(2):
            want = X[b]
            for k, A in enumerate(mats):
                Ak = A[b].T if transpose else A[b]
                want = torch.tensordot(Ak, want.movedim(k, 0), dims=([1], [0])).movedim(0, k)
            torch.testing.assert_close(got[b], want, rtol=1e-13, atol=1e-13)


def test_assign_blocks_lpt_hand_worked() -> None:
    # By decreasing cost: 7 -> rank 0; 5 -> 1; 4 -> 1 (load 5 < 7); 3 -> 0 (7 < 9); 1 -> 1 (9 < 10).
    assert assign_blocks([3.0, 7.0, 1.0, 5.0, 4.0], 2) == [0, 0, 1, 1, 1]
    assert assign_blocks([1.0, 1.0, 1.0], 4) == [0, 1, 2]  # rank 3 owns nothing
    assert assign_blocks([], 3) == []
    assert assign_blocks([2.0, 2.0], 1) == [0, 0]
    with pytest.raises(ValueError, match=r"Invalid world_size=0: must be an integer >= 1"):
        assign_blocks([1.0], 0)
