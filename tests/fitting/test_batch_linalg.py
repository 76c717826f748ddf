"""The batched engine's small solves, norms and column Jacobians against torch references."""

from __future__ import annotations

import math

import pytest
import torch

import secondorder as so
from secondorder.fitting.batch import api, driver
from secondorder.fitting.batch.small_linalg import (
    UNROLLED_MAX_N,
    inverse_spd,
    norm2,
    solve_columns,
    solve_shifted,
)

F64 = torch.float64


def _systems(n: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    J = torch.randn(count, 3 * n, n, generator=gen, dtype=F64)
    M = J.mT @ J  # (B, n, n), positive definite
    b = torch.randn(count, n, generator=gen, dtype=F64)
    shift = torch.rand(count, generator=gen, dtype=F64)
    return M, b, shift


@pytest.mark.parametrize("n", [1, 2, 3, 5, UNROLLED_MAX_N, UNROLLED_MAX_N + 1])
def test_solve_columns_matches_torch_linalg_solve(n):
    M, b, shift = _systems(n, 40, seed=n)
    ref = torch.linalg.solve(M + shift[:, None, None] * torch.eye(n, dtype=F64), b)
    A = M.permute(1, 2, 0).contiguous()  # parameter-major (n, n, B)
    z = solve_columns(A, shift, b.T.contiguous())
    torch.testing.assert_close(z.T, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(solve_shifted(A, shift, b), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [3, UNROLLED_MAX_N + 1])
def test_a_matrix_that_is_not_positive_definite_fails_in_its_own_fit_only(n):
    M, b, shift = _systems(n, 6, seed=20 + n)
    M[2] = -M[2]  # negative definite
    M[4, 0, 0] = math.nan
    A = M.permute(1, 2, 0).contiguous()
    z = solve_columns(A, shift, b.T.contiguous())
    finite = torch.isfinite(z).all(0)
    assert finite.tolist() == [True, True, False, True, False, True]
    clean = [0, 1, 3, 5]
    again = solve_columns(A[..., clean], shift[clean], b[clean].T.contiguous())
    torch.testing.assert_close(z[:, clean], again, rtol=1e-13, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 5, UNROLLED_MAX_N])
def test_inverse_spd_matches_torch_linalg_inv(n):
    M, _, _ = _systems(n, 40, seed=40 + n)
    inv = inverse_spd(M.permute(1, 2, 0).contiguous()).permute(2, 0, 1)
    torch.testing.assert_close(inv, torch.linalg.inv(M), rtol=1e-10, atol=1e-12)
    assert torch.equal(inv, inv.mT)  # exactly symmetric


def test_inverse_spd_fails_in_its_own_fit_only_and_refuses_a_large_n():
    M, _, _ = _systems(4, 5, seed=50)
    M[1] = -M[1]
    M[3, 2, 2] = math.nan
    inv = inverse_spd(M.permute(1, 2, 0).contiguous())
    assert torch.isfinite(inv).all((0, 1)).tolist() == [True, False, True, False, True]
    clean = [0, 2, 4]
    again = inverse_spd(M[clean].permute(1, 2, 0).contiguous())
    assert torch.equal(inv[..., clean], again)
    with pytest.raises(ValueError, match=f"n <= {UNROLLED_MAX_N}, got n={UNROLLED_MAX_N + 1}"):
        inverse_spd(torch.eye(UNROLLED_MAX_N + 1, dtype=F64)[..., None])


def test_norm2_is_the_euclidean_norm_along_either_axis():
    v = torch.randn(7, 5, generator=torch.Generator().manual_seed(3), dtype=F64)
    for dim in (0, 1, -1):
        torch.testing.assert_close(norm2(v, dim), torch.linalg.vector_norm(v, dim=dim))


def _captured_problem(monkeypatch, f, x, y, p0):
    captured = {}

    def capture(problem, y0, rule, opts):
        captured.update(problem=problem, y0=y0)
        return driver.run(problem, y0, rule, opts)

    with monkeypatch.context() as patch:
        patch.setattr(api, "run", capture)
        so.curve_fit_batch(f, x, y, p0=p0)
    return captured["problem"], captured["y0"]


def test_column_jacobian_equals_jacfwd_fit_by_fit(monkeypatch):
    """curve_fit_batch's Jacobian (one jvp per parameter column) against torch.func.jacfwd."""
    gen = torch.Generator().manual_seed(4)
    t = torch.linspace(0, 3, 12, dtype=F64)

    def model(t, a, k, c):
        return a * torch.exp(-k * t) + c * t**2

    y = torch.randn(9, 12, generator=gen, dtype=F64)
    p = 0.5 + torch.rand(9, 3, generator=gen, dtype=F64)
    problem, _ = _captured_problem(monkeypatch, model, t, y, p)
    assert problem.columns is not None
    J = problem.jacobian_x(p)  # (n, B, m)
    for b in range(9):
        ref = torch.func.jacfwd(lambda q, b=b: model(t, q[0], q[1], q[2]) - y[b])(p[b])
        torch.testing.assert_close(J[:, b, :].T, ref, rtol=1e-12, atol=1e-14)
    # The same through the generic path (vmap over the tangents of fun).
    generic = problem.__class__(**{**problem.__dict__, "columns": None})
    torch.testing.assert_close(generic.jacobian_x(p), J, rtol=1e-12, atol=1e-14)


def test_a_parameter_the_model_ignores_has_a_zero_column(monkeypatch):
    t = torch.linspace(0, 1, 6, dtype=F64)

    def model(t, a, unused):
        return a * t

    y = torch.randn(4, 6, generator=torch.Generator().manual_seed(5), dtype=F64)
    problem, _ = _captured_problem(monkeypatch, model, t, y, [1.0, 2.0])
    J = problem.jacobian_x(torch.ones(4, 2, dtype=F64))
    torch.testing.assert_close(J[0], t.expand(4, 6))
    assert torch.equal(J[1], torch.zeros(4, 6, dtype=F64))


@pytest.mark.parametrize("n", [2, 5, UNROLLED_MAX_N, UNROLLED_MAX_N + 1])
def test_batch_covariance_matches_the_single_fit_rule(n):
    from secondorder.fitting.batch.covariance import batch_covariance
    from secondorder.fitting.report import _unscaled_covariance

    gen = torch.Generator().manual_seed(60 + n)
    J = torch.randn(6, 3 * n, n, generator=gen, dtype=F64)
    J[1, :, -1] = J[1, :, 0]  # rank deficient: two equal columns
    J[2, :, 0] *= 1e-12  # a tiny column: scaled away before the rank is decided
    J[3, 4, 1] = math.nan  # a failed fit
    J[4, :, -1] = 0.0  # a parameter the model ignores
    cost2 = torch.rand(6, generator=gen, dtype=F64)
    eps = torch.finfo(F64).eps
    cov = batch_covariance(J, cost2, eps=eps)
    assert torch.isinf(cov[3]).all()
    for b in (0, 1, 2, 4, 5):
        ref, undetermined = _unscaled_covariance(J[b])
        ref = ref * cost2[b] / (J.shape[1] - n)
        ref[undetermined, :] = math.inf
        ref[:, undetermined] = math.inf
        assert torch.equal(torch.isinf(cov[b]), torch.isinf(ref))
        kept = torch.isfinite(ref)
        torch.testing.assert_close(cov[b][kept], ref[kept], rtol=1e-9, atol=0)
