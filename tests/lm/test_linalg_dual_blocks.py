"""The dual form's ``Js Jsᵀ`` by row blocks (``linalg.symmetric_product``) and its solves.

References: the whole product formed in float64, and ``torch.linalg.solve`` of the
damped primal system ``(JᵀJ + λD) δ = Jᵀw`` in float64.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from secondorder.lm.linalg import NormalEquations, dual_blocks, make_solver, symmetric_product
from secondorder.lm.precision import StepPrecision

U32 = float(torch.finfo(torch.float32).eps)
U64 = float(torch.finfo(torch.float64).eps)
F64 = StepPrecision(torch.float64)


def _case(m: int, n: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    """J with rows spread over three orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    jac = torch.randn(m, n, generator=g, dtype=torch.float64)
    jac *= torch.logspace(0, -3, m, dtype=torch.float64)[:, None]
    return jac.to(dtype)


@pytest.mark.parametrize(("m", "n"), [(1, 5), (7, 300), (64, 257), (130, 2000), (256, 600)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_symmetric_product_equals_the_whole_product(m: int, n: int, dtype: torch.dtype) -> None:
    """Against float64: each entry within the rounding of one product of n terms,
    relative to ``√(K_ii K_jj)`` (the unit-diagonal measure the dual check uses), and
    the blocks below the diagonal exact copies of those above."""
    js = _case(m, n, dtype)
    k = symmetric_product(js)
    assert k.dtype == dtype and k.shape == (m, m)
    ref = js.double() @ js.double().T
    scale = ref.diagonal().sqrt()
    err = ((k.double() - ref) / (scale[:, None] * scale[None, :])).abs().max()
    u = U32 if dtype == torch.float32 else U64
    assert float(err) <= 2 * u * n**0.5
    blocks = dual_blocks(m)
    edges = [(i * m) // blocks for i in range(blocks + 1)]
    for lo, hi in itertools.pairwise(edges[:-1]):
        assert torch.equal(k[hi:, lo:hi], k[lo:hi, hi:].T)


def test_dual_blocks_by_rows_and_device() -> None:
    rows = (1, 31, 32, 63, 64, 100, 128, 256, 4096)
    assert [dual_blocks(m) for m in rows] == [1, 1, 1, 1, 2, 2, 2, 2, 2]
    assert dual_blocks(256, torch.device("cpu")) == 2
    assert dual_blocks(256, torch.device("meta")) == 1  # one launch off the CPU


def _system(jac: Tensor, w: Tensor) -> NormalEquations:
    col_sq = (jac * jac).sum(0)
    return NormalEquations(
        loss_sum=torch.tensor(1.0, dtype=torch.float64),
        count=jac.shape[0],
        grad=jac.T @ w,
        col_sq=col_sq,
        jac=jac,
        residuals=w,
        dual=True,
    )


@pytest.mark.parametrize("solver_name", ["cholesky", "eigh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dual_solve_by_blocks_matches_the_primal_solve(
    solver_name: str, dtype: torch.dtype
) -> None:
    """The dual step ``D^-½ Jsᵀ (JsJsᵀ + λI)⁻¹ w`` from a float32 J (two row blocks),
    against ``torch.linalg.solve`` of ``(JᵀJ + λD) δ = Jᵀw`` in float64."""
    m, n = 130, 900
    jac = _case(m, n, torch.float32, seed=4)
    w = torch.randn(m, generator=torch.Generator().manual_seed(5))
    system = _system(jac, w)
    fact = make_solver(solver_name).factor(system, system.col_sq, precision=StepPrecision(dtype))
    j64, d64 = jac.double(), system.col_sq.double()
    # A float32 eigendecomposition is not scale invariant as Cholesky is: on rows spread
    # over three orders it loses ~10% at λ = 1e-4 (as it did before the blocks).
    lams = (1.0,) if (solver_name, dtype) == ("eigh", torch.float32) else (1e-4, 1e-2, 1.0)
    tol = 1e-5 if dtype == torch.float32 else 1e-9
    for lam in lams:
        got = fact.solve(lam, jac.T @ w, w)
        assert got is not None and got.dtype == dtype
        ref = torch.linalg.solve(j64.T @ j64 + lam * torch.diag(d64), j64.T @ w.double())
        rel = float((got.double() - ref).norm() / ref.norm())
        assert rel <= tol, (lam, rel)


@pytest.mark.parametrize("solver_name", ["cholesky", "eigh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dual_image_is_j_times_the_step(solver_name: str, dtype: torch.dtype) -> None:
    """``Factorization.image()`` (``Js Jsᵀ y``, m×m work) against ``J @ δ`` in float64,
    and the predicted reduction measured with it against the one measured through J."""
    from secondorder.lm.measure import predicted_reduction

    m, n = 100, 700
    jac = _case(m, n, torch.float32, seed=6)
    w = torch.randn(m, generator=torch.Generator().manual_seed(7))
    system = _system(jac, w)
    fact = make_solver(solver_name).factor(system, system.col_sq, precision=StepPrecision(dtype))
    u = U32 if dtype == torch.float32 else U64
    for lam in (1e-2, 1.0, 1e3):
        delta = fact.solve(lam, jac.T @ w, w)
        image = fact.image()
        assert delta is not None and image is not None and image.shape == (m,)
        ref = jac.double() @ delta.double()
        # Each entry of Js Jsᵀ y carries the rounding of a product of n terms.
        scale = float(jac.double().abs().sum(1).max() * delta.double().abs().max())
        assert float((image.double() - ref).abs().max()) <= 10 * u * n**0.5 * scale
        grad = system.grad
        via_image = float(predicted_reduction(system, grad, delta.float(), image))
        via_jac = float(predicted_reduction(system, grad, delta.float()))
        assert via_image == pytest.approx(via_jac, rel=1e-4)


def test_primal_factorisations_leave_the_image_to_the_system() -> None:
    """Only the dual form forms ``Jδ`` on the way; the others answer ``None``."""
    jac = _case(50, 8, torch.float64)
    w = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    system = NormalEquations(
        loss_sum=torch.tensor(1.0, dtype=torch.float64),
        count=50,
        grad=jac.T @ w,
        col_sq=(jac * jac).sum(0),
        gram=jac.T @ jac,
    )
    fact = make_solver("cholesky").factor(system, system.col_sq, precision=F64)
    assert fact.solve(1.0, system.grad, None) is not None
    assert fact.image() is None


def test_dual_cholesky_from_the_factor_gram_matches_the_primal_solve() -> None:
    """With ``D = d₀I`` the dual Cholesky takes ``J Jᵀ`` from ``factor_gram`` (here the
    exact product, in float64): its step and image against ``torch.linalg.solve`` of
    ``(JᵀJ + λd₀I) δ = Jᵀw``; with any other D it forms ``Js Jsᵀ`` itself."""
    m, n = 60, 500
    jac = _case(m, n, torch.float32, seed=8)
    w = torch.randn(m, generator=torch.Generator().manual_seed(9))
    calls: list[torch.dtype] = []

    def outer(dtype: torch.dtype) -> Tensor:
        calls.append(dtype)
        return jac.to(dtype) @ jac.to(dtype).T

    system = _system(jac, w)
    system.factor_gram = outer
    d0 = 3.0
    fact = make_solver("cholesky").factor(system, torch.full((n,), d0), uniform=True, precision=F64)
    assert calls == [torch.float64]
    j64 = jac.double()
    for lam in (1e-8, 1e-2, 1.0):
        got = fact.solve(lam, jac.T @ w, w)
        image = fact.image()
        assert got is not None and image is not None
        ref = torch.linalg.solve(
            j64.T @ j64 + lam * d0 * torch.eye(n, dtype=torch.float64), j64.T @ w.double()
        )
        assert float((got.double() - ref).norm() / ref.norm()) <= 1e-5
        torch.testing.assert_close(image, j64 @ got.double(), rtol=1e-5, atol=1e-6)
    # Marquardt's D (not a multiple of I): the factors' J Jᵀ does not apply.
    make_solver("cholesky").factor(system, system.col_sq, precision=F64)
    assert calls == [torch.float64]


def _classifier_steps(monkeypatch: pytest.MonkeyPatch, factors: bool) -> tuple[Tensor, list]:
    """Three default dual steps of a wide MLP classifier (D = I); ``factors=False``
    keeps every layer out of the outer-product factors, so K is ``Js Jsᵀ``."""
    import secondorder as so
    from secondorder.lm import jacobian

    if not factors:
        monkeypatch.setattr(jacobian.factors, "FACTOR_GAIN", 10**9)
    calls = []
    real = jacobian.FactorGram.__call__
    monkeypatch.setattr(
        jacobian.FactorGram,
        "__call__",
        lambda self, dtype: calls.append(dtype) or real(self, dtype),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
    x, y = torch.randn(48, 20), torch.randint(0, 5, (48,))
    opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy, gram_dtype=torch.float64)
    infos = [opt.step(x, y) for _ in range(3)]
    monkeypatch.undo()
    # One J Jᵀ per step from the factors, or none.
    assert calls == ([torch.float64] * 3 if factors else [])
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), infos


def test_classifier_dual_steps_from_the_factors_match_the_rows_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The classifier defaults' dual steps with ``J Jᵀ`` from the factors against the
    same steps with ``Js Jsᵀ`` formed from J (float64 both): the same attempts and λ,
    parameters within float32 rounding."""
    after, infos = _classifier_steps(monkeypatch, factors=True)
    ref, ref_infos = _classifier_steps(monkeypatch, factors=False)
    assert all(i.form == "dual" and i.accepted for i in infos)
    assert [i.attempts for i in infos] == [i.attempts for i in ref_infos]
    assert [i.damping for i in infos] == [i.damping for i in ref_infos]
    torch.testing.assert_close(after, ref, rtol=1e-4, atol=1e-5)
