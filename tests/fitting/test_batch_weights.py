"""sigma, xdata and counts of the batched fits against scipy's curve_fit, fit by fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import secondorder as so

scipy_optimize = pytest.importorskip("scipy.optimize")

F64 = torch.float64


def line(x, a, b):
    return a * x + b


def decay(x, a, k):
    return a * torch.exp(-k * x)


def _np_decay(x, a, k):
    return a * np.exp(-k * x)


def _data(b: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.0, 3.0, m, dtype=F64)
    a = 1.0 + torch.rand(b, 1, generator=gen, dtype=F64)
    k = 0.5 + torch.rand(b, 1, generator=gen, dtype=F64)
    y = a * torch.exp(-k * t) + 0.02 * torch.randn(b, m, generator=gen, dtype=F64)
    return t, y


def _covariance(m: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    A = torch.rand(m, m, generator=gen, dtype=F64)
    return 1e-3 * (A @ A.T + m * torch.eye(m, dtype=F64))


@pytest.mark.parametrize("sigma", [0.3, [0.3], np.float64(0.3), torch.tensor(0.3)])
def test_a_scalar_sigma_is_every_points_standard_deviation(sigma):
    t, y = _data(4, 15, seed=1)
    popt, pcov, info = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=sigma)
    assert bool(info.success.all())
    value = float(torch.as_tensor(sigma).double().reshape(()))
    full = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=torch.full((15,), value))
    torch.testing.assert_close(popt, full[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(pcov, full[1], rtol=1e-10, atol=0)
    for b in range(4):
        ref, ref_cov = scipy_optimize.curve_fit(
            _np_decay, t.numpy(), y[b].numpy(), p0=[1.0, 1.0], sigma=np.full(15, 0.3)
        )
        np.testing.assert_allclose(popt[b].numpy(), ref, rtol=1e-6)
        np.testing.assert_allclose(pcov[b].numpy(), ref_cov, rtol=1e-5)


@pytest.mark.parametrize("absolute_sigma", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_a_covariance_sigma_is_scipys_2d_sigma(shared, absolute_sigma):
    b, m = 4, 12
    t, y = _data(b, m, seed=2)
    covs = [_covariance(m, seed=10 + i) for i in range(b)]
    sigma = covs[0] if shared else torch.stack(covs)
    popt, pcov, info = so.curve_fit_batch(
        decay, t, y, p0=[1.0, 1.0], sigma=sigma, absolute_sigma=absolute_sigma
    )
    assert bool(info.success.all())
    for i in range(b):
        ref, ref_cov = scipy_optimize.curve_fit(
            _np_decay,
            t.numpy(),
            y[i].numpy(),
            p0=[1.0, 1.0],
            sigma=(covs[0] if shared else covs[i]).numpy(),
            absolute_sigma=absolute_sigma,
        )
        np.testing.assert_allclose(popt[i].numpy(), ref, rtol=1e-6)
        np.testing.assert_allclose(pcov[i].numpy(), ref_cov, rtol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_covariance_sigma_gives_the_same_bits_in_any_chunk(shared, dtype):
    """Whitening by sums, not a matrix product whose kernel depends on the fits' count."""
    t, y = _data(6, 15, seed=13)
    cov = _covariance(15, seed=14)
    sigma = cov if shared else cov * (1.0 + torch.arange(6, dtype=F64))[:, None, None]
    t, y, sigma = t.to(dtype), y.to(dtype), sigma.to(dtype)

    def jac(x, a, k):
        e = torch.exp(-k * x)
        return torch.stack(torch.broadcast_tensors(e, -a * x * e), -1)

    for given in (None, jac):
        whole = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=sigma, jac=given)
        for chunk in (1, 4):
            part = so.curve_fit_batch(
                decay, t, y, p0=[1.0, 1.0], sigma=sigma, jac=given, chunk_size=chunk
            )
            assert torch.equal(part[0], whole[0]) and torch.equal(part[1], whole[1])
            assert torch.equal(part[2].nfev, whole[2].nfev)


def test_a_diagonal_covariance_is_the_standard_deviations_and_jac_maps_alike():
    t, y = _data(5, 10, seed=3)
    s = 0.01 + torch.rand(5, 10, generator=torch.Generator().manual_seed(4), dtype=F64)
    std = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=s)
    cov = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=torch.diag_embed(s**2))
    torch.testing.assert_close(cov[0], std[0], rtol=1e-10, atol=0)
    torch.testing.assert_close(cov[1], std[1], rtol=1e-8, atol=0)

    def jac(x, a, k):
        e = torch.exp(-k * x)
        return torch.stack([e, -a * x * e], -1)

    sigma = _covariance(10, seed=5)
    auto = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=sigma)
    given = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=sigma, jac=jac)
    torch.testing.assert_close(given[0], auto[0], rtol=1e-10, atol=0)
    torch.testing.assert_close(given[1], auto[1], rtol=1e-8, atol=0)


def test_a_covariance_with_nan_fails_its_fit_alone():
    t, y = _data(3, 8, seed=6)
    covs = torch.stack([_covariance(8, seed=20 + i) for i in range(3)])
    clean = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=covs)
    covs[1, 2, 3] = math.nan
    poisoned = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=covs)
    assert poisoned[2].status.tolist()[1] == -1
    assert torch.equal(poisoned[0][[0, 2]], clean[0][[0, 2]])


def test_sigma_that_reads_two_ways_is_refused_until_the_shape_says_which():
    t, y = _data(6, 6, seed=7)  # B == m: (6, 6) is per-fit sigma or a covariance
    s = torch.full((6, 6), 0.1, dtype=F64)
    with pytest.raises(ValueError, match=r"sigma of shape \(6, 6\) with 6 fits of 6 points"):
        so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=s)
    as_cov = so.curve_fit_batch(decay, t, y, p0=[1.0, 1.0], sigma=torch.diag_embed(s**2))
    as_std = so.curve_fit_batch(decay, t[:5], y[:, :5], p0=[1.0, 1.0], sigma=s[:, :5])
    assert bool(as_cov[2].success.all()) and bool(as_std[2].success.all())
    for b in range(6):
        ref, _ = scipy_optimize.curve_fit(
            _np_decay, t.numpy(), y[b].numpy(), p0=[1.0, 1.0], sigma=s[b].numpy()
        )
        np.testing.assert_allclose(as_cov[0][b].numpy(), ref, rtol=1e-6)


def test_shared_k_by_m_coordinates_with_as_many_fits_as_coordinates():
    yy, xx = torch.meshgrid(torch.arange(7.0), torch.arange(7.0), indexing="ij")
    XY = torch.stack([xx.ravel(), yy.ravel()]).double()  # scipy's (k, m), k = 2

    def blob(XY, a, x0, y0):
        return a * torch.exp(-((XY[0] - x0) ** 2 + (XY[1] - y0) ** 2) / 4.0)

    truth = torch.tensor([[10.0, 3.0, 3.5], [5.0, 2.5, 4.0]], dtype=F64)
    frames = blob(XY, *truth.T[:, :, None]) + 0.05 * torch.randn(
        2, 49, generator=torch.Generator().manual_seed(8), dtype=F64
    )
    with pytest.raises(ValueError, match=r"xdata_per_fit=True for the first"):
        so.curve_fit_batch(blob, XY, frames, p0=[8.0, 3.0, 3.0])
    popt, _, info = so.curve_fit_batch(blob, XY, frames, p0=[8.0, 3.0, 3.0], xdata_per_fit=False)
    assert bool(info.success.all())

    def np_blob(XY, a, x0, y0):
        return a * np.exp(-((XY[0] - x0) ** 2 + (XY[1] - y0) ** 2) / 4.0)

    for b in range(2):
        ref, _ = scipy_optimize.curve_fit(np_blob, XY.numpy(), frames[b].numpy(), p0=[8, 3, 3])
        np.testing.assert_allclose(popt[b].numpy(), ref, rtol=1e-6)
    # Per-fit rows of x, as the same question answered the other way.
    rows = torch.linspace(0.0, 3.0, 49, dtype=F64).expand(2, 49) + torch.tensor([[0.0], [0.5]])
    y = 2.0 * torch.exp(-0.7 * rows)
    per_fit, _, _ = so.curve_fit_batch(decay, rows, y, p0=[1.0, 1.0], xdata_per_fit=True)
    torch.testing.assert_close(per_fit, torch.tensor([[2.0, 0.7]] * 2, dtype=F64))


def _deviance(p: np.ndarray, x: np.ndarray, k: np.ndarray) -> float:
    mu = p[0] * np.exp(-0.5 * ((x - p[1]) / p[2]) ** 2)
    safe = np.where(k > 0, k, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # μ = 0 at a count: inf
        return float(2 * np.sum(np.where(k > 0, mu - k - k * np.log(mu / safe), mu)))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_poisson_peak_without_background_where_the_tails_reach_zero(dtype):
    x = torch.linspace(-40.0, 40.0, 161, dtype=F64)

    def peak(x, a, x0, s):
        return a * torch.exp(-0.5 * ((x - x0) / s) ** 2)

    gen = torch.Generator().manual_seed(9)
    counts = torch.poisson(peak(x, 50.0, 0.0, 1.0).expand(4, -1).contiguous(), generator=gen)
    assert bool((peak(x, 50.0, 0.0, 1.0) == 0).any())  # the model underflows to 0 in the tails
    tight = {"ftol": 1e-14, "xtol": 1e-14, "gtol": 1e-14} if dtype == F64 else {}
    popt, pcov, info = so.curve_fit_batch(
        peak, x.to(dtype), counts.to(dtype), p0=[40.0, 0.5, 1.5], estimator="mle", **tight
    )
    assert bool(info.success.all()), info.message
    assert bool(torch.isfinite(pcov).all())
    rtol = 1e-6 if dtype == F64 else 1e-3
    for b in range(4):
        ref = scipy_optimize.minimize(
            _deviance, popt[b].double().numpy(), args=(x.numpy(), counts[b].numpy()),
            method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000},
        ).x  # fmt: skip
        np.testing.assert_allclose(popt[b].double().numpy(), ref, rtol=rtol, atol=rtol)


def test_poisson_rate_through_the_origin_is_the_closed_form():
    t = torch.arange(0.0, 10.0, dtype=F64)  # μ = a·t is 0 at t = 0, as its count
    counts = torch.poisson(2.0 * t.expand(3, -1), generator=torch.Generator().manual_seed(10))
    popt, pcov, info = so.curve_fit_batch(lambda t, a: a * t, t, counts, p0=[1.0], estimator="mle")
    assert bool(info.success.all())
    rate = counts.sum(1) / t.sum()
    torch.testing.assert_close(popt[:, 0], rate, rtol=1e-8, atol=0)
    # Fisher's information Σt²/μ = Σt/a at the fit.
    torch.testing.assert_close(pcov[:, 0, 0], rate / t.sum(), rtol=1e-6, atol=0)


def test_a_poisson_fit_of_zero_counts_goes_to_the_closed_form_rate_zero():
    """No counts at all: the deviance 2aΣt falls to a = 0 (Σk/Σt), not a stop at p0.

    There the Fisher information Σk/μ² is 0 while the gradient 2Σt is not: the gtol
    test must not read that parameter as converged.
    """
    t = torch.arange(1.0, 11.0, dtype=F64)
    counts = torch.poisson(2.0 * t.expand(3, -1), generator=torch.Generator().manual_seed(11))
    counts[1] = 0.0
    popt, pcov, info = so.curve_fit_batch(lambda t, a: a * t, t, counts, p0=[1.0], estimator="mle")
    rate = counts.sum(1) / t.sum()
    assert float(rate[1]) == 0.0 and bool(info.success.all())
    torch.testing.assert_close(popt[:, 0], rate, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(pcov[:, 0, 0], rate / t.sum(), rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(info.cost[1], torch.zeros((), dtype=F64), rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_poisson_fit_stopped_against_mu_zero_is_reported_unsuccessful(dtype):
    """A background free to go negative, zero counts in the tail: steps into μ < 0 are
    refused until the step size stops the fit short; it must say so, not succeed.

    The reference optimum is the fit with the background bounded at 0 (itself checked
    against scipy's L-BFGS-B on the deviance).  Fit 1 has counts everywhere and
    converges normally: its bits are those of its fit alone.
    """
    t = torch.linspace(0.0, 16.0, 33, dtype=F64)
    rate = 20.0 * torch.exp(-t / 2.0)
    counts = torch.stack(
        [
            torch.poisson(rate, generator=torch.Generator().manual_seed(8)),
            torch.poisson(rate + 5.0, generator=torch.Generator().manual_seed(8)),
        ]
    )
    assert bool((counts[0] == 0).any()) and bool((counts[1] > 0).all())

    def model(t, a, tau, b):
        return a * torch.exp(-t / tau) + b

    args = (model, t.to(dtype), counts.to(dtype))
    kw = {"p0": [10.0, 1.0, 1.0], "estimator": "mle"}
    popt, pcov, info = so.curve_fit_batch(*args, **kw)
    bounded = so.curve_fit_batch(*args, bounds=([-math.inf, -math.inf, 0.0], math.inf), **kw)

    tn, kn = t.numpy(), counts[0].numpy()

    def deviance(p):
        mu = p[0] * np.exp(-tn / p[1]) + p[2]
        safe = np.where(kn > 0, kn, 1.0)
        return float(2 * np.sum(np.where(kn > 0, mu - kn - kn * np.log(mu / safe), mu)))

    ref = scipy_optimize.minimize(
        deviance, [20.0, 2.0, 0.5], method="L-BFGS-B",
        bounds=[(1.0, None), (0.1, None), (0.0, None)], options={"ftol": 1e-14, "gtol": 1e-10},
    )  # fmt: skip
    optimum = 2 * float(bounded[2].cost[0])
    assert bool(bounded[2].success[0])
    assert optimum == pytest.approx(ref.fun, rel=1e-5)
    # Stopped well short of the optimum, and says so.
    assert 2 * float(info.cost[0]) > optimum + 1.0
    assert int(info.status[0]) == -3 and not bool(info.success[0])
    assert info.message[0] == so.fitting.batch.BATCH_MESSAGES[-3]
    assert "stopped against μ = 0" in info.message[0] and "lb = 0" in info.message[0]
    # The other fit converges, and the stuck one changes none of its bits.
    assert int(info.status[1]) in (2, 3, 4) and bool(info.success[1])
    alone = so.curve_fit_batch(model, t.to(dtype), counts[1:].to(dtype), **kw)
    assert torch.equal(alone[0][0], popt[1]) and torch.equal(alone[1][0], pcov[1])
    for key in ("cost", "fun", "nfev", "njev", "nit", "status"):
        assert torch.equal(alone[2][key][0], info[key][1]), key
