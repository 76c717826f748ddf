"""``so.least_squares`` and ``so.curve_fit`` with torch functions that compute on the device.

The fitting functions keep their iterate on the CPU, in float64 (``x0`` on a CUDA
device is refused, with a message that says so); what may live on the GPU is the
model function's data and arithmetic.  Here ``fun`` moves the parameters to the data's
device, evaluates there, and returns the residuals on the parameters' device, which
``torch.func`` differentiates through both copies.  The reference is the same fit with
everything on the CPU (the same iterates up to the rounding of ``exp``), and scipy's
``least_squares`` on the same problem, solved to its tightest tolerances.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from cuda_cases import F64, describe_diff, rel_diff

import secondorder as so
from secondorder.fitting import curve_fit

pytestmark = pytest.mark.cuda

#: The device run against the CPU run: both converge on the same minimiser; their last
#: iterates differ by the rounding of the residuals amplified by J's conditioning.
RTOL_CPU = 1e-9
#: Against scipy: both stop by the tolerances' tests (1e-8 by default here).
RTOL_SCIPY = 1e-6
X0 = [1.0, 0.5, 0.0]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """``y = 2.5·exp(-1.3 t) + 0.4`` plus noise at 60 points: three well-determined parameters."""
    g = torch.Generator().manual_seed(5)
    t = torch.linspace(0, 4, 60, dtype=F64)
    return t, 2.5 * torch.exp(-1.3 * t) + 0.4 + 0.01 * torch.randn(60, generator=g, dtype=F64)


def residuals_on(device: torch.device | str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fun(p)``: the model evaluated where the data live, residuals where ``p`` lives."""
    t, y = (v.to(device) for v in data())

    def fun(p: torch.Tensor) -> torch.Tensor:
        q = p.to(t.device)
        return (q[0] * torch.exp(-q[1] * t) + q[2] - y).to(p.device)

    return fun


def scipy_solution() -> np.ndarray:
    optimize = pytest.importorskip("scipy.optimize")
    t, y = (v.numpy() for v in data())

    def fun(p: np.ndarray) -> np.ndarray:
        return p[0] * np.exp(-p[1] * t) + p[2] - y

    def jac(p: np.ndarray) -> np.ndarray:
        e = np.exp(-p[1] * t)
        return np.stack([e, -p[0] * t * e, np.ones_like(t)], axis=1)

    res = optimize.least_squares(fun, X0, jac=jac, method="lm", xtol=1e-15, ftol=1e-15, gtol=1e-15)
    assert res.success, res.message
    x: np.ndarray = res.x
    return x


@pytest.mark.parametrize("jac", ["auto", "fwd", "rev"])
def test_least_squares_on_the_device_equals_the_cpu_and_scipy(
    jac: str, device: torch.device
) -> None:
    ref = so.least_squares(residuals_on("cpu"), torch.tensor(X0, dtype=F64), jac=jac)
    got = so.least_squares(residuals_on(device), torch.tensor(X0, dtype=F64), jac=jac)
    assert ref.success and got.success, (ref.message, got.message)
    assert got.x.device.type == "cpu", got.x.device
    what = f"least_squares(jac={jac!r}) with fun on {device}"
    assert rel_diff(got.x, ref.x) <= RTOL_CPU, f"{what} vs the CPU: {describe_diff(got.x, ref.x)}"
    assert got.cost == pytest.approx(ref.cost, rel=RTOL_CPU), (got.cost, ref.cost)
    want = torch.from_numpy(scipy_solution())
    assert rel_diff(got.x, want) <= RTOL_SCIPY, f"{what} vs scipy: {describe_diff(got.x, want)}"


def test_curve_fit_with_a_model_on_the_device_equals_the_cpu_and_scipy(
    device: torch.device,
) -> None:
    """curve_fit's ``f(t, a, k, c)`` moves each parameter to where ``t`` lives (the GPU)."""
    t, y = data()
    t_dev = t.to(device)

    def decay(tt: torch.Tensor, a: torch.Tensor, k: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        dev = t_dev.device
        return (a.to(dev) * torch.exp(-k.to(dev) * t_dev) + c.to(dev)).to(a.device)

    def decay_cpu(
        tt: torch.Tensor, a: torch.Tensor, k: torch.Tensor, c: torch.Tensor
    ) -> torch.Tensor:
        return a * torch.exp(-k * tt) + c

    popt_ref, pcov_ref = curve_fit(decay_cpu, t, y, p0=torch.tensor(X0, dtype=F64))
    popt, pcov = curve_fit(decay, t, y, p0=torch.tensor(X0, dtype=F64))
    what = f"curve_fit with the model on {device}"
    assert rel_diff(popt, popt_ref) <= RTOL_CPU, f"{what}: {describe_diff(popt, popt_ref)}"
    assert rel_diff(pcov, pcov_ref) <= 1e3 * RTOL_CPU, (
        f"{what}, pcov: {describe_diff(pcov, pcov_ref)}"
    )
    want = torch.from_numpy(scipy_solution())
    assert rel_diff(popt, want) <= RTOL_SCIPY, f"{what} vs scipy: {describe_diff(popt, want)}"


def test_x0_on_a_cuda_device_is_refused(cuda_only: torch.device) -> None:
    x0 = torch.tensor(X0, dtype=F64, device=cuda_only)
    with pytest.raises(
        ValueError, match=r"x0 is on device cuda:\d+; least_squares runs on the CPU"
    ):
        so.least_squares(residuals_on(cuda_only), x0)
