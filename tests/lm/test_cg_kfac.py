"""LM's CG solver with the K-FAC preconditioner (``cg_preconditioner="kfac"``).

Oracles: the exact Gauss-Newton block ``JᵀJ`` from ``torch.func.jacrev``; the
explicit block-diagonal Kronecker matrix solved by ``torch.linalg.solve``; the
Cholesky step of the same LM iteration.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import secondorder as so
from secondorder.lm.kfac_cg import KroneckerPreconditioner
from secondorder.lm.linalg import NormalEquations

DT = torch.float64


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _system(model: nn.Module, x: Tensor, y: Tensor, **options: object) -> NormalEquations:
    opt = so.LevenbergMarquardt(model, solver="cg", cg_preconditioner="kfac", **options)
    opt.plan(x, y)
    prob = opt.internals().problem
    assert prob is not None
    return prob.linearize(_flat(model))


def _jacobian(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    numels = [p.numel() for p in model.parameters()]

    def f(flat: Tensor) -> Tensor:
        parts = torch.split(flat, numels)
        params = {k: t.view(s) for k, t, s in zip(names, parts, shapes, strict=True)}
        return (functional_call(model, params, (x,)) - y).reshape(-1)

    out: Tensor = jacrev(f)(_flat(model))
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_factors_equal_the_exact_block_of_one_sample(bias: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3, bias=bias).to(DT)
    x, y = torch.randn(1, 5, dtype=DT), torch.randn(1, 3, dtype=DT)
    system = _system(model, x, y)
    stats = system.kronecker
    assert stats is not None and stats.used == [True]
    J = _jacobian(model, x, y)
    idx = stats.layers[0].index.reshape(-1)
    exact = (J.T @ J)[idx][:, idx]
    torch.testing.assert_close(torch.kron(stats.G[0], stats.A[0]), exact, rtol=1e-12, atol=1e-12)


def test_factors_of_a_batch_follow_the_documented_expansion() -> None:
    # A = Σ ā āᵀ, G = 1/N Σ_n Σ_k g gᵀ; for the last layer of an MLP with r = s - y,
    # g_nk = e_k, so G = k-identity... times 1 (sum over k of e_k e_kᵀ) and A = Σ h hᵀ.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(DT)
    x, y = torch.randn(7, 4, dtype=DT), torch.randn(7, 2, dtype=DT)
    stats = _system(model, x, y).kronecker
    assert stats is not None
    h = torch.tanh(model[0](x)).detach()
    hb = torch.cat([h, torch.ones(7, 1, dtype=DT)], dim=1)
    torch.testing.assert_close(stats.A[1], hb.T @ hb)
    torch.testing.assert_close(stats.G[1], torch.eye(2, dtype=DT))
    xb = torch.cat([x, torch.ones(7, 1, dtype=DT)], dim=1)
    torch.testing.assert_close(stats.A[0], xb.T @ xb)
    # G of the first layer: g_nk = diag(tanh'(s_n)) W2[k]; 1/N Σ_n Σ_k.
    d = 1 - h**2
    w2 = model[2].weight.detach()
    g = d[:, None, :] * w2[None, :, :]  # (n, k, o)
    torch.testing.assert_close(stats.G[0], torch.einsum("nko,nkp->op", g, g) / 7)


@pytest.mark.parametrize("matrix", ["identity", "marquardt"])
def test_application_equals_solve_on_the_explicit_kronecker_matrix(matrix: str) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
    x, y = torch.randn(9, 3, dtype=DT), torch.randn(9, 2, dtype=DT)
    system = _system(model, x, y)
    stats = system.kronecker
    assert stats is not None
    n = system.n
    d = torch.ones(n, dtype=DT) if matrix == "identity" else system.col_sq.clone()
    lam = 0.3
    explicit = torch.diag(system.col_sq + lam * d)
    for layer, A, G in zip(stats.layers, stats.A, stats.G, strict=True):
        idx = layer.index.reshape(-1)
        db = d[layer.index]
        # The documented rank-one fit of D over the block: row sums × column sums / total.
        fit = torch.outer(db.sum(1), db.sum(0)) / db.sum()
        explicit[idx[:, None], idx[None, :]] = torch.kron(G, A) + lam * torch.diag(fit.reshape(-1))
    v = torch.randn(n, dtype=DT)
    got = KroneckerPreconditioner(stats, d, system.col_sq).apply(lam, v)
    torch.testing.assert_close(got, torch.linalg.solve(explicit, v), rtol=1e-9, atol=1e-12)


def _mlp(seed: int, width: int = 24) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2)).to(DT)


def _data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 3, generator=g, dtype=DT)
    return x, torch.sin(x[:, :2] * 2.0)


@pytest.mark.parametrize("matrix", ["identity", "marquardt"])
def test_lm_step_with_kfac_cg_equals_the_cholesky_step(matrix: str) -> None:
    x, y = _data()
    models = [_mlp(4), _mlp(4)]
    chol = so.LevenbergMarquardt(models[0], solver="cholesky", damping_matrix=matrix)
    cg = so.LevenbergMarquardt(
        models[1],
        solver="cg",
        cg_preconditioner="kfac",
        cg_rtol=1e-12,
        # Under Marquardt damping this small problem needs more than n iterations.
        cg_max_iter=5000,
        damping_matrix=matrix,
    )
    for _ in range(2):
        a, b = chol.step(x, y), cg.step(x, y)
        assert a.accepted == b.accepted and a.attempts == b.attempts
        assert b.cg_iterations > 0
    torch.testing.assert_close(_flat(models[1]), _flat(models[0]), rtol=1e-7, atol=1e-9)


def test_kfac_needs_fewer_cg_iterations_than_jacobi_under_identity_damping() -> None:
    # Identity damping (Levenberg's): the Kronecker blocks capture the couplings within
    # a layer that a diagonal cannot.  Under Marquardt damping Jacobi matches the
    # diagonal of JᵀJ + λD exactly and wins on small problems such as this one; the
    # numbers are in benchmarks/notes/CG_KFAC.md.
    x, y = _data()
    counts = {}
    for pc in ("jacobi", "kfac"):
        opt = so.LevenbergMarquardt(
            _mlp(5),
            solver="cg",
            cg_preconditioner=pc,
            cg_rtol=1e-10,
            damping_matrix="identity",
            damping=1e-2,
        )
        counts[pc] = opt.step(x, y).cg_iterations
    assert counts["kfac"] < counts["jacobi"], counts


def test_unsupported_layers_keep_the_jacobi_diagonal() -> None:
    # A Linear called twice per forward and a non-Linear parameter: Jacobi there.
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(2))

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(torch.tanh(self.inner(x))) * self.scale

    torch.manual_seed(6)
    model = Twice().to(DT)
    x, y = torch.randn(5, 2, dtype=DT), torch.randn(5, 2, dtype=DT)
    system = _system(model, x, y)
    assert system.kronecker is not None and system.kronecker.used == [False]
    pre = KroneckerPreconditioner(system.kronecker, system.col_sq, system.col_sq)
    v = torch.randn(system.n, dtype=DT)
    torch.testing.assert_close(pre.apply(0.5, v), v / (system.col_sq * 1.5))


def test_in_place_activation_after_a_linear_keeps_the_exact_factors() -> None:
    torch.manual_seed(7)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(DT)
    inplace = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).to(DT)
    inplace.load_state_dict(plain.state_dict())
    x, y = torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT)
    a, b = _system(plain, x, y).kronecker, _system(inplace, x, y).kronecker
    assert a is not None and b is not None
    for u, v in zip(a.G + a.A, b.G + b.A, strict=True):
        torch.testing.assert_close(u, v)


def test_default_preconditioner_is_jacobi_and_round_trips() -> None:
    x, y = _data()
    opt = so.LevenbergMarquardt(_mlp(8), solver="cg", cg_preconditioner="kfac")
    assert so.LevenbergMarquardt(_mlp(8)).config.cg_preconditioner == "jacobi"
    opt.step(x, y)
    state = opt.state_dict()
    assert state["param_groups"][0]["config"]["cg_preconditioner"] == "kfac"
    # The default is left out, so files of the default configuration are unchanged.
    jacobi = so.LevenbergMarquardt(_mlp(8)).state_dict()
    assert "cg_preconditioner" not in jacobi["param_groups"][0]["config"]
    other = so.LevenbergMarquardt(_mlp(8), solver="cg", cg_preconditioner="kfac")
    other.load_state_dict(state)
    assert other.damping == opt.damping


def test_bad_preconditioner_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Unknown cg_preconditioner='ilu'.*'jacobi', 'kfac'"):
        so.LevenbergMarquardt(_mlp(0), solver="cg", cg_preconditioner="ilu")
    with pytest.raises(ValueError, match=r"cg_preconditioner='kfac' with solver='cholesky'"):
        so.LevenbergMarquardt(_mlp(0), solver="cholesky", cg_preconditioner="kfac")
    with pytest.raises(ValueError, match=r"Unknown cg_preconditioner='x'"):
        so.lm.linalg.CGSolver(preconditioner="x")


def test_kfac_refuses_samples_that_interact() -> None:
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(DT)
    x, y = torch.randn(8, 3, dtype=DT), torch.randn(8, 2, dtype=DT)
    before = _flat(model)
    opt = so.LevenbergMarquardt(model, solver="cg", cg_preconditioner="kfac")
    with pytest.raises(ValueError, match=r"cg_preconditioner='kfac' needs per-sample residuals"):
        opt.step(x, y)
    torch.testing.assert_close(_flat(model), before, rtol=0, atol=0)
