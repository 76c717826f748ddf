"""Solvers, the normal-equation record, damping, and the engine on linear problems.

Every solve is compared with ``torch.linalg.solve`` of the explicitly formed damped
normal matrix, and every one-step LM result on a linear problem with ``torch.linalg``'s
least-squares or pseudo-inverse solution.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.checkpoint import entries
from secondorder.lm.damping import (
    DampingState,
    IdentityMatrix,
    MarquardtMatrix,
    MoreMatrix,
    MultiplicativeRule,
    NielsenRule,
    make_damping_matrix,
    make_damping_rule,
)
from secondorder.lm.linalg import NormalEquations, make_solver

DT = torch.float64
DIRECT = ("cholesky", "eigh", "qr")
LAMBDAS = (1e-3, 0.1, 1.0, 30.0)


# -- problems with known conditioning ----------------------------------------------------------


def random_orthonormal(rows: int, cols: int, g: torch.Generator) -> Tensor:
    q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=DT))
    return q


def conditioned_jacobian(m: int, n: int, cond: float, seed: int = 0) -> tuple[Tensor, Tensor]:
    """J = U diag(s) Vᵀ with singular values from 1 down to 1/cond, and a residual r."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    s = torch.logspace(0, -math.log10(cond), k, dtype=DT)
    U = random_orthonormal(m, k, g)
    V = random_orthonormal(n, k, g)
    J = (U * s) @ V.T
    r = torch.randn(m, generator=g, dtype=DT)
    return J, r


def damping_diagonal(n: int, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.2 + 2.0 * torch.rand(n, generator=g, dtype=DT)


def record(J: Tensor, r: Tensor, kind: str) -> NormalEquations:
    """The three shapes the optimizer builds: Gram only, stored J, dual."""
    common = {
        "loss_sum": torch.dot(r, r),
        "count": r.numel(),
        "grad": J.T @ r,
        "col_sq": (J * J).sum(0),
    }
    if kind == "gram":
        return NormalEquations(**common, gram=J.T @ J)
    if kind == "jac":
        return NormalEquations(**common, jac=J, residuals=r)
    if kind == "dual":
        return NormalEquations(**common, jac=J, residuals=r, dual=True)
    raise AssertionError(kind)


def reference_solve(J: Tensor, lam: float, d: Tensor, b: Tensor) -> Tensor:
    return torch.linalg.solve(J.T @ J + lam * torch.diag(d), b)


def rel_err(a: Tensor, b: Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


# (solver, record kind) pairs that apply: cg is primal only, qr needs J stored.
APPLICABLE = [
    ("cholesky", "gram"),
    ("cholesky", "dual"),
    ("eigh", "gram"),
    ("eigh", "dual"),
    ("qr", "jac"),
    ("qr", "dual"),
    ("cg", "gram"),
    ("cg", "jac"),
]
SHAPES = [(40, 12), (12, 40)]


# -- solvers against torch.linalg.solve --------------------------------------------------------


@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize(("solver_name", "kind"), APPLICABLE)
def test_solver_matches_dense_solve(solver_name, kind, m, n):
    J, r = conditioned_jacobian(m, n, cond=100.0)
    d = damping_diagonal(n)
    w = -r
    b = J.T @ w
    rtol = 1e-8 if solver_name == "cg" else 1e-10
    # CG in floating point may need a few more than n iterations to reach 1e-8.
    solver = make_solver(solver_name, cg_rtol=rtol, cg_max_iter=10 * n)
    fact = solver.factor(record(J, r, kind), d)
    for lam in LAMBDAS:
        delta = fact.solve(lam, b, w)
        assert delta is not None
        expected = reference_solve(J, lam, d, b)
        A = J.T @ J + lam * torch.diag(d)
        if solver_name == "cg":
            # CG's contract: ‖Aδ - b‖ ≤ rtol·‖b‖; the error is then at most cond(A)·rtol.
            assert float(torch.linalg.vector_norm(A @ delta - b)) <= rtol * float(b.norm())
            assert rel_err(delta, expected) <= float(torch.linalg.cond(A)) * rtol
            assert fact.iterations >= 1
        else:
            assert rel_err(delta, expected) <= 1e-10, (solver_name, kind, lam)


@pytest.mark.parametrize(("m", "n", "kind"), [(300, 256, "gram"), (256, 300, "dual")])
def test_cholesky_at_a_padded_order_matches_dense_solve(m, n, kind):
    # 256 float64 columns are factored inside a larger identity-padded matrix
    # (secondorder._lapack); the step must be the one of the 256 x 256 system.
    J, r = conditioned_jacobian(m, n, cond=100.0, seed=7)
    d = damping_diagonal(n, seed=8)
    w = -r
    b = J.T @ w
    fact = make_solver("cholesky").factor(record(J, r, kind), d)
    for lam in LAMBDAS:
        delta = fact.solve(lam, b, w)
        assert delta is not None and delta.shape == (n,)
        assert rel_err(delta, reference_solve(J, lam, d, b)) <= 1e-10, lam


@pytest.mark.parametrize("kind", ["gram", "jac"])
def test_cg_with_a_loose_tolerance_is_accurate_to_that_tolerance(kind):
    J, r = conditioned_jacobian(60, 20, cond=30.0, seed=3)
    d = damping_diagonal(20, seed=4)
    b = -J.T @ r
    fact = make_solver("cg", cg_rtol=1e-4).factor(record(J, r, kind), d)
    lam = 0.05
    delta = fact.solve(lam, b)
    A = J.T @ J + lam * torch.diag(d)
    assert float(torch.linalg.vector_norm(A @ delta - b)) <= 1e-4 * float(b.norm())
    assert rel_err(delta, reference_solve(J, lam, d, b)) <= float(torch.linalg.cond(A)) * 1e-4
    # Fewer iterations than the n needed for an exact answer in exact arithmetic.
    assert 1 <= fact.iterations < 20


def test_cg_max_iter_caps_iterations():
    J, r = conditioned_jacobian(60, 20, cond=1e3, seed=3)
    fact = make_solver("cg", cg_rtol=1e-14, cg_max_iter=3).factor(
        record(J, r, "gram"), torch.ones(20, dtype=DT)
    )
    fact.solve(1e-6, -J.T @ r)
    assert fact.iterations == 3
    # The default cap is n, the iteration count of exact arithmetic.
    fact = make_solver("cg", cg_rtol=1e-14).factor(record(J, r, "gram"), torch.ones(20, dtype=DT))
    fact.solve(1e-6, -J.T @ r)
    assert fact.iterations == 20


@pytest.mark.parametrize(("m", "n"), SHAPES)
@pytest.mark.parametrize("solver_name", ["cholesky", "eigh"])
def test_primal_and_dual_forms_give_the_same_step(solver_name, m, n):
    J, r = conditioned_jacobian(m, n, cond=50.0, seed=2)
    d = damping_diagonal(n, seed=5)
    w, b = -r, -J.T @ r
    solver = make_solver(solver_name)
    primal = solver.factor(record(J, r, "gram"), d)
    dual = solver.factor(record(J, r, "dual"), d)
    qr = make_solver("qr").factor(record(J, r, "jac"), d)
    for lam in LAMBDAS:
        p, q, s = primal.solve(lam, b, w), dual.solve(lam, b, w), qr.solve(lam, b, w)
        assert rel_err(q, p) <= 1e-10
        assert rel_err(s, p) <= 1e-10


@pytest.mark.parametrize("kind", ["gram", "dual"])
def test_eigh_retries_equal_fresh_cholesky_solves(kind):
    J, r = conditioned_jacobian(30, 18, cond=200.0, seed=6)
    d = damping_diagonal(18, seed=7)
    w, b = -r, -J.T @ r
    eigh = make_solver("eigh").factor(record(J, r, kind), d)
    # Several λ from one factorisation, in the order a failing iteration tries them.
    for lam in (1e-4, 2e-4, 8e-4, 6.4e-3, 1.0, 1e3):
        fresh = make_solver("cholesky").factor(record(J, r, kind), d).solve(lam, b, w)
        assert rel_err(eigh.solve(lam, b, w), fresh) <= 1e-10


def indefinite_gram(n: int = 6, seed: int = 8) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    Q = random_orthonormal(n, n, g)
    evals = torch.linspace(-1.0, 3.0, n, dtype=DT)
    return (Q * evals) @ Q.T


def test_cholesky_of_an_indefinite_matrix_returns_none():
    G = indefinite_gram()
    n = G.shape[0]
    system = NormalEquations(
        loss_sum=torch.tensor(1.0, dtype=DT),
        count=1,
        grad=torch.ones(n, dtype=DT),
        col_sq=G.diagonal().clone(),
        gram=G,
    )
    fact = make_solver("cholesky").factor(system, torch.ones(n, dtype=DT))
    assert fact.solve(0.0, torch.ones(n, dtype=DT)) is None
    # Enough damping (λ above the most negative eigenvalue) makes it definite again.
    delta = fact.solve(2.0, torch.ones(n, dtype=DT))
    assert delta is not None
    expected = torch.linalg.solve(G + 2.0 * torch.eye(n, dtype=DT), torch.ones(n, dtype=DT))
    assert rel_err(delta, expected) <= 1e-12


def test_dual_cholesky_with_negative_shift_returns_none():
    J, r = conditioned_jacobian(5, 9, cond=10.0)
    fact = make_solver("cholesky").factor(record(J, r, "dual"), torch.ones(9, dtype=DT))
    assert fact.solve(-10.0, -J.T @ r, -r) is None


def test_engine_raises_damping_when_cholesky_fails():
    """An indefinite system at λ=0: the engine rejects the attempt instead of raising."""
    G = indefinite_gram()
    n = G.shape[0]
    system = NormalEquations(
        loss_sum=torch.tensor(1.0, dtype=DT),
        count=1,
        grad=torch.ones(n, dtype=DT),
        col_sq=torch.ones(n, dtype=DT),
        gram=G,
    )

    class Flat:
        def loss_sum(self, x: Tensor) -> Tensor:  # a loss that any step increases
            return torch.tensor(2.0, dtype=DT)

        def second_directional(self, x, v, system):  # pragma: no cover - unused
            raise AssertionError

    state = DampingState(damping=0.0)
    out = so.lm.engine.iterate(
        Flat(),
        torch.zeros(n, dtype=DT),
        system,
        solver=make_solver("cholesky"),
        rule=NielsenRule(),
        matrix=IdentityMatrix(),
        state=state,
        config=so.lm.engine.EngineConfig(max_attempts=1),
    )
    assert not out.accepted
    assert "linear solve failed" in out.reason
    assert state.damping == 1e-3  # 0·ν stays 0: restarted at damping_restart


# -- NormalEquations ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gram", "jac", "dual"])
def test_curvature_is_squared_norm_of_j_delta(kind):
    J, r = conditioned_jacobian(25, 10, cond=20.0, seed=9)
    delta = torch.randn(10, generator=torch.Generator().manual_seed(10), dtype=DT)
    system = record(J, r, kind)
    expected = torch.linalg.vector_norm(J @ delta) ** 2
    torch.testing.assert_close(system.curvature(delta), expected, rtol=1e-13, atol=0)
    assert system.n == 10


def test_curvature_without_gram_or_jac_raises():
    system = NormalEquations(
        loss_sum=torch.tensor(0.0, dtype=DT),
        count=0,
        grad=torch.zeros(3, dtype=DT),
        col_sq=torch.zeros(3, dtype=DT),
    )
    with pytest.raises(RuntimeError, match="neither gram nor jac"):
        system.curvature(torch.ones(3, dtype=DT))


def test_solvers_refuse_records_they_cannot_use():
    J, r = conditioned_jacobian(8, 4, cond=5.0)
    d = torch.ones(4, dtype=DT)
    with pytest.raises(RuntimeError, match="Gram"):
        make_solver("cholesky").factor(record(J, r, "jac"), d)
    with pytest.raises(RuntimeError, match="Jacobian"):
        make_solver("qr").factor(record(J, r, "gram"), d)
    with pytest.raises(RuntimeError, match="primal"):
        make_solver("cg").factor(record(J, r, "dual"), d)
    fact = make_solver("qr").factor(record(J, r, "jac"), d)
    with pytest.raises(RuntimeError, match="residual-space vector"):
        fact.solve(1.0, -J.T @ r, None)


# -- damping rules and matrices --------------------------------------------------------------


def test_nielsen_rule_sequence_by_hand():
    rule = NielsenRule()
    s = DampingState(damping=1.0)
    rule.reject(s)  # λ·2, ν 4
    assert (s.damping, s.nu) == (2.0, 4.0)
    rule.reject(s)  # λ·4, ν 8
    assert (s.damping, s.nu) == (8.0, 8.0)
    rule.accept(s, 0.9)  # 1 - 0.8³ = 0.488
    assert s.damping == pytest.approx(8.0 * 0.488, rel=1e-14)
    assert s.nu == 2.0
    lam = s.damping
    rule.accept(s, 0.1)  # 1 - (-0.8)³ = 1.512: a poor step raises λ a little
    assert s.damping == pytest.approx(lam * 1.512, rel=1e-14)
    lam = s.damping
    rule.accept(s, 1.0)  # 1 - 1 = 0 → floor 1/3
    assert s.damping == pytest.approx(lam / 3.0, rel=1e-14)
    lam = s.damping
    rule.accept(s, 0.5)  # 1 - 0 = 1: unchanged
    assert s.damping == pytest.approx(lam, rel=1e-14)
    lam = s.damping
    rule.accept(s, 3.0)  # 1 - 125 → floor 1/3
    assert s.damping == pytest.approx(lam / 3.0, rel=1e-14)
    rule.reject(s)
    rule.reject(s)
    rule.reject(s)
    assert s.damping == pytest.approx(lam / 3.0 * 2 * 4 * 8, rel=1e-14)
    assert s.nu == 16.0


def test_multiplicative_rule():
    rule = MultiplicativeRule(up=5.0, down=0.25)
    s = DampingState(damping=1.0)
    rule.reject(s)
    rule.reject(s)
    assert s.damping == pytest.approx(25.0)
    rule.accept(s, 0.01)
    assert s.damping == pytest.approx(6.25)
    rule.accept(s, 1.0)
    assert s.damping == pytest.approx(6.25 / 4)
    default = make_damping_rule("multiplicative")
    s = DampingState(damping=1.0)
    default.reject(s)
    assert s.damping == pytest.approx(10.0)
    default.accept(s, 0.5)
    assert s.damping == pytest.approx(1.0)


@pytest.mark.parametrize(("up", "down"), [(1.0, 0.1), (math.inf, 0.1), (10.0, 1.0), (10.0, 0.0)])
def test_multiplicative_rule_rejects_bad_factors(up, down):
    with pytest.raises(ValueError, match=r"damping_(up|down)"):
        MultiplicativeRule(up, down)


def test_marquardt_matrix_floor_gives_positive_d_for_a_zero_column():
    col_sq = torch.tensor([4.0, 0.0, 1.0, 1e-20], dtype=DT)
    d = MarquardtMatrix().diagonal(col_sq, DampingState(1.0))
    assert bool((d > 0).all())
    torch.testing.assert_close(
        d, torch.tensor([4.0, 4e-9, 1.0, 4e-9], dtype=DT), rtol=1e-14, atol=0
    )
    d = MarquardtMatrix(floor=1e-3).diagonal(col_sq, DampingState(1.0))
    torch.testing.assert_close(
        d, torch.tensor([4.0, 4e-3, 1.0, 4e-3], dtype=DT), rtol=1e-14, atol=0
    )
    # An all-zero Jacobian: D falls back to the identity.
    d = MarquardtMatrix().diagonal(torch.zeros(3, dtype=DT), DampingState(1.0))
    assert torch.equal(d, torch.ones(3, dtype=DT))


def test_identity_matrix():
    d = IdentityMatrix().diagonal(torch.tensor([3.0, 0.0], dtype=DT), DampingState(1.0))
    assert torch.equal(d, torch.ones(2, dtype=DT))


def test_more_matrix_keeps_a_running_maximum():
    m, s = MoreMatrix(), DampingState(1.0)
    d1 = m.diagonal(torch.tensor([1.0, 5.0, 2.0], dtype=DT), s)
    torch.testing.assert_close(d1, torch.tensor([1.0, 5.0, 2.0], dtype=DT))
    d2 = m.diagonal(torch.tensor([3.0, 1.0, 2.0], dtype=DT), s)
    torch.testing.assert_close(d2, torch.tensor([3.0, 5.0, 2.0], dtype=DT))
    d3 = m.diagonal(torch.tensor([0.5, 0.5, 0.0], dtype=DT), s)
    torch.testing.assert_close(d3, torch.tensor([3.0, 5.0, 2.0], dtype=DT))
    torch.testing.assert_close(s.scale, torch.tensor([3.0, 5.0, 2.0], dtype=DT))
    # A different parameter count starts a new running maximum.
    d4 = m.diagonal(torch.tensor([7.0, 0.0], dtype=DT), s)
    torch.testing.assert_close(d4, torch.tensor([7.0, 7e-9], dtype=DT))


def test_more_matrix_state_lives_in_the_optimizer():
    """Moré's running maximum is carried from step to step by LevenbergMarquardt."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).to(DT)
    x = torch.linspace(-1, 1, 20, dtype=DT).reshape(-1, 1)
    opt = so.LevenbergMarquardt(model, damping_matrix="more", solver="cholesky", form="primal")
    seen = []
    for _ in range(3):
        opt.step(x, torch.sin(3 * x))
        seen.append(entries(opt.state_dict())["scale"].clone())
    assert bool((seen[1] >= seen[0]).all()) and bool((seen[2] >= seen[1]).all())


@pytest.mark.parametrize(
    ("factory", "valid"),
    [
        (make_damping_rule, "nielsen"),
        (make_damping_matrix, "marquardt"),
        (make_solver, "cholesky"),
    ],
)
def test_unknown_names_list_the_valid_choices(factory, valid):
    with pytest.raises(ValueError, match=rf"Unknown .*'bogus'.*valid choices are .*{valid}"):
        factory("bogus")


@pytest.mark.parametrize("option", ["damping_rule", "damping_matrix", "solver", "form"])
def test_optimizer_rejects_unknown_names(option):
    with pytest.raises(ValueError, match=rf"Unknown {option}='bogus'; valid choices are"):
        so.LevenbergMarquardt(nn.Linear(2, 1).to(DT), **{option: "bogus"})


# -- the engine on linear problems ---------------------------------------------------------------


def linear_problem(m: int, n: int, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    X = torch.randn(m, n, dtype=DT)
    y = torch.randn(m, 1, dtype=DT)
    return nn.Linear(n, 1, bias=False).to(DT), X, y


@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr", "cg"])
def test_one_undamped_step_is_least_squares(solver):
    """More samples than parameters: one step at λ = 0 lands on the lstsq solution."""
    model, X, y = linear_problem(50, 8)
    w0 = model.weight.detach().clone().reshape(-1)
    opt = so.LevenbergMarquardt(
        model, so.residuals.mse, damping=0.0, solver=solver, form="primal", cg_rtol=1e-13
    )
    info = opt.step(X, y)
    assert info.accepted and info.attempts == 1, info.reason
    assert (info.solver, info.form) == (solver, "primal")
    expected = torch.linalg.lstsq(X, y).solution.reshape(-1)
    got = model.weight.detach().reshape(-1)
    assert rel_err(got, expected) <= 1e-10
    assert rel_err(w0, expected) > 0.1  # the step did the work
    assert info.loss == pytest.approx(float(((X @ expected - y[:, 0]) ** 2).mean()), rel=1e-12)


def scaled_min_norm_step(X: Tensor, y: Tensor, w0: Tensor, d: Tensor) -> Tensor:
    """``w0 + D^-½ pinv(X D^-½)(y - X w0)``: the fit closest to w0 in the D-norm."""
    s = d.rsqrt()
    return w0 + s * (torch.linalg.pinv(X * s) @ (y[:, 0] - X @ w0))


@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr"])
def test_one_undamped_dual_step_is_the_minimum_norm_solution(solver):
    """Fewer samples than parameters: (JD⁻¹Jᵀ + λI)⁻¹ at λ → 0 gives the fit nearest the
    start in the D-norm; with D = I from w0 = 0 that is pinv(X) y, lstsq's minimum norm."""
    model, X, y = linear_problem(8, 30, seed=1)
    with torch.no_grad():
        model.weight.zero_()
    opt = so.LevenbergMarquardt(
        model, so.residuals.mse, damping=0.0, solver=solver, form="dual", damping_matrix="identity"
    )
    info = opt.step(X, y)
    assert info.accepted, info.reason
    assert info.form == "dual"
    # The dual system J Jᵀ is regular at λ = 0 (QR takes the minimum-norm solution).
    assert info.attempts == 1
    got = model.weight.detach().reshape(-1)
    expected = torch.linalg.pinv(X) @ y[:, 0]
    min_norm = torch.linalg.lstsq(X, y, driver="gelsd").solution.reshape(-1)
    assert rel_err(expected, min_norm) <= 1e-12
    assert rel_err(got, expected) <= 1e-10
    assert info.loss <= 1e-20  # an exact fit


@pytest.mark.parametrize("matrix", ["identity", "marquardt"])
@pytest.mark.parametrize("solver", ["cholesky", "eigh"])
def test_undamped_dual_step_from_a_random_start_is_nearest_in_the_d_norm(solver, matrix):
    model, X, y = linear_problem(8, 30, seed=2)
    w0 = model.weight.detach().clone().reshape(-1)
    opt = so.LevenbergMarquardt(
        model, so.residuals.mse, damping=0.0, solver=solver, form="dual", damping_matrix=matrix
    )
    info = opt.step(X, y)
    assert info.accepted and info.attempts == 1, info.reason
    d = torch.ones(30, dtype=DT) if matrix == "identity" else (X * X).sum(0)
    expected = scaled_min_norm_step(X, y, w0, d)
    assert rel_err(model.weight.detach().reshape(-1), expected) <= 1e-10
    # The two D-norms give different answers, so the comparison tells them apart.
    other = torch.ones(30, dtype=DT) if matrix != "identity" else (X * X).sum(0)
    assert rel_err(scaled_min_norm_step(X, y, w0, other), expected) > 1e-3


@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr"])
def test_optimizer_primal_and_dual_forms_take_the_same_step(solver):
    """Fewer residuals than parameters, λ > 0: the push-through identity in practice."""
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)
    x = torch.randn(10, 2, dtype=DT)
    y = torch.sin(x.sum(1, keepdim=True))
    results = {}
    for form in ("primal", "dual", "auto"):
        model = copy.deepcopy(base)
        opt = so.LevenbergMarquardt(model, damping=0.1, solver=solver, form=form)
        infos = [opt.step(x, y) for _ in range(3)]
        assert all(i.accepted for i in infos), [i.reason for i in infos]
        assert infos[0].form == ("dual" if form == "auto" else form)
        results[form] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    moved = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    assert rel_err(results["primal"], moved) > 1e-3
    assert rel_err(results["dual"], results["primal"]) <= 1e-10
    assert rel_err(results["auto"], results["dual"]) <= 1e-12


# -- a zero Jacobian column ---------------------------------------------------------------------


def test_marquardt_diag_without_floor_is_singular_with_a_zero_column():
    """cuPyLMA's JᵀJ + λ·diag(JᵀJ) has a zero row for an unused parameter, for every λ."""
    J, r = conditioned_jacobian(20, 6, cond=10.0)
    J[:, 2] = 0.0
    system = record(J, r, "gram")
    b = -J.T @ r
    raw = make_solver("cholesky").factor(system, system.col_sq)
    for lam in (1e-3, 1.0, 1e3):
        assert raw.solve(lam, b) is None
    d = MarquardtMatrix().diagonal(system.col_sq, DampingState(1.0))
    fact = make_solver("cholesky").factor(system, d)
    for lam in (1e-3, 1.0, 1e3):
        delta = fact.solve(lam, b)
        assert delta is not None
        assert rel_err(delta, reference_solve(J, lam, d, b)) <= 1e-10
        assert delta[2] == 0.0


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 6), nn.Tanh(), nn.Linear(6, 1))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


@pytest.mark.parametrize("solver", ["cholesky", "eigh", "qr", "cg"])
def test_unused_parameter_does_not_stall_training(solver):
    torch.manual_seed(0)
    model = WithUnused().to(DT)
    unused = model.unused.detach().clone()
    x = torch.linspace(-1, 1, 40, dtype=DT).reshape(-1, 1)
    y = torch.sin(3 * x)
    opt = so.LevenbergMarquardt(model, damping_matrix="marquardt", solver=solver, form="primal")
    assert opt.num_parameters == 6 + 6 + 6 + 1 + 3
    first = None
    for _ in range(15):
        info = opt.step(x, y)
        first = info.loss_before if first is None else first
        if info.terminated:
            break
    assert info.loss < 0.05 * first
    assert torch.equal(model.unused.detach(), unused)


# -- conjugate gradients: tolerance, forcing term, iteration counts ----------------------------


@pytest.mark.parametrize("kind", ["gram", "jac"])
@pytest.mark.parametrize("rtol", [1e-3, 1e-7, 1e-11])
def test_cg_equals_the_cholesky_solve_to_its_tolerance(kind, rtol):
    J, r = conditioned_jacobian(80, 25, cond=300.0, seed=11)
    d = damping_diagonal(25, seed=12)
    b = -J.T @ r
    cg = make_solver("cg", cg_rtol=rtol, cg_max_iter=500).factor(record(J, r, kind), d)
    chol = make_solver("cholesky").factor(record(J, r, "gram"), d)
    for lam in (1e-4, 1e-2, 1.0):
        direct = chol.solve(lam, b)
        delta = cg.solve(lam, b)
        assert direct is not None and delta is not None
        A = J.T @ J + lam * torch.diag(d)
        # CG's stopping test, checked from outside, and the error bound it implies.
        assert float(torch.linalg.vector_norm(A @ delta - b)) <= rtol * float(b.norm())
        assert rel_err(delta, direct) <= float(torch.linalg.cond(A)) * rtol
        assert 1 <= cg.iterations <= 500


def test_cg_iterations_fall_with_a_looser_tolerance_and_the_jacobi_preconditioner_helps():
    # Columns of very different scales: the Jacobi preconditioner 1/(diag(JᵀJ) + λD)
    # undoes them.  Unpreconditioned CG on the same matrix is run by hand.
    J, r = conditioned_jacobian(120, 30, cond=10.0, seed=5)
    J = J * torch.logspace(-3, 3, 30, dtype=DT)
    d = (J * J).sum(0)
    b = -J.T @ r
    lam = 1e-3
    A = J.T @ J + lam * torch.diag(d)
    counts = []
    for rtol in (1e-2, 1e-6, 1e-10):
        fact = make_solver("cg", cg_rtol=rtol, cg_max_iter=10_000).factor(record(J, r, "jac"), d)
        fact.solve(lam, b)
        counts.append(fact.iterations)
    assert counts == sorted(counts) and counts[0] < counts[-1]

    x, res = torch.zeros_like(b), b.clone()
    p, plain = res.clone(), 0
    while float(res.norm()) > 1e-10 * float(b.norm()) and plain < 10_000:
        ap = A @ p
        alpha = (res @ res) / (p @ ap)
        x, new = x + alpha * p, res - alpha * ap
        p, res, plain = new + ((new @ new) / (res @ res)) * p, new, plain + 1
    assert counts[-1] < plain


def forcing_record(J: Tensor, r: Tensor) -> NormalEquations:
    return record(J, r, "jac")


def test_the_forcing_term_follows_its_formula():
    J, r = conditioned_jacobian(60, 20, cond=30.0, seed=3)
    system = forcing_record(J, r)
    gamma = float((J.T @ r).norm() / (torch.linalg.matrix_norm(J) * r.norm()))
    assert 0 < gamma < 1
    solver = so.linalg.CGSolver(rtol=1e-9, forcing=0.5)
    assert solver.tolerance(system) == pytest.approx(max(1e-9, min(0.5, math.sqrt(gamma))))
    # Near a stationary point the tolerance tightens to cg_rtol.
    r_star = r - J @ torch.linalg.lstsq(J, r).solution
    at_minimum = forcing_record(J, r_star)
    assert solver.tolerance(at_minimum) <= 1e-7  # √γ, γ at rounding level
    assert so.linalg.CGSolver(rtol=1e-6, forcing=0.5).tolerance(at_minimum) == 1e-6
    # A zero residual has nothing to solve for: cg_rtol.
    assert solver.tolerance(forcing_record(J, torch.zeros_like(r))) == 1e-9
    # Without a forcing term, cg_rtol always.
    assert so.linalg.CGSolver(rtol=1e-7).tolerance(system) == 1e-7
    # The factorisation stops at that tolerance, and earlier than a tight solve.
    d = damping_diagonal(20, seed=4)
    b = -J.T @ r
    eta = solver.tolerance(system)
    loose = solver.factor(system, d)
    delta = loose.solve(0.01, b)
    A = J.T @ J + 0.01 * torch.diag(d)
    assert float((A @ delta - b).norm()) <= eta * float(b.norm())
    tight = so.linalg.CGSolver(rtol=1e-9).factor(system, d)
    tight.solve(0.01, b)
    assert 1 <= loose.iterations < tight.iterations


@pytest.mark.parametrize("value", [0.0, 1.0, -0.5, 2, math.nan, math.inf])
def test_cg_forcing_must_lie_in_the_open_unit_interval(value):
    with pytest.raises(
        ValueError, match=rf"Invalid cg_forcing={value!r}: must be None or a number"
    ):
        so.LevenbergMarquardt(nn.Linear(2, 1).to(DT), solver="cg", cg_forcing=value)


@pytest.mark.parametrize("value", ["0.5", True, [0.5]])
def test_cg_forcing_of_a_wrong_type_names_the_option(value):
    with pytest.raises(TypeError, match=r"Invalid cg_forcing=.*must be None or a number"):
        so.LMConfig(cg_forcing=value)


def test_lm_with_forcing_converges_to_the_least_squares_solution():
    """A linear problem with noise: inexact steps, exact limit (lstsq).

    cg_rtol is 1e-10, above what CG on JᵀJ (κ = 1e4) attains in float64 (κ·eps ≈ 2e-12),
    so every solve meets its tolerance on any CPU's kernels. gtol then bounds the
    distance to the solution: with max |cos(J_i, r)| <= gtol, ‖Jᵀr‖ <= gtol·‖r‖·‖J‖_F
    and ‖x - x*‖ <= ‖Jᵀr‖ / σ_min².
    """
    J, _ = conditioned_jacobian(200, 30, cond=100.0, seed=8)
    g = torch.Generator().manual_seed(9)
    y = J @ torch.randn(30, 1, generator=g, dtype=DT) + 0.1 * torch.randn(
        200, 1, generator=g, dtype=DT
    )
    expected = torch.linalg.lstsq(J, y).solution.reshape(-1)
    gtol = 1e-10
    r_star = (J @ expected - y.reshape(-1)).norm()
    sigma_min = torch.linalg.svdvals(J)[-1]
    bound = float(gtol * r_star * torch.linalg.matrix_norm(J) / sigma_min**2 / expected.norm())
    runs = {}
    for forcing in (None, 0.5):
        model = nn.Linear(30, 1, bias=False).to(DT)
        with torch.no_grad():
            model.weight.zero_()
        opt = so.LevenbergMarquardt(
            model,
            solver="cg",
            cg_rtol=1e-10,
            cg_max_iter=300,
            cg_forcing=forcing,
            ftol=0,
            xtol=0,
            gtol=gtol,
        )
        infos = []
        for _ in range(40):
            infos.append(opt.step(J, y))
            if infos[-1].terminated:
                break
        assert infos[-1].status == 1, infos[-1].reason  # gtol: at the stationary point
        got = model.weight.detach().reshape(-1)
        assert rel_err(got, expected) <= bound, forcing
        assert all(i.cg_iterations >= 1 for i in infos[:-1])
        runs[forcing] = [i.cg_iterations for i in infos]
    # The forcing term makes the far-from-optimal steps cheap (1 iteration for the
    # first) and the whole fit cheaper, at the same final accuracy.
    assert runs[0.5][0] < runs[None][0]
    assert sum(runs[0.5]) < sum(runs[None])


def test_lm_with_forcing_matches_scipy_on_a_nonlinear_fit():
    scipy_optimize = pytest.importorskip("scipy.optimize")
    np = pytest.importorskip("numpy")
    x = torch.linspace(0, 4, 80, dtype=DT)
    g = torch.Generator().manual_seed(2)
    y = (
        2.0 * torch.exp(-1.5 * x)
        + 0.7 * torch.exp(-0.2 * x)
        + 0.01 * torch.randn(80, generator=g, dtype=DT)
    )

    class TwoExp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.theta = nn.Parameter(torch.tensor([1.0, 1.0, 1.0, 0.1], dtype=DT))

        def forward(self, t: Tensor) -> Tensor:
            a, k, c, q = self.theta
            return a * torch.exp(-k * t) + c * torch.exp(-q * t)

    model = TwoExp()
    opt = so.LevenbergMarquardt(model, solver="cg", cg_rtol=1e-12, cg_forcing=0.5)
    for _ in range(200):
        info = opt.step(x, y)
        if info.terminated:
            break
    assert info.status > 0, info.reason

    t, target = x.numpy(), y.numpy()

    def residual(p):
        a, k, c, q = p
        return a * np.exp(-k * t) + c * np.exp(-q * t) - target

    ref = scipy_optimize.least_squares(residual, [1.0, 1.0, 1.0, 0.1], method="lm", xtol=1e-14)
    got = model.theta.detach()
    assert rel_err(got, torch.tensor(ref.x, dtype=DT)) <= 1e-6
