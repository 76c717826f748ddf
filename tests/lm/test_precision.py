"""gram_dtype="auto": float32 normal matrices while λ hides their rounding, float64 after.

References: the same step taken with the dtype fixed (bitwise), the rule's formula,
``torch.func.jacrev`` for the dual form's scale, and ``torch.linalg.lstsq`` for where
a whole float32 run ends.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

import secondorder as so
from secondorder.lm.linalg import symmetric_product
from secondorder.lm.precision import (
    DualFloorCheck,
    GramPrecision,
    floor_holds,
    reduced_float32_products,
)

U32 = torch.finfo(torch.float32).eps / 2


def _sinc(points: int, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 12), nn.Tanh(), nn.Linear(12, 1)).to(dtype)
    x = torch.linspace(-1, 1, points, dtype=dtype).unsqueeze(1)
    return model, x, torch.sinc(10 * x)


def _params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _one_step(gram_dtype: torch.dtype | str, points: int, damping: float, form: str) -> tuple:
    model, x, y = _sinc(points)
    opt = so.LevenbergMarquardt(model, gram_dtype=gram_dtype, damping=damping, form=form)
    info = opt.step(x, y)
    return info, _params(model)


# -- the rule ---------------------------------------------------------------------------


def test_fixed_choices_do_not_depend_on_damping() -> None:
    for requested, params, expected in [
        (torch.float32, torch.float64, torch.float32),
        (torch.float64, torch.float32, torch.float64),
        (None, torch.float32, torch.float32),
        (None, torch.float64, torch.float64),
        ("auto", torch.float64, torch.float64),
        ("auto", torch.bfloat16, torch.float64),
    ]:
        rule = GramPrecision(requested)
        assert rule.fixed(params) == expected
        for damping in (1e-12, 1.0, 1e12):
            assert rule.choose(params, damping, 10_000) == expected
    # With D = I, λ carries the units of JᵀJ, so the rule has no scale: float64.
    assert GramPrecision("auto", damping_matrix="identity").fixed(torch.float32) == torch.float64
    assert GramPrecision("auto", damping_matrix="more").fixed(torch.float32) is None


def test_auto_switches_where_the_error_estimate_meets_the_tolerance() -> None:
    rule = GramPrecision("auto", tol=1e-2)
    m = 20_000
    eps = U32 * math.sqrt(m)
    assert GramPrecision.error_estimate(m) == pytest.approx(eps, rel=1e-15)
    edge = eps / 1e-2
    assert rule.choose(torch.float32, edge * (1 + 1e-9), m) == torch.float32
    assert rule.choose(torch.float32, edge * (1 - 1e-9), m) == torch.float64
    # More terms in each sum, more rounding: the switch moves up with √m ...
    assert rule.choose(torch.float32, edge * 1.5, 4 * m) == torch.float64
    # ... and with the largest diagonal entry of the scaled matrix (the dual form).
    assert rule.choose(torch.float32, edge * 1.5, m, scale=2.0) == torch.float64
    assert rule.choose(torch.float32, math.inf, m, scale=math.nan) == torch.float64


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"gram_dtype": "float32"}, "gram_dtype='float32'"),
        ({"gram_dtype": torch.float16}, "gram_dtype=torch.float16"),
        ({"gram_auto_tol": 0.0}, "gram_auto_tol=0.0"),
        ({"gram_auto_tol": 1.0}, "gram_auto_tol=1.0"),
        ({"gram_auto_tol": True}, "gram_auto_tol=True"),
        ({"gram_auto_tol": "1e-2"}, "gram_auto_tol='1e-2'"),
    ],
)
def test_bad_precision_options_are_refused(options: dict, match: str) -> None:
    model, _, _ = _sinc(8)
    before = _params(model)
    with pytest.raises((ValueError, TypeError), match=match):
        so.LevenbergMarquardt(model, **options)
    assert torch.equal(_params(model), before)


# -- the step ---------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["primal", "dual"])
@pytest.mark.parametrize(("damping", "expected"), [(1.0, torch.float32), (1e-9, torch.float64)])
def test_auto_step_is_the_fixed_dtype_step(
    form: str, damping: float, expected: torch.dtype
) -> None:
    points = 400 if form == "primal" else 20  # 37 parameters
    info, after = _one_step("auto", points, damping, form)
    ref_info, ref = _one_step(expected, points, damping, form)
    assert info.form == form
    assert info.gram_dtype == str(expected).removeprefix("torch.")
    assert ref_info.gram_dtype == info.gram_dtype
    assert torch.equal(after, ref)
    assert info.loss == ref_info.loss


def test_chunk_rows_fill_the_gap_between_float32_and_float64() -> None:
    """``chunk_rows`` against its formula: the largest power of two b ≥ 512 with
    ``u·√b ≤ tol·λ``, only where float32 over all rows is refused."""
    rule = GramPrecision("auto", tol=0.1)
    rows = 20_000
    assert rule.choose(torch.float32, 1e-3, rows) == torch.float32
    assert rule.chunk_rows(torch.float32, 1e-3, rows) is None
    for lam in (1.4e-5, 2e-5, 5e-5, 8e-5):
        assert rule.choose(torch.float32, lam, rows) == torch.float64
        b = rule.chunk_rows(torch.float32, lam, rows)
        assert b is not None and b >= 512 and b & (b - 1) == 0
        assert U32 * math.sqrt(b) <= 0.1 * lam < U32 * math.sqrt(2 * b)
    assert rule.chunk_rows(torch.float32, 1e-6, rows) is None  # would need b < 512
    assert rule.chunk_rows(torch.float64, 2e-5, rows) is None
    assert GramPrecision(torch.float64).chunk_rows(torch.float32, 2e-5, rows) is None
    assert (
        GramPrecision("auto", damping_matrix="identity").chunk_rows(torch.float32, 2e-5, rows)
        is None
    )
    assert rule.chunk_rows(torch.float32, math.nan, rows) is None
    assert rule.chunk_rows(torch.float32, 0.0, rows) is None


def _tall_jacobian(points: int) -> Tensor:
    """J of the sinc MLP on ``points`` inputs (float32, ``points`` × 37), by jacrev."""
    model, x, _ = _sinc(points)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(model, p, (xi[None],)).reshape(-1)

    jac = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    return torch.cat([jac[k].reshape(points, -1) for k in params], dim=1)


def test_a_gram_summed_from_float32_chunks_is_within_its_estimate() -> None:
    """Against the float64 Gram: the chunked sum is exactly the float64 sum of float32
    chunk products, its error in the units of D = diag(JᵀJ) is below ``u·√b``, and
    below one float32 product's error."""
    from secondorder.lm.linalg import gram_update

    jac = _tall_jacobian(8192)
    exact = jac.double().T @ jac.double()
    inv = exact.diagonal().rsqrt()

    def error(gram: Tensor) -> float:
        scaled = (gram.double() - exact) * inv[:, None] * inv[None, :]
        return float(torch.linalg.matrix_norm(scaled, 2))

    for b in (512, 2048):
        chunked = gram_update(None, jac, torch.float64, chunk=b)
        by_hand = torch.zeros_like(exact)
        for start in range(0, 8192, b):
            part = jac[start : start + b]
            by_hand += (part.T @ part).double()
        assert chunked.dtype == torch.float64 and torch.equal(chunked, by_hand)
        assert error(chunked) <= U32 * math.sqrt(b)
        assert error(chunked) < error(jac.T @ jac)
    twice = gram_update(gram_update(None, jac, torch.float64, 2048), jac, torch.float64, 2048)
    assert torch.equal(twice, 2 * gram_update(None, jac, torch.float64, 2048))


def test_auto_takes_float32_chunks_where_their_estimate_allows() -> None:
    """A step at λ = 2e-5 on 8,192 points: float32 over all rows is refused, chunks of
    1,024 rows are taken, and the step is within ``tol`` of the float64 step."""
    damping = 2e-5
    info, after = _one_step("auto", 8192, damping, "primal")
    assert info.gram_dtype == "float64"
    _, ref = _one_step(torch.float64, 8192, damping, "primal")
    _, f32 = _one_step(torch.float32, 8192, damping, "primal")
    model, _, _ = _sinc(8192)
    start = _params(model)
    step, step64, step32 = (after - start).double(), (ref - start).double(), (f32 - start).double()
    assert not torch.equal(after, ref)  # not the float64 copy's Gram
    assert float((step - step64).norm() / step64.norm()) <= 0.1
    assert float((step - step64).norm()) < float((step32 - step64).norm())


def test_float64_models_keep_float64() -> None:
    runs = []
    for gram_dtype in ("auto", torch.float64):
        model, x, y = _sinc(300, torch.float64)
        opt = so.LevenbergMarquardt(model, gram_dtype=gram_dtype, damping=10.0)
        infos = [opt.step(x, y) for _ in range(5)]
        assert {i.gram_dtype for i in infos} == {"float64"}
        runs.append(_params(model))
    assert torch.equal(runs[0], runs[1])


def test_dual_scale_is_the_mean_diagonal_of_the_scaled_matrix() -> None:
    model, x, y = _sinc(20)
    with torch.no_grad():
        model[0].weight[3] = 0.0  # hidden unit 3 is dead: its 3 columns of J are zero
        model[0].bias[3] = 0.0
        model[2].weight[0, 3] = 0.0
    opt = so.LevenbergMarquardt(model, form="dual", damping=1.0)
    info = opt.step(x, y)
    assert info.form == "dual" and info.gram_dtype == "float32"
    problem = opt.internals().problem
    assert problem is not None
    system = problem.linearize(_params(model))
    names = [k for k, _ in model.named_parameters()]
    params = {k: p.detach().double() for k, p in model.named_parameters()}
    model64 = _sinc(20, torch.float64)[0]

    def residuals(p: dict[str, Tensor]) -> Tensor:
        return (functional_call(model64, p, (x.double(),)) - y.double()).reshape(-1)

    blocks = jacrev(residuals)(params)
    J = torch.cat([blocks[k].reshape(20, -1) for k in names], dim=1)
    col = (J * J).sum(0)
    nonzero = col > 0
    assert int(nonzero.sum()) == 37 - 3
    k = J[:, nonzero] @ torch.diag(1 / col[nonzero]) @ J[:, nonzero].T
    assert system.dual_scale_value() == pytest.approx(float(k.diagonal().mean()), rel=1e-12)


def test_identity_damping_keeps_float64_under_auto() -> None:
    model, x, y = _sinc(200)
    opt = so.LevenbergMarquardt(model, damping_matrix="identity", damping=1e3)
    assert opt.step(x, y).gram_dtype == "float64"


def test_cg_reports_no_normal_matrix() -> None:
    model, x, y = _sinc(200)
    opt = so.LevenbergMarquardt(model, solver="cg")
    assert opt.step(x, y).gram_dtype == ""


def test_a_float32_run_switches_and_ends_at_the_least_squares_solution() -> None:
    # A float32 linear model: λ starts large (float32 steps) and falls toward
    # Gauss-Newton (float64 steps); the answer is lstsq's, to float32 accuracy.
    torch.manual_seed(3)
    a = torch.randn(2_000, 12, dtype=torch.float64) * torch.logspace(0, 2, 12, dtype=torch.float64)
    w_true = torch.randn(12, 1, dtype=torch.float64)
    b = a @ w_true + 0.01 * torch.randn(2_000, 1, dtype=torch.float64)
    model = nn.Linear(12, 1, bias=False)
    opt = so.LevenbergMarquardt(
        model, damping=10.0, damping_rule="multiplicative", damping_down=0.01, ftol=0.0, xtol=0.0
    )
    used = []
    for _ in range(12):
        info = opt.step(a.float(), b.float())
        used.append(info.gram_dtype)
    # The switch sits at λ = u·√2000 / 0.1 ≈ 2.7e-5: 10, 0.1 and 1e-3 are float32.
    assert used[:3] == ["float32"] * 3
    assert "float64" in used[3:]
    ref = torch.linalg.lstsq(a.float().double(), b.float().double()).solution.reshape(-1)
    got = model.weight.detach().double().reshape(-1)
    assert torch.linalg.vector_norm(got - ref) <= 1e-5 * torch.linalg.vector_norm(ref)


def _dual_jacobian(rows: int, hidden: int, seed: int) -> Tensor:
    """J of a tanh MLP's square-root cross-entropy-like residuals: rows ≪ parameters."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 3))
    x = torch.randn(rows, 8)
    params = dict(model.named_parameters())

    def f(p: dict[str, Tensor]) -> Tensor:
        out: Tensor = functional_call(model, p, (x,))
        return out[:, 0]

    jac = jacrev(f)(params)
    return torch.cat([jac[k].reshape(rows, -1) for k in params], dim=1).detach()


def _dual_case(
    rows: int, hidden: int, seed: int, dependent: bool
) -> tuple[Tensor, Tensor, Tensor, float]:
    """``(J, r, D, s)``: D = diag(JᵀJ), s the mean diagonal of ``JD⁻¹Jᵀ``.

    ``dependent`` doubles the rows with copies perturbed by 1e-3 (nearly dependent).
    """
    jac = _dual_jacobian(rows, hidden, seed)
    if dependent:
        noise = torch.randn(jac.shape, generator=torch.Generator().manual_seed(5))
        jac = torch.cat([jac, jac * (1 + 1e-3 * noise)])
    r = torch.randn(jac.shape[0], generator=torch.Generator().manual_seed(seed))
    d = (jac * jac).sum(0).clamp(min=1e-12)
    scale = float((d > torch.finfo(torch.float32).tiny).sum()) / jac.shape[0]
    return jac, r, d, scale


def _float32_step_error(jac: Tensor, d: Tensor, r: Tensor, lam: float) -> float:
    """Relative error of the float32 dual step ``D^-½ Jsᵀ (JsJsᵀ + λI)⁻¹(−r)`` vs float64.

    The float32 step is formed as the dual Cholesky solver forms it (``JsJsᵀ`` by row
    blocks); the reference whole, in float64.
    """
    s32 = d.rsqrt()
    k = symmetric_product(jac * s32)
    k.diagonal().add_(lam)
    y = torch.linalg.solve(k, -r)
    step32 = (s32 * ((jac * s32).T @ y)).double()
    js = jac.double() * d.double().rsqrt()
    k64 = js @ js.T
    k64.diagonal().add_(lam)
    ref = d.double().rsqrt() * (js.T @ torch.linalg.solve(k64, -r.double()))
    return float(torch.linalg.vector_norm(step32 - ref) / ref.norm())


@pytest.mark.parametrize(
    ("rows", "hidden", "seed", "dependent"),
    [(16, 64, 0, False), (32, 256, 1, False), (24, 128, 2, False), (16, 128, 3, True)],
)
def test_a_chosen_float32_dual_solve_is_within_the_tolerance(
    rows: int, hidden: int, seed: int, dependent: bool
) -> None:
    """Against a float64 reference, across λ: where "auto" picks float32 for the dual
    form, the step's relative error stays below ``tol`` (the rule's promise).

    ``dependent`` doubles the rows with a 1e-3 perturbation, so ``JD⁻¹Jᵀ`` is nearly
    singular and λ alone bounds the error: there float32 is wrong (error above tol)
    at small λ, which shows the check can fail.  With independent rows the float32
    error is about 1e-6 at every λ (the smallest eigenvalue of ``JD⁻¹Jᵀ``, not λ,
    bounds it), where the rule, which sees only λ, still keeps float64 below
    λ ≈ ε/tol (benchmarks/notes/NOTES.md).
    """
    jac, r, d, scale = _dual_case(rows, hidden, seed, dependent)
    n = jac.shape[1]
    precision = GramPrecision("auto", tol=0.1)
    chosen = set()
    worst_refused = 0.0
    for lam in torch.logspace(-8, 1, 19).tolist():
        dtype = precision.choose(torch.float32, lam, n, scale)
        chosen.add(dtype)
        err32 = _float32_step_error(jac, d, r, lam)
        if dtype == torch.float32:
            assert err32 <= precision.tol, (lam, err32)
        else:
            worst_refused = max(worst_refused, err32)
    assert chosen == {torch.float32, torch.float64}  # the grid crosses the switch
    if dependent:
        assert worst_refused > precision.tol  # float64 was needed somewhere


def test_floor_holds_proves_only_true_floors() -> None:
    """Against float64 eigenvalues: a floor below ``λ_min(K)`` is proven from a perturbed
    ``K̂`` (``‖K̂ − K‖₂ ≤ eps``), one above it never is; bad input proves nothing."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))
    evals = torch.logspace(-3, 1, 12, dtype=torch.float64)
    k = q @ torch.diag(evals) @ q.T
    noise = torch.randn(12, 12, generator=g, dtype=torch.float64)
    noise = (noise + noise.T) * 1e-6
    eps = float(torch.linalg.matrix_norm(noise, 2))
    k_hat = k + noise
    assert floor_holds(k_hat, 0.5e-3, eps)
    assert floor_holds(k_hat.float(), 0.5e-3, eps + 1e-5)  # float32 input, its rounding added
    assert not floor_holds(k_hat, 1e-3, eps)  # λ_min(K) itself
    assert not floor_holds(k_hat, 2e-3, 0.0)
    assert not floor_holds(torch.zeros(0, 0), 0.0, 0.0)
    assert not floor_holds(k_hat, 0.5e-3, math.inf)
    assert not floor_holds(k_hat, math.nan, eps)
    assert not floor_holds(torch.full((3, 3), math.nan), 0.0, 0.0)


def _scaled_rows(jac: Tensor, r: Tensor, spread: float) -> tuple[Tensor, Tensor]:
    """Rows (and residuals) scaled by ``10^0 … 10^-spread``, as a classifier's rows are:
    a well-classified sample has a tiny residual and a tiny row."""
    scale = torch.logspace(0, -spread, jac.shape[0])[torch.randperm(jac.shape[0])]
    return jac * scale[:, None], r * scale


@pytest.mark.parametrize(
    ("rows", "hidden", "seed", "dependent", "spread"),
    [
        (16, 64, 0, False, 0.0),
        (32, 256, 1, False, 0.0),
        (24, 128, 2, False, 0.0),
        (32, 128, 4, False, 12.0),
        (128, 256, 6, False, 12.0),  # two row blocks of the product
        (16, 128, 3, True, 0.0),
        (16, 128, 5, True, 6.0),
    ],
)
def test_the_scaled_dual_check_keeps_the_promise_and_takes_float32_more_often(
    rows: int, hidden: int, seed: int, dependent: bool, spread: float
) -> None:
    """:class:`DualFloorCheck` on the float32 matrix, against float64 across λ.

    Its premise holds (the float32 product's error, scaled to a unit diagonal, is
    below ``ε̃``); wherever it keeps float32 the step is within ``tol`` of the float64
    step; with independent rows it keeps float32 where the λ-only rule refused it, even
    with row norms spread over 12 orders of magnitude; with nearly dependent rows it
    refuses float32 at small λ, where float32 is indeed wrong.
    """
    jac, r, d, scale = _dual_case(rows, hidden, seed, dependent)
    if spread:
        torch.manual_seed(seed)
        jac, r = _scaled_rows(jac, r, spread)
        d = (jac * jac).sum(0).clamp(min=1e-30)
        scale = float((jac.double() ** 2 / d.double()).sum()) / jac.shape[0]
    n = jac.shape[1]
    precision = GramPrecision("auto", tol=0.1)
    k32 = symmetric_product(jac * d.rsqrt())  # as the dual Cholesky solver forms it
    js64 = jac.double() * d.double().rsqrt()
    k64 = js64 @ js64.T
    kept, sharper, worst_refused = [], 0, 0.0
    for lam in torch.logspace(-12, 1, 27).tolist():
        check = DualFloorCheck(precision, lam, n)
        inv = (k32.double().diagonal() + lam).rsqrt()
        scaled_error = (k32.double() - k64) * inv[:, None] * inv[None, :]
        assert float(torch.linalg.matrix_norm(scaled_error, 2)) <= check.error_estimate(rows)
        float32 = check.float32_suffices(k32)
        err = _float32_step_error(jac, d, r, lam)
        if float32:
            assert err <= precision.tol, (lam, err)
            kept.append(lam)
            sharper += precision.choose(torch.float32, lam, n, scale) == torch.float64
        else:
            worst_refused = max(worst_refused, err)
    if dependent:
        assert min(kept, default=math.inf) > 1e-6  # refused below,
        assert worst_refused > precision.tol  # where float32 would have been wrong
    else:
        assert len(kept) == 27 and sharper > 0


def test_the_scaled_dual_check_refuses_what_it_cannot_judge() -> None:
    precision = GramPrecision("auto", tol=0.1)
    k = torch.eye(4)
    assert DualFloorCheck(precision, 1e-3, 100).float32_suffices(k)
    assert not DualFloorCheck(precision, math.nan, 100).float32_suffices(k)
    assert not DualFloorCheck(precision, -1.0, 100).float32_suffices(k)
    zero_row = torch.diag(torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert not DualFloorCheck(precision, 0.0, 100).float32_suffices(zero_row)  # λ = 0
    nan = k.clone()
    nan[1, 2] = nan[2, 1] = math.nan
    assert not DualFloorCheck(precision, 1e-3, 100).float32_suffices(nan)


def _dual_step(gram_dtype: torch.dtype | str, duplicated: bool) -> tuple:
    """One dual-form step of a small classifier at λ = 1e-9 (16 or 2 x 8 samples)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    x = torch.randn(16, 8)
    y = torch.randint(0, 4, (16,))
    if duplicated:  # every sample twice: J's rows are pairwise equal, K is singular
        x, y = torch.cat([x[:8], x[:8]]), torch.cat([y[:8], y[:8]])
    # Marquardt's D: with the classifiers' default D = I the dual matrix comes from the
    # layers' factors in float64 and no float32 check is made.
    opt = so.LevenbergMarquardt(
        model,
        so.residuals.cross_entropy,
        form="dual",
        gram_dtype=gram_dtype,
        damping=1e-9,
        damping_matrix="marquardt",
    )
    info = opt.step(x, y)
    return info, _params(model), opt


def test_auto_dual_keeps_float32_where_the_scaled_check_allows() -> None:
    """Independent rows: float32 at a λ where λ alone asks for float64, within ``tol``.

    The step is the fixed-float32 step bitwise (the same factorisation), and its
    increment is within ``gram_auto_tol`` of the float64 step's.
    """
    info, after, opt = _dual_step("auto", duplicated=False)
    rule = GramPrecision("auto", tol=opt.config.gram_auto_tol)
    n = after.numel()
    assert rule.choose(torch.float32, 1e-9, n, scale=n / 16) == torch.float64  # λ alone
    assert info.form == "dual" and info.gram_dtype == "float32"
    info32, ref32, _ = _dual_step(torch.float32, duplicated=False)
    assert torch.equal(after, ref32) and info.loss == info32.loss
    _, ref64, _ = _dual_step(torch.float64, duplicated=False)
    torch.manual_seed(0)
    start = _params(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)))
    step32, step64 = (after - start).double(), (ref64 - start).double()
    assert float((step32 - step64).norm() / step64.norm()) <= rule.tol


def test_auto_dual_keeps_float64_where_rows_are_dependent() -> None:
    """Duplicated samples leave nothing to certify: the float64 step, bitwise."""
    info, after, _ = _dual_step("auto", duplicated=True)
    assert info.gram_dtype == "float64"
    info64, ref64, _ = _dual_step(torch.float64, duplicated=True)
    assert torch.equal(after, ref64) and info.loss == info64.loss


@pytest.fixture
def matmul_switches():
    """Restores torch's global float32 matmul switches after a test sets them."""
    backends = torch.backends
    saved = (
        torch.get_float32_matmul_precision(),
        backends.cuda.matmul.fp32_precision,
        backends.fp32_precision,
        backends.mkldnn.matmul.fp32_precision,
    )
    yield
    # The legacy setter writes the newer switches too: it goes first, so that the
    # newer ones end as they were (``"none"`` inherits; a written value would pin).
    torch.set_float32_matmul_precision(saved[0])
    backends.cuda.matmul.fp32_precision = saved[1]
    backends.fp32_precision = saved[2]
    backends.mkldnn.matmul.fp32_precision = saved[3]


def test_tf32_is_read_from_the_legacy_and_the_newer_switches(matmul_switches) -> None:
    cuda, cpu = [torch.device("cuda")], [torch.device("cpu")]
    assert not reduced_float32_products(cuda)  # torch's default: full float32
    torch.set_float32_matmul_precision("high")
    assert reduced_float32_products(cuda)
    assert reduced_float32_products([torch.device("cpu"), torch.device("cuda:1")])
    assert not reduced_float32_products(cpu)  # TF32 is a CUDA matmul mode
    torch.set_float32_matmul_precision("highest")
    assert not reduced_float32_products(cuda)
    # The newer API decides where it says something, for CUDA matmuls or globally.
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert reduced_float32_products(cuda)
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert not reduced_float32_products(cuda)
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.fp32_precision = "tf32"
    assert reduced_float32_products(cuda)
    torch.backends.fp32_precision = "none"
    # A CPU precision through the newer API leaves CUDA's matmuls as they were.
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    assert not reduced_float32_products(cuda)
