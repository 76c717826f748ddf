"""curve_fit_batch and least_squares_batch against scipy, least_squares and closed forms."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch

import secondorder as so
from secondorder.fitting.batch import api, engine
from secondorder.fitting.batch.driver import run as driver_run

scipy_optimize = pytest.importorskip("scipy.optimize")

F64 = torch.float64


def decay(t, a, k, c):
    return a * torch.exp(-k * t) + c


def peak(x, a, mu, s, c):
    return a * torch.exp(-0.5 * ((x - mu) / s) ** 2) + c


def gauss2d(X, a, x0, y0, s, b):
    return a * torch.exp(-0.5 * ((X[0] - x0) ** 2 + (X[1] - y0) ** 2) / s**2) + b


def _grid() -> torch.Tensor:
    g = torch.arange(5, dtype=F64)
    xx, yy = torch.meshgrid(g, g, indexing="xy")
    return torch.stack([xx.reshape(-1), yy.reshape(-1)])


def _problems(name: str, count: int, seed: int):
    """``(model, numpy model, xdata, ydata (B, m), p0 (B, n))``: random noisy problems."""
    gen = torch.Generator().manual_seed(seed)

    def u(lo, hi):
        return lo + (hi - lo) * torch.rand(count, 1, generator=gen, dtype=F64)

    if name == "decay":
        x = torch.linspace(0, 5, 40, dtype=F64)
        true = torch.cat([u(1, 3), u(0.3, 2), u(0.2, 0.5)], 1)
        model, noise = decay, 0.02

        def np_model(t, a, k, c):
            return a * np.exp(-k * t) + c

    elif name == "peak":
        x = torch.linspace(-3, 3, 50, dtype=F64)
        true = torch.cat([u(1, 3), u(0.5, 1.5), u(0.4, 1.2), u(0.2, 0.5)], 1)
        model, noise = peak, 0.03

        def np_model(x, a, mu, s, c):
            return a * np.exp(-0.5 * ((x - mu) / s) ** 2) + c

    else:
        x = _grid()
        true = torch.cat([u(50, 100), u(1.5, 2.5), u(1.5, 2.5), u(0.8, 1.3), u(5, 10)], 1)
        model, noise = gauss2d, 1.0

        def np_model(X, a, x0, y0, s, b):
            return a * np.exp(-0.5 * ((X[0] - x0) ** 2 + (X[1] - y0) ** 2) / s**2) + b

    clean = model(x, *[true[:, j : j + 1] for j in range(true.shape[1])])
    y = clean + noise * torch.randn(clean.shape, generator=gen, dtype=F64)
    p0 = true * (1 + 0.15 * torch.randn(true.shape, generator=gen, dtype=F64))
    return model, np_model, x, y, p0


TIGHT = {"ftol": 1e-14, "xtol": 1e-14, "gtol": 1e-14}


@pytest.mark.parametrize(("name", "count"), [("decay", 70), ("peak", 70), ("gauss2d", 60)])
def test_agrees_with_scipy_curve_fit_fit_by_fit(name, count):
    model, np_model, x, y, p0 = _problems(name, count, seed=len(name))
    popt, pcov, info = so.curve_fit_batch(model, x, y, p0=p0, **TIGHT)
    agree = 0
    for b in range(count):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref, ref_cov = scipy_optimize.curve_fit(
                    np_model, x.numpy(), y[b].numpy(), p0=p0[b].numpy(), **TIGHT
                )
            ok = True
        except RuntimeError:
            ok = False
        agree += ok == bool(info.success[b])
        if ok and bool(info.success[b]):
            np.testing.assert_allclose(popt[b].numpy(), ref, rtol=1e-6, atol=0)
            # scipy's covariance comes from MINPACK's finite-difference Jacobian: compare
            # in units of the standard errors, sqrt(c_ii c_jj).
            unit = np.sqrt(np.outer(np.diag(ref_cov), np.diag(ref_cov)))
            np.testing.assert_allclose(pcov[b].numpy() / unit, ref_cov / unit, atol=1e-5)
    assert agree >= math.ceil(0.99 * count)


def _batch_trace(fun, x0, args, **kwargs):
    """Run least_squares_batch's engine by hand: each fit's ``x`` after each iteration."""
    captured = {}

    def capture(problem, y0, rule, opts):
        captured.update(problem=problem, y0=y0, rule=rule, opts=opts)
        return driver_run(problem, y0, rule, opts)

    original = api.run
    api.run = capture
    try:
        api.least_squares_batch(fun, x0, args=args, **kwargs)
    finally:
        api.run = original
    problem, rule, opts = captured["problem"], captured["rule"], captured["opts"]
    state = engine.start(problem, captured["y0"], opts.damping)
    traces: list[list[torch.Tensor]] = [[] for _ in range(x0.shape[0])]
    for _ in range(300):
        before = state.nit.clone()
        engine.step(state, problem, rule, budget=opts.budget, xtol_in_x=opts.xtol_in_x)
        x = problem.transform.to_x(state.y)
        for b in torch.nonzero(state.nit > before).flatten().tolist():
            traces[b].append(x[b].clone())
        if bool(state.done.all()):
            break
    return traces, state


@pytest.mark.parametrize(
    ("bounds", "loss"),
    [
        ((-math.inf, math.inf), "linear"),
        (([0.0, 0.0, -1.0], [10.0, 5.0, 1.0]), "linear"),
        ((-math.inf, math.inf), "soft_l1"),
        (([0.0, 0.0, -math.inf], [math.inf, 5.0, math.inf]), "cauchy"),
    ],
)
def test_same_iterates_as_least_squares_one_fit_at_a_time(bounds, loss):
    gen = torch.Generator().manual_seed(1)
    count, t = 16, torch.linspace(0, 4, 30, dtype=F64)
    true = torch.rand(count, 3, generator=gen, dtype=F64) * torch.tensor([1.0, 1.0, 0.1]) + 0.3
    y = decay(t, *[true[:, j : j + 1] for j in range(3)])
    y = y + 0.02 * torch.randn(y.shape, generator=gen, dtype=F64)
    # Poor starts: the trust region's search for λ, rejections and restarts all happen.
    p0 = torch.rand(count, 3, generator=gen, dtype=F64) * torch.tensor([5.0, 4.0, 0.0]) + 0.1

    def fun(q, rows):
        return decay(t, q[:, :1], q[:, 1:2], q[:, 2:]) - rows

    traces, state = _batch_trace(fun, p0, (y,), bounds=bounds, loss=loss)
    for b in range(count):
        ref: list[torch.Tensor] = []
        res = so.least_squares(
            lambda q, b=b: decay(t, q[0], q[1], q[2]) - y[b],
            p0[b].clone(),
            bounds=bounds,
            loss=loss,
            callback=lambda x, ref=ref: ref.append(x.clone()),
        )
        assert (res.nfev, res.status, res.nit) == (
            int(state.nfev[b]),
            int(state.status[b]),
            int(state.nit[b]),
        )
        assert len(ref) == len(traces[b])
        for r, q in zip(ref, traces[b], strict=True):
            # least_squares solves by QR, the batch by Cholesky: the rounding differs.
            torch.testing.assert_close(q, r, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(traces[b][-1], res.x, rtol=1e-10, atol=1e-13)


def test_least_squares_batch_result_matches_least_squares():
    gen = torch.Generator().manual_seed(3)
    t = torch.linspace(0, 3, 25, dtype=F64)
    y = 2.0 * torch.exp(-1.3 * t) + 0.01 * torch.randn(6, 25, generator=gen, dtype=F64)
    x0 = torch.tensor([[1.0, 0.5]], dtype=F64).expand(6, 2)

    def fun(q, rows, scale=1.0):
        return scale * (q[:, :1] * torch.exp(-q[:, 1:] * t) - rows)

    res = so.least_squares_batch(fun, x0, args=(y,), kwargs={"scale": 2.0})
    for b in range(6):
        ref = so.least_squares(lambda q, b=b: 2.0 * (q[0] * torch.exp(-q[1] * t) - y[b]), x0[b])
        torch.testing.assert_close(res.x[b], ref.x, rtol=1e-9, atol=0)
        assert res.cost[b].item() == pytest.approx(ref.cost, rel=1e-9)
        assert (int(res.nfev[b]), int(res.njev[b]), int(res.status[b])) == (
            ref.nfev,
            ref.njev,
            ref.status,
        )
        assert res.message[b] == ref.message and bool(res.success[b]) == ref.success


def test_linear_model_has_the_closed_form_answer():
    gen = torch.Generator().manual_seed(4)
    t = torch.linspace(-1, 1, 20, dtype=F64)
    coef = torch.randn(9, 3, generator=gen, dtype=F64)
    sigma = 0.1 + torch.rand(9, 20, generator=gen, dtype=F64)
    y = coef[:, :1] + coef[:, 1:2] * t + coef[:, 2:] * t**2
    y = y + sigma * torch.randn(y.shape, generator=gen, dtype=F64)

    def quad(t, a, b, c):
        return a + b * t + c * t**2

    for absolute in (False, True):
        popt, pcov, _ = so.curve_fit_batch(
            quad, t, y, p0=[0.0, 0.0, 0.0], sigma=sigma, absolute_sigma=absolute
        )
        design = torch.stack([torch.ones_like(t), t, t**2], 1)
        for b in range(9):
            A = design / sigma[b, :, None]
            rhs = y[b] / sigma[b]
            exact = torch.linalg.solve(A.T @ A, A.T @ rhs)
            cov = torch.linalg.inv(A.T @ A)
            if not absolute:
                r = A @ exact - rhs
                cov = cov * (r @ r) / (20 - 3)
            torch.testing.assert_close(popt[b], exact, rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(pcov[b], cov, rtol=1e-8, atol=1e-12)


def test_poisson_mle_minimises_the_deviance_fit_by_fit():
    gen = torch.Generator().manual_seed(5)
    t = torch.linspace(0, 8, 32, dtype=F64)
    true = torch.stack(
        [
            50 + 50 * torch.rand(12, generator=gen, dtype=F64),
            1 + 2 * torch.rand(12, generator=gen, dtype=F64),
        ],
        1,
    )
    mu = true[:, :1] * torch.exp(-t / true[:, 1:]) + 2.0
    counts = torch.poisson(mu, generator=gen)

    def model(t, a, tau):
        return a * torch.exp(-t / tau) + 2.0

    popt, pcov, info = so.curve_fit_batch(
        model, t, counts, p0=[30.0, 1.5], estimator="mle", **TIGHT
    )
    assert bool(info.success.all())
    tn, kn = t.numpy(), counts.numpy()
    for b in range(12):

        def deviance(p, b=b):
            e = np.exp(-tn / p[1])
            m, k = p[0] * e + 2.0, kn[b]
            safe = np.where(k > 0, k, 1.0)
            value = 2 * np.sum(np.where(k > 0, m - k - k * np.log(m / safe), m))
            dm = np.stack([e, p[0] * e * tn / p[1] ** 2])
            return value, 2 * dm @ (1 - k / m)

        ref = scipy_optimize.minimize(
            deviance, popt[b].numpy() * 1.05, jac=True, method="BFGS", options={"gtol": 1e-9}
        )
        np.testing.assert_allclose(popt[b].numpy(), ref.x, rtol=1e-6)
        assert 2 * info.cost[b].item() == pytest.approx(ref.fun, rel=1e-9, abs=1e-9)
        # pcov is the inverse Fisher information Σ ∂μ∂μᵀ/μ at the fit.
        a, tau = popt[b]
        e = torch.exp(-t / tau)
        grad = torch.stack([e, a * e * t / tau**2], 1)
        fisher = (grad / (a * e + 2.0)[:, None]).T @ grad
        torch.testing.assert_close(pcov[b], torch.linalg.inv(fisher), rtol=1e-6, atol=0)


def test_a_poisoned_fit_fails_alone_and_changes_no_other_fit_bitwise():
    model, _, x, y, p0 = _problems("decay", 40, seed=7)
    clean = so.curve_fit_batch(model, x, y, p0=p0)
    bad_y = y.clone()
    bad_y[5, 3] = math.nan  # a NaN sample
    bad_y[11] = 1.0  # a flat trace: the decay has nothing to fit
    bad_p0 = p0.clone()
    bad_p0[20, 1] = math.inf  # a start that is not a number
    poisoned = so.curve_fit_batch(model, x, bad_y, p0=bad_p0)
    assert int(poisoned[2].status[5]) == -1 and int(poisoned[2].status[20]) == -1
    assert not bool(poisoned[2].success[5]) and "not finite" in poisoned[2].message[5]
    others = [b for b in range(40) if b not in (5, 11, 20)]
    for got, want in zip(poisoned[:2], clean[:2], strict=True):
        assert torch.equal(got[others], want[others])
    for key in ("cost", "nfev", "njev", "nit", "status", "fun"):
        assert torch.equal(poisoned[2][key][others], clean[2][key][others]), key


def test_chunks_and_compaction_give_each_fit_its_own_answer():
    model, _, x, y, p0 = _problems("peak", 30, seed=8)
    whole = so.curve_fit_batch(model, x, y, p0=p0)
    seen = []
    chunked = so.curve_fit_batch(
        model,
        x,
        y,
        p0=p0,
        chunk_size=7,
        check_every=1,
        progress=lambda done, total: seen.append((done, total)),
    )
    for got, want in zip(chunked[:2], whole[:2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert torch.equal(chunked[2].nfev, whole[2].nfev)
    assert seen[-1] == (30, 30) and all(a <= b for (a, _), (b, _) in itertools.pairwise(seen))
    # One fit alone is least_squares' fit.
    one = so.curve_fit_batch(model, x, y[4:5], p0=p0[4])
    torch.testing.assert_close(one[0][0], whole[0][4], rtol=1e-12, atol=1e-14)


def test_float32_per_fit_xdata_and_a_user_jacobian():
    model, _, x, y, p0 = _problems("decay", 20, seed=9)
    ref, _, _ = so.curve_fit_batch(model, x, y, p0=p0)

    def jac(t, a, k, c):
        e = torch.exp(-k * t)
        return torch.stack([e, -a * t * e, torch.ones_like(e)], -1)

    xs = x.expand(20, -1).clone()  # per-fit xdata (B, m)
    popt, pcov, info = so.curve_fit_batch(
        model, xs, y.float(), p0=p0.float(), jac=jac, xdata_per_fit=True
    )
    assert popt.dtype == torch.float32 and pcov.dtype == torch.float32
    assert bool(info.success.all())
    torch.testing.assert_close(popt.double(), ref, rtol=2e-3, atol=2e-3)
    exact, _, _ = so.curve_fit_batch(model, x, y, p0=p0, jac=jac)
    torch.testing.assert_close(exact, ref, rtol=1e-9, atol=1e-12)


def test_x_scale_bounds_per_fit_and_a_robust_loss_match_least_squares():
    model, _, x, y, p0 = _problems("decay", 8, seed=10)
    lb = torch.tensor([0.0, 0.0, -1.0], dtype=F64).expand(8, 3).clone()
    lb[3] = torch.tensor([0.5, 0.1, -0.5], dtype=F64)
    ub = torch.full((8, 3), 10.0, dtype=F64)
    p0 = p0.clamp(min=lb + 0.01, max=ub - 0.01)
    popt, _, info = so.curve_fit_batch(
        model, x, y, p0=p0, bounds=(lb, ub), loss="huber", f_scale=0.05, x_scale=[1.0, 0.5, 0.1]
    )
    for b in range(8):
        ref = so.least_squares(
            lambda q, b=b: model(x, q[0], q[1], q[2]) - y[b],
            p0[b],
            bounds=(lb[b], ub[b]),
            loss="huber",
            f_scale=0.05,
            x_scale=[1.0, 0.5, 0.1],
        )
        torch.testing.assert_close(popt[b], ref.x, rtol=1e-8, atol=1e-10)
        assert int(info.nfev[b]) == ref.nfev and int(info.status[b]) == ref.status


def test_an_empty_batch():
    popt, pcov, info = so.curve_fit_batch(
        decay, torch.zeros(4, dtype=F64), torch.zeros(0, 4, dtype=F64), p0=[1.0, 1.0, 0.0]
    )
    assert popt.shape == (0, 3) and pcov.shape == (0, 3, 3) and info.message == []


def test_the_rule_takes_one_fit_as_0d_state_or_a_batch_of_one():
    """The decision object is shape-agnostic: a 0-d state gives the batch-of-one numbers."""
    from secondorder.fitting.batch.rule import BatchTrustRegion, RuleState, StepMeasures
    from secondorder.fitting.batch.small_linalg import solve_shifted

    gen = torch.Generator().manual_seed(11)
    J = torch.randn(12, 3, generator=gen, dtype=F64)
    g = torch.randn(3, generator=gen, dtype=F64)
    rule = BatchTrustRegion(ftol=1e-8, xtol=1e-8, gtol=1e-8)
    outs = []
    for batch in ((), (1,)):
        A = (J.T @ J).reshape(3, 3, *batch)
        grad = g.reshape(*batch, 3)
        x = torch.ones(*batch, 3, dtype=F64)
        state = RuleState.initial(1e-3, x)
        active = torch.ones(batch, dtype=torch.bool)
        d = rule.diagonal(torch.diagonal(A, dim1=0, dim2=1), state, active)
        sd = d.sqrt()
        As = A / (torch.movedim(sd, -1, 0).unsqueeze(0) * torch.movedim(sd, -1, 0).unsqueeze(1))

        def solve(lam, As=As, gs=grad / sd):
            z = -solve_shifted(As, lam, gs)
            return z, torch.linalg.vector_norm(z, dim=-1)

        xs = torch.linalg.vector_norm(sd * x, dim=-1) * 1e-5  # a small region: λ > 0
        gs_norm = torch.linalg.vector_norm(grad / sd, dim=-1)
        lam, z = rule.choose(state, solve, xs, gs_norm, active)
        delta = z / sd
        one = torch.ones(batch, dtype=F64)
        step = StepMeasures(
            scaled_norm=torch.linalg.vector_norm(z, dim=-1),
            slope=(grad * delta).sum(-1),
            actual=0.5 * one,
            pred=one,
            loss0=10 * one,
            loss1=9.5 * one,
            step_norm=torch.linalg.vector_norm(delta, dim=-1),
            xnorm_before=one,
            xnorm_after=one,
        )
        accepted, status = rule.judge(state, step, active, active)
        outs.append([lam, z, accepted, status, state.radius, state.damping])
    assert float(outs[0][0]) > 0  # the region was filled by a λ > 0, not Gauss-Newton
    for a, b in zip(outs[0], outs[1], strict=True):
        assert a.shape == b.shape[1:] and torch.equal(a, b[0])


@pytest.mark.parametrize("max_nfev", [2**31, 10**12])
def test_a_budget_beyond_the_evaluation_counter_is_no_budget(max_nfev):
    """max_nfev past int32 (the fits' counter) must not wrap to a spent budget."""
    gen = torch.Generator().manual_seed(12)
    t = torch.linspace(0, 4, 20, dtype=F64)
    y = decay(t, 2.0, 0.7, 0.3) + 0.02 * torch.randn(3, 20, generator=gen, dtype=F64)
    big = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0, 0.0], max_nfev=max_nfev)
    ref = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0, 0.0])
    assert bool(big[2].success.all())
    assert torch.equal(big[0], ref[0]) and torch.equal(big[2].nfev, ref[2].nfev)
    res = so.least_squares_batch(
        lambda q, r: decay(t, q[:, :1], q[:, 1:2], q[:, 2:]) - r,
        torch.tensor([[1.0, 1.0, 0.0]], dtype=F64).expand(3, 3),
        args=(y,),
        max_nfev=max_nfev,
    )
    torch.testing.assert_close(res.x, ref[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_fit_of_many_points_gives_the_same_bits_alone_as_in_a_batch(dtype):
    """Chunks of one fit (as the last fit left after compaction) change no bit.

    The gradient Jᵀu of a fit of hundreds of points was a batched matrix product,
    whose kernel for a batch of one rounds differently.
    """
    gen = torch.Generator().manual_seed(13)
    t = torch.linspace(0, 5, 400, dtype=F64)
    true = torch.rand(5, 3, generator=gen, dtype=F64) + 0.3
    y = decay(t, *[true[:, j : j + 1] for j in range(3)])
    y = (y + 0.02 * torch.randn(y.shape, generator=gen, dtype=F64)).to(dtype)
    whole = so.curve_fit_batch(decay, t.to(dtype), y, p0=[1.0, 1.0, 0.0])
    alone = so.curve_fit_batch(decay, t.to(dtype), y, p0=[1.0, 1.0, 0.0], chunk_size=1)
    assert torch.equal(alone[0], whole[0]) and torch.equal(alone[1], whole[1])
    assert torch.equal(alone[2].nfev, whole[2].nfev)
