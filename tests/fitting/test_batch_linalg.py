"""The batched engine's small solves, norms and column Jacobians against torch references."""

from __future__ import annotations

import math

import pytest
import torch

import secondorder as so
from secondorder.fitting.batch import api, driver
from secondorder.fitting.batch.small_linalg import (
    UNROLLED_MAX_N,
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
