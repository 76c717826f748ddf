"""The normal-equation solve on NumPy-API array modules against the torch solvers.

``linalg_backend="numpy"`` runs the code path cuPyNumeric runs; each test compares
it with ``torch.linalg`` (solver by solver, and whole LM trainings in the primal
and dual forms), and the cuPyNumeric tests repeat the comparisons when that module
can be imported (it needs an NVIDIA driver) and are skipped otherwise.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.linalg import NormalEquations, make_solver
from secondorder.lm.linalg.backends import (
    ArrayCholeskySolver,
    ArrayEighSolver,
    array_module,
    surely_positive_definite,
)

DT = torch.float64
LAMBDAS = (0.0, 1e-6, 1e-3, 0.1, 30.0)


def _cupynumeric_importable() -> bool:
    try:
        importlib.import_module("cupynumeric")
    except Exception:  # without a driver the wheel raises more than ImportError
        return False
    return True


CUPYNUMERIC = _cupynumeric_importable()
BACKENDS = [
    "numpy",
    pytest.param(
        "cupynumeric",
        marks=pytest.mark.skipif(
            not CUPYNUMERIC, reason="cupynumeric cannot be imported (needs an NVIDIA driver)"
        ),
    ),
]


def conditioned(m: int, n: int, cond: float, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """J with singular values 1 … 1/cond, a residual r and a damping diagonal d."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=DT))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=DT))
    J = (u * torch.logspace(0, -math.log10(cond), k, dtype=DT)) @ v.T
    r = torch.randn(m, generator=g, dtype=DT)
    d = 0.2 + 2.0 * torch.rand(n, generator=g, dtype=DT)
    return J, r, d


def record(J: Tensor, r: Tensor, dual: bool) -> NormalEquations:
    common = {"loss_sum": r @ r, "count": r.numel(), "grad": J.T @ r, "col_sq": (J * J).sum(0)}
    if dual:
        return NormalEquations(**common, jac=J, residuals=r, dual=True)
    return NormalEquations(**common, gram=J.T @ J)


# -- solver by solver ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("solver", ["cholesky", "eigh"])
@pytest.mark.parametrize(("m", "n", "dual"), [(40, 12, False), (12, 40, True), (12, 40, False)])
def test_array_solver_equals_torch_solver_and_dense_solve(backend, solver, m, n, dual):
    J, r, d = conditioned(m, n, cond=100.0)
    w = -r
    b = J.T @ w
    ours = make_solver(solver, backend=backend).factor(record(J, r, dual), d)
    torchs = make_solver(solver).factor(record(J, r, dual), d)
    for lam in LAMBDAS:
        expected = torchs.solve(lam, b, w)
        got = ours.solve(lam, b, w)
        if lam == 0.0 and m < n and not dual:
            # JᵀJ (n×n) has rank m < n: singular without damping.  Torch's eigh
            # solver returns inf there, which the optimizer treats as a failure.
            assert got is None
            assert expected is None or not bool(torch.isfinite(expected).all())
            continue
        assert got is not None and expected is not None
        assert got.dtype == b.dtype and got.shape == b.shape
        # Both are backward stable: their forward errors are within cond(A)·ε.
        A = J.T @ J + lam * torch.diag(d)
        if dual:
            Js = J / d.sqrt()
            A = Js @ Js.T + lam * torch.eye(m, dtype=DT)
        tol = max(1e-10, 100 * torch.finfo(DT).eps * float(torch.linalg.cond(A)))
        if lam > 0:
            dense = torch.linalg.solve(J.T @ J + lam * torch.diag(d), b)
            assert float((got - dense).norm() / dense.norm()) <= tol, (lam, solver)
        assert float((got - expected).norm() / expected.norm()) <= tol, (lam, solver)


def test_array_solvers_convert_back_to_the_right_hand_sides_dtype_and_device():
    J, r, d = conditioned(30, 8, cond=10.0)
    fact = ArrayCholeskySolver("numpy").factor(record(J, r, False), d)
    b = (J.T @ -r).float()
    delta = fact.solve(0.1, b)
    assert delta is not None and delta.dtype == torch.float32 and delta.device == b.device
    expected = torch.linalg.solve(J.T @ J + 0.1 * torch.diag(d), J.T @ -r)
    assert torch.allclose(delta.double(), expected, rtol=1e-6)


def test_a_cholesky_that_fails_is_a_failed_attempt_not_an_exception():
    # Indefinite "Gram": NumPy's Cholesky raises, the solver reports None.
    gram = torch.diag(torch.tensor([1.0, -5.0, 2.0], dtype=DT))
    rec = NormalEquations(
        loss_sum=torch.tensor(1.0, dtype=DT),
        count=3,
        grad=torch.ones(3, dtype=DT),
        col_sq=gram.diagonal().abs(),
        gram=gram,
    )
    fact = ArrayCholeskySolver("numpy").factor(rec, torch.ones(3, dtype=DT))
    assert fact.solve(1.0, torch.ones(3, dtype=DT)) is None
    assert fact.solve(10.0, torch.ones(3, dtype=DT)) is not None


def test_without_failure_reports_only_proven_definite_matrices_reach_cholesky(monkeypatch):
    """The path cuPyNumeric takes (its Cholesky cannot fail gracefully), run on NumPy."""
    numpy = array_module("numpy")
    J, r, d = conditioned(12, 40, cond=10.0)  # JᵀJ is singular: rank 12 < 40
    rec = record(J, r, dual=False)
    solver = ArrayCholeskySolver("numpy")
    solver.io.reports_failure = False
    calls: list[int] = []
    real = numpy.linalg.cholesky

    def counting_cholesky(a: object) -> object:
        calls.append(1)
        return real(a)

    monkeypatch.setattr(numpy.linalg, "cholesky", counting_cholesky)
    fact = solver.factor(rec, d)
    b = J.T @ -r
    # λ = 0: not proven definite, so no Cholesky; the LU of the singular matrix
    # fails or gives a step the gain ratio judges.
    fact.solve(0.0, b)
    assert not calls
    # A damping the bound proves safe goes through Cholesky and is exact.
    lam = 1.0
    assert surely_positive_definite(rec.gram.diagonal(), lam * d, torch.finfo(DT).eps)
    got = fact.solve(lam, b)
    assert calls and got is not None
    expected = torch.linalg.solve(J.T @ J + lam * torch.diag(d), b)
    assert float((got - expected).norm() / expected.norm()) <= 1e-10
    # The same without the spy's knowledge: the small-λ LU path is exact where the
    # matrix is definite.
    lam = 1e-14
    assert not surely_positive_definite(rec.gram.diagonal(), lam * d, torch.finfo(DT).eps)
    calls.clear()
    J2, r2, d2 = conditioned(40, 12, cond=10.0)
    fact2 = solver.factor(record(J2, r2, dual=False), d2)
    got = fact2.solve(lam, J2.T @ -r2)
    assert not calls and got is not None
    expected = torch.linalg.solve(J2.T @ J2 + lam * torch.diag(d2), J2.T @ -r2)
    assert float((got - expected).norm() / expected.norm()) <= 1e-10


def test_surely_positive_definite_is_a_sound_sufficient_test():
    eps = torch.finfo(DT).eps
    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        n = 5 + trial
        J = torch.randn(3, n, generator=g, dtype=DT) * torch.logspace(0, 6, n, dtype=DT)
        gram = J.T @ J  # rank 3: singular
        d = gram.diagonal().clamp(min=1e-12)
        for lam in (1e-10, 1e-6, 1e-3, 1.0):
            if surely_positive_definite(gram.diagonal(), lam * d, eps):
                _, info = torch.linalg.cholesky_ex(gram + lam * torch.diag(d))
                assert int(info) == 0, (n, lam)
    assert not surely_positive_definite(torch.ones(3), torch.zeros(3), eps)
    assert surely_positive_definite(torch.ones(3), torch.ones(3), eps)


# -- whole LM trainings --------------------------------------------------------------------

STEPS = 6


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1)).double()


class Exponentials(nn.Module):
    """y = a·exp(-k·x) + c: three parameters, well conditioned."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([1.0, 0.5, 0.0], dtype=DT))

    def forward(self, x: Tensor) -> Tensor:
        a, k, c = self.theta
        return a * torch.exp(-k * x) + c


def problem(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    if name == "mlp-primal":
        x = torch.linspace(-1, 1, 61, dtype=DT)[:, None]
        return mlp(), x, torch.sin(2 * x)
    if name == "mlp-dual":  # 11 residuals < 16 parameters
        x = torch.linspace(-1, 1, 11, dtype=DT)[:, None]
        return mlp(), x, torch.sin(2 * x)
    x = torch.linspace(0, 3, 40, dtype=DT)
    return Exponentials(), x, 2.5 * torch.exp(-1.3 * x) + 0.4


def train(name: str, **options: object) -> tuple[list[Tensor], list[so.StepInfo]]:
    model, x, y = problem(name)
    opt = so.LevenbergMarquardt(model, jacobian="reverse", **options)
    params, infos = [], []
    for _ in range(STEPS):
        infos.append(opt.step(x, y))
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return params, infos


#: name -> (form, relative tolerance).  The MLP runs are ill conditioned: on torch alone,
#: changing only the slice size (so only the order of the sums) moves their parameters
#: by up to 4e-10 relative after 6 steps, and NumPy's LAPACK calls (LU rather than
#: triangular solves, another eigensolver driver) differ from torch's by that order.
LM_CASES = {
    "mlp-primal": ("primal", 1e-8),
    "mlp-dual": ("dual", 1e-9),
    "exponentials": ("primal", 1e-12),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("solver", ["cholesky", "eigh"])
@pytest.mark.parametrize("name", sorted(LM_CASES))
def test_lm_on_the_array_backend_equals_lm_on_torch(backend, solver, name):
    form, rtol = LM_CASES[name]
    ref_params, ref_infos = train(name, solver=solver, form=form)
    params, infos = train(name, solver=solver, form=form, linalg_backend=backend)
    for step, (p, q, a, b) in enumerate(zip(params, ref_params, infos, ref_infos, strict=True)):
        err = float((p - q).abs().max())
        assert err <= rtol * float(q.abs().max()), f"step {step}: max |Δx| = {err:.3g}"
        assert (a.accepted, a.attempts, a.form, a.solver) == (
            b.accepted,
            b.attempts,
            b.form,
            b.solver,
        )
        assert a.loss == pytest.approx(b.loss, rel=1e3 * rtol)
    assert infos[0].form == form
    assert ref_infos[-1].loss < 0.5 * ref_infos[0].loss_before


def test_auto_solver_on_an_array_backend_is_cholesky():
    params, infos = train("exponentials", linalg_backend="numpy")
    ref, _ = train("exponentials", solver="cholesky")
    assert infos[0].solver == "cholesky"
    assert torch.allclose(params[-1], ref[-1], rtol=1e-12, atol=0)


# -- configuration and errors -----------------------------------------------------------------


def test_unknown_backend_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"Unknown linalg_backend='jax'; valid choices are "):
        so.LevenbergMarquardt(mlp(), linalg_backend="jax")
    with pytest.raises(ValueError, match=r"\('torch', 'numpy', 'cupynumeric'\)"):
        so.LMConfig(linalg_backend="cupy")


@pytest.mark.parametrize("solver", ["cg", "qr"])
def test_array_backends_refuse_the_solvers_they_lack(solver):
    with pytest.raises(
        ValueError,
        match=rf"Invalid solver='{solver}' with linalg_backend='numpy': that backend provides "
        r"\('auto', 'cholesky', 'eigh'\)",
    ):
        so.LevenbergMarquardt(mlp(), solver=solver, linalg_backend="numpy")


def test_missing_cupynumeric_raises_an_import_error_that_says_how_to_install(monkeypatch):
    # A None entry in sys.modules makes `import cupynumeric` fail as if not installed.
    monkeypatch.setitem(sys.modules, "cupynumeric", None)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    pattern = (
        r"linalg_backend='cupynumeric' needs the cupynumeric package.*"
        r"pip install 'secondorder\[cupynumeric\]'.*NVIDIA GPU driver.*legate"
    )
    with pytest.raises(ImportError, match=pattern):
        so.LevenbergMarquardt(model, linalg_backend="cupynumeric")
    with pytest.raises(ImportError, match=pattern):
        ArrayEighSolver("cupynumeric")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.skipif(CUPYNUMERIC, reason="cupynumeric imports here")
def test_cupynumeric_without_a_driver_is_refused_with_the_install_message():
    with pytest.raises(ImportError, match=r"pip install 'secondorder\[cupynumeric\]'"):
        so.LMConfig(linalg_backend="cupynumeric")
