"""The functional least_squares against scipy.optimize.least_squares and exact references."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import scipy.optimize
import torch
from torch.func import jacfwd

import secondorder as so

F64 = torch.float64

# -- Moré, Garbow & Hillstrom (1981) test problems ----------------------------------------
#
# Each residual function is written once, generic over the array module ``xp`` (torch or
# numpy), so that the torch version we optimise and the NumPy twin scipy optimises are the
# same formula.  Data constants enter through ``_c``, which makes them the same kind of
# array as ``x``.


def _c(data: Any, x: Any) -> Any:
    arr = np.array(data, dtype=np.float64)
    return torch.from_numpy(arr) if isinstance(x, torch.Tensor) else arr


def rosenbrock(x: Any, xp: Any) -> Any:
    return xp.stack([10 * (x[1] - x[0] ** 2), 1 - x[0]])


def powell_badly_scaled(x: Any, xp: Any) -> Any:
    return xp.stack([1e4 * x[0] * x[1] - 1, xp.exp(-x[0]) + xp.exp(-x[1]) - 1.0001])


def brown_badly_scaled(x: Any, xp: Any) -> Any:
    return xp.stack([x[0] - 1e6, x[1] - 2e-6, x[0] * x[1] - 2])


def beale(x: Any, xp: Any) -> Any:
    y = _c([1.5, 2.25, 2.625], x)
    i = _c([1.0, 2.0, 3.0], x)
    return y - x[0] * (1 - x[1] ** i)


def jennrich_sampson(x: Any, xp: Any) -> Any:
    i = _c(np.arange(1, 11), x)
    return 2 + 2 * i - (xp.exp(i * x[0]) + xp.exp(i * x[1]))


def helical_valley(x: Any, xp: Any) -> Any:
    theta = xp.arctan(x[1] / x[0]) / (2 * math.pi) + xp.where(x[0] < 0, 0.5, 0.0)
    return xp.stack([10 * (x[2] - 10 * theta), 10 * (xp.sqrt(x[0] ** 2 + x[1] ** 2) - 1), x[2]])


_BARD_Y = [0.14, 0.18, 0.22, 0.25, 0.29, 0.32, 0.35, 0.39, 0.37, 0.58, 0.73, 0.96, 1.34, 2.10, 4.39]


def bard(x: Any, xp: Any) -> Any:
    u = np.arange(1, 16, dtype=np.float64)
    v = 16 - u
    w = np.minimum(u, v)
    return _c(_BARD_Y, x) - (x[0] + _c(u, x) / (_c(v, x) * x[1] + _c(w, x) * x[2]))


_GAUSSIAN_Y = [0.0009, 0.0044, 0.0175, 0.0540, 0.1295, 0.2420, 0.3521, 0.3989]
_GAUSSIAN_Y = _GAUSSIAN_Y + _GAUSSIAN_Y[-2::-1]


def gaussian(x: Any, xp: Any) -> Any:
    t = _c((8 - np.arange(1, 16)) / 2, x)
    return x[0] * xp.exp(-x[1] * (t - x[2]) ** 2 / 2) - _c(_GAUSSIAN_Y, x)


_MEYER_Y = [34780, 28610, 23650, 19630, 16370, 13720, 11540, 9744]
_MEYER_Y += [8261, 7030, 6005, 5147, 4427, 3820, 3307, 2872]


def meyer(x: Any, xp: Any) -> Any:
    t = _c(45 + 5 * np.arange(1, 17), x)
    return x[0] * xp.exp(x[1] / (t + x[2])) - _c(_MEYER_Y, x)


def box_3d(x: Any, xp: Any) -> Any:
    t = _c(0.1 * np.arange(1, 11), x)
    e = _c(np.exp(-0.1 * np.arange(1, 11)) - np.exp(-np.arange(1, 11)), x)
    return xp.exp(-t * x[0]) - xp.exp(-t * x[1]) - x[2] * e


def powell_singular(x: Any, xp: Any) -> Any:
    return xp.stack(
        [
            x[0] + 10 * x[1],
            math.sqrt(5) * (x[2] - x[3]),
            (x[1] - 2 * x[2]) ** 2,
            math.sqrt(10) * (x[0] - x[3]) ** 2,
        ]
    )


_KO_Y = [0.1957, 0.1947, 0.1735, 0.1600, 0.0844, 0.0627, 0.0456, 0.0342, 0.0323, 0.0235, 0.0246]
_KO_U = [4, 2, 1, 0.5, 0.25, 0.167, 0.125, 0.1, 0.0833, 0.0714, 0.0625]


def kowalik_osborne(x: Any, xp: Any) -> Any:
    u = _c(_KO_U, x)
    return _c(_KO_Y, x) - x[0] * (u**2 + u * x[1]) / (u**2 + u * x[2] + x[3])


_OSBORNE1_Y = [0.844, 0.908, 0.932, 0.936, 0.925, 0.908, 0.881, 0.850, 0.818, 0.784, 0.751]
_OSBORNE1_Y += [0.718, 0.685, 0.658, 0.628, 0.603, 0.580, 0.558, 0.538, 0.522, 0.506, 0.490]
_OSBORNE1_Y += [0.478, 0.467, 0.457, 0.448, 0.438, 0.431, 0.424, 0.420, 0.414, 0.411, 0.406]


def osborne1(x: Any, xp: Any) -> Any:
    t = _c(10.0 * np.arange(33), x)
    model = x[0] + x[1] * xp.exp(-t * x[3]) + x[2] * xp.exp(-t * x[4])
    return _c(_OSBORNE1_Y, x) - model


def watson(x: Any, xp: Any) -> Any:
    n = 6
    t = _c(np.arange(1, 30) / 29, x)
    s1 = sum((j - 1) * x[j - 1] * t ** (j - 2) for j in range(2, n + 1))
    s2 = sum(x[j - 1] * t ** (j - 1) for j in range(1, n + 1))
    head = s1 - s2**2 - 1
    tail = xp.stack([x[0], x[1] - x[0] ** 2 - 1])
    return xp.concatenate([head, tail])


def brown_dennis(x: Any, xp: Any) -> Any:
    t = _c(np.arange(1, 21) / 5, x)
    a = x[0] + t * x[1] - xp.exp(t)
    b = x[2] + x[3] * xp.sin(t) - xp.cos(t)
    return a**2 + b**2


@dataclass(frozen=True)
class Problem:
    name: str
    residuals: Callable[[Any, Any], Any]
    x0: tuple[float, ...]
    #: Literature minimum of ``Σ f²`` (MGH's ``f``), so ``cost = known / 2``.
    known: float

    def torch_fun(self, x: torch.Tensor) -> torch.Tensor:
        return self.residuals(x, torch)

    def numpy_fun(self, x: np.ndarray) -> np.ndarray:
        return self.residuals(x, np)

    def numpy_jac(self, x: np.ndarray) -> np.ndarray:
        """The exact Jacobian (forward-mode AD of the torch twin), for scipy."""
        return jacfwd(self.torch_fun)(torch.tensor(x, dtype=F64)).numpy()

    def initial_cost(self) -> float:
        return 0.5 * float(np.sum(self.numpy_fun(np.array(self.x0)) ** 2))

    @property
    def x0_tensor(self) -> torch.Tensor:
        return torch.tensor(self.x0, dtype=F64)


PROBLEMS = {
    p.name: p
    for p in [
        Problem("rosenbrock", rosenbrock, (-1.2, 1.0), 0.0),
        Problem("powell_badly_scaled", powell_badly_scaled, (0.0, 1.0), 0.0),
        Problem("brown_badly_scaled", brown_badly_scaled, (1.0, 1.0), 0.0),
        Problem("beale", beale, (1.0, 1.0), 0.0),
        Problem("jennrich_sampson", jennrich_sampson, (0.3, 0.4), 124.362),
        Problem("helical_valley", helical_valley, (-1.0, 0.0, 0.0), 0.0),
        Problem("bard", bard, (1.0, 1.0, 1.0), 8.21487e-3),
        Problem("gaussian", gaussian, (0.4, 1.0, 0.0), 1.12793e-8),
        Problem("meyer", meyer, (0.02, 4000.0, 250.0), 87.9458),
        Problem("box_3d", box_3d, (0.0, 10.0, 20.0), 0.0),
        Problem("powell_singular", powell_singular, (3.0, -1.0, 0.0, 1.0), 0.0),
        Problem("kowalik_osborne", kowalik_osborne, (0.25, 0.39, 0.415, 0.39), 3.07505e-4),
        Problem("osborne1", osborne1, (0.5, 1.5, -1.0, 0.01, 0.02), 5.46489e-5),
        Problem("watson6", watson, (0.0,) * 6, 2.28767e-3),
        Problem("brown_dennis", brown_dennis, (25.0, 5.0, -5.0, -1.0), 85822.2),
    ]
}

EPS = float(np.finfo(np.float64).eps)
TIGHT = {"ftol": 1e-12, "xtol": 1e-12, "gtol": 1e-12}


def scipy_lm(p: Problem, **kw: Any) -> scipy.optimize.OptimizeResult:
    return scipy.optimize.least_squares(
        p.numpy_fun, np.array(p.x0), method="lm", jac=p.numpy_jac, **kw
    )


def cost_error_ok(cost: float, ref: float, c0: float, rel: float) -> bool:
    """``|cost - ref| <= rel * max(ref, eps * c0)``.

    For a zero-residual problem both methods end at roundoff, where a relative
    comparison of two numbers like 1e-30 and 1e-33 means nothing.  ``eps * c0`` is the
    smallest cost we call meaningful: with ``rel = 1e-8`` the test then asks for a cost
    below ``2e-24 * c0``, a reduction of the residual norm by 12 orders of magnitude.
    (MGH's Brown badly scaled problem, whose first residual is ``x1 - 1e6``, stops on
    xtol at 2e-28 * c0: a relative step of 1e-8 on x1 ~ 1e6 is not roundoff there.)
    """
    return abs(cost - ref) <= rel * max(ref, EPS * c0)


def as_np(t: Any) -> np.ndarray:
    return t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def assert_grad_is_jt_f(res: so.OptimizeResult) -> None:
    """``grad == Jᵀf`` to the roundoff of that sum (its terms cancel at a minimum)."""
    J, f, g = as_np(res.jac), as_np(res.fun), as_np(res.grad)
    assert np.all(np.abs(g - J.T @ f) <= 1e-13 * (np.abs(J).T @ np.abs(f)))


# -- 1. the MGH problems against scipy's MINPACK -------------------------------------------

MGH_DEFAULT = [
    pytest.param(p, id=p.name)
    # Brown and Dennis converges linearly (large residual): at the default ftol=1e-8 both
    # methods stop 5e-8 to 1e-7 above the minimum, so a 1e-8 comparison of their final
    # costs measures when each happened to stop, not where it went.
    for p in PROBLEMS.values()
    if p.name != "brown_dennis"
]


@pytest.mark.parametrize("p", MGH_DEFAULT)
def test_mgh_problem_matches_scipy_lm(p: Problem) -> None:
    c0 = p.initial_cost()
    ref = scipy_lm(p)
    # The data and formulas are transcribed by hand: MINPACK must reach MGH's minimum.
    if p.known > 0:
        assert ref.cost == pytest.approx(p.known / 2, rel=1e-5)
    else:
        assert ref.cost <= 1e-8 * EPS * c0
    res = so.least_squares(p.torch_fun, p.x0_tensor)
    print(f"{p.name}: cost {res.cost:.6e} scipy {ref.cost:.6e}; nfev {res.nfev} scipy {ref.nfev}")
    assert cost_error_ok(res.cost, ref.cost, c0, 1e-8)
    assert res.success
    # Observed: ours/scipy nfev between 0.67 (Kowalik-Osborne) and 3.9 (Powell badly scaled,
    # 74 vs 19: many small accepted steps along the curved valley, where MINPACK's
    # trust region takes longer ones); +20 covers a few extra rejected attempts on
    # problems that take under 10 evaluations.
    assert res.nfev <= 4 * ref.nfev + 20


def test_brown_dennis_matches_scipy_lm_at_tight_tolerances() -> None:
    p = PROBLEMS["brown_dennis"]
    ref = scipy_lm(p, ftol=1e-14, xtol=1e-14, gtol=1e-14, max_nfev=2000)
    assert ref.cost == pytest.approx(p.known / 2, rel=1e-5)
    res = so.least_squares(p.torch_fun, p.x0_tensor, **TIGHT, max_nfev=2000)
    assert res.success
    # (x itself is ill-determined here: points 1e-5 apart differ in cost by 1e-12.)
    assert cost_error_ok(res.cost, ref.cost, p.initial_cost(), 1e-10)


# -- 2. the result's fields ----------------------------------------------------------------


def test_result_fields_against_scipy_and_autodiff() -> None:
    p = PROBLEMS["bard"]
    # Scipy's default Jacobian: 2-point differences, so its jac is accurate to ~1e-8.
    ref = scipy.optimize.least_squares(p.numpy_fun, np.array(p.x0), method="lm")
    res = so.least_squares(p.torch_fun, p.x0_tensor)
    assert isinstance(res, so.OptimizeResult)
    assert isinstance(res.x, torch.Tensor)
    assert res.x.dtype == F64
    assert res.x.shape == (3,)
    np.testing.assert_allclose(as_np(res.x), ref.x, rtol=1e-6)
    assert res.cost == pytest.approx(ref.cost, rel=1e-8)

    # fun: the residuals at x, matching scipy's at its (nearby) x.
    assert torch.equal(res.fun, p.torch_fun(res.x))
    np.testing.assert_allclose(as_np(res.fun), ref.fun, rtol=0, atol=1e-6)
    # jac: the exact Jacobian at x, and scipy's finite-difference one to FD accuracy.
    torch.testing.assert_close(res.jac, torch.func.jacrev(p.torch_fun)(res.x), rtol=1e-12, atol=0)
    np.testing.assert_allclose(as_np(res.jac), ref.jac, rtol=1e-5, atol=1e-7)
    # grad = Jᵀf, which is the gradient of the cost ½‖f‖².
    assert_grad_is_jt_f(res)

    def cost_fn(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (p.torch_fun(x) ** 2).sum()

    torch.testing.assert_close(res.grad, torch.func.grad(cost_fn)(res.x), rtol=1e-9, atol=1e-16)
    assert res.optimality == float(res.grad.abs().max())
    assert res.optimality < 1e-6
    assert res.cost == pytest.approx(0.5 * float((res.fun**2).sum()), rel=1e-14)
    assert res.cost == pytest.approx(float(cost_fn(res.x)), rel=1e-14)
    assert torch.equal(res.active_mask, torch.zeros(3, dtype=res.active_mask.dtype))

    # status, message and success mean what scipy's do (both stop on ftol here).
    assert res.status == ref.status == 2
    assert res.message == ref.message
    assert res.success is True
    for name in ("nfev", "njev"):
        value = getattr(res, name)
        assert isinstance(value, int) and not isinstance(value, bool)
    assert 1 <= res.njev <= res.nfev
    assert res["cost"] == res.cost
    assert res["x"] is res.x


@pytest.mark.parametrize("name", ["bard", "osborne1"])
@pytest.mark.parametrize(
    ("tols", "status"),
    [
        ({"ftol": 0.0, "xtol": 0.0, "gtol": 1e-6}, 1),
        ({"ftol": 1e-4, "xtol": 0.0, "gtol": 0.0}, 2),
        ({"ftol": 0.0, "xtol": 1e-4, "gtol": 0.0}, 3),
    ],
    ids=["gtol", "ftol", "xtol"],
)
def test_each_termination_test_gives_scipys_status(
    name: str, tols: dict[str, float], status: int
) -> None:
    p = PROBLEMS[name]
    # MINPACK refuses tolerances below eps; eps there switches that test off as 0 does here.
    ref = scipy_lm(p, **{k: max(v, EPS) for k, v in tols.items()})
    res = so.least_squares(p.torch_fun, p.x0_tensor, **tols)
    assert res.status == ref.status == status
    assert res.message == ref.message
    assert res.success
    if status == 1:
        # MINPACK's gtol measure: the largest |cos| between a column of J and f.
        J, f = res.jac, res.fun
        cos = (J.T @ f).abs() / (torch.linalg.vector_norm(J, dim=0) * torch.linalg.vector_norm(f))
        assert float(cos.max()) <= tols["gtol"]
    # Every criterion stops near the minimum on these well-behaved problems.
    assert res.cost == pytest.approx(ref.cost, rel=1e-3)


# -- 3. robust losses ----------------------------------------------------------------------


def _robust_data(seed: int, t: np.ndarray, clean: np.ndarray, n_out: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y = clean + 0.05 * rng.standard_normal(t.size)
    idx = rng.choice(t.size, n_out, replace=False)
    y[idx] += rng.choice([-1.0, 1.0], n_out) * rng.uniform(1.5, 4.0, n_out)
    return y


_T_EXP = np.linspace(0.0, 10.0, 40)
_Y_EXP = _robust_data(0, _T_EXP, 3.0 * np.exp(-0.4 * _T_EXP) + 0.5, 6)
_T_LINE = np.linspace(-1.0, 1.0, 30)
_Y_LINE = _robust_data(1, _T_LINE, 2.0 - 1.5 * _T_LINE, 5)
_T_SINE = np.linspace(0.0, 6.0, 50)
_Y_SINE = _robust_data(2, _T_SINE, 1.3 * np.sin(1.1 * _T_SINE + 0.3), 7)


def exp_decay(x: Any, xp: Any) -> Any:
    return x[0] * xp.exp(-x[1] * _c(_T_EXP, x)) + x[2] - _c(_Y_EXP, x)


def line(x: Any, xp: Any) -> Any:
    return x[0] + x[1] * _c(_T_LINE, x) - _c(_Y_LINE, x)


def sine(x: Any, xp: Any) -> Any:
    return x[0] * xp.sin(x[1] * _c(_T_SINE, x) + x[2]) - _c(_Y_SINE, x)


ROBUST = {
    p.name: p
    for p in [
        Problem("exp_decay", exp_decay, (1.0, 1.0, 0.0), math.nan),
        Problem("line", line, (1.0, -1.0), math.nan),
        Problem("sine", sine, (1.0, 1.0, 0.0), math.nan),
    ]
}


def rho(loss: str, z: torch.Tensor) -> torch.Tensor:
    """Scipy's robust losses, from its documentation."""
    if loss == "soft_l1":
        return 2 * ((1 + z) ** 0.5 - 1)
    if loss == "huber":
        return torch.where(z <= 1, z, 2 * z.clamp(min=1) ** 0.5 - 1)
    if loss == "cauchy":
        return torch.log1p(z)
    assert loss == "arctan"
    return torch.arctan(z)


@pytest.mark.parametrize("f_scale", [0.1, 1.0])
@pytest.mark.parametrize("loss", ["soft_l1", "huber", "cauchy", "arctan"])
@pytest.mark.parametrize("name", list(ROBUST))
def test_robust_loss_matches_scipy_trf(name: str, loss: str, f_scale: float) -> None:
    p = ROBUST[name]
    ref = scipy.optimize.least_squares(
        p.numpy_fun,
        np.array(p.x0),
        jac=p.numpy_jac,
        method="trf",
        loss=loss,
        f_scale=f_scale,
        **TIGHT,
    )
    if ref.status == 0:
        pytest.skip("scipy's trf did not converge on this case")
    res = so.least_squares(
        p.torch_fun, p.x0_tensor, loss=loss, f_scale=f_scale, **TIGHT, max_nfev=1000
    )
    print(f"{name}/{loss}/{f_scale}: nfev {res.nfev} scipy {ref.nfev}")
    assert res.success
    assert res.cost == pytest.approx(ref.cost, rel=1e-6)
    np.testing.assert_allclose(as_np(res.x), ref.x, rtol=1e-5, atol=1e-6)

    def cost_fn(x: torch.Tensor) -> torch.Tensor:
        f = p.torch_fun(x)
        return 0.5 * f_scale**2 * rho(loss, (f / f_scale) ** 2).sum()

    # cost is ½C²Σρ(f²/C²) and grad its gradient Jᵀ(ρ'f), at the returned x.
    assert res.cost == pytest.approx(float(cost_fn(res.x)), rel=1e-12)
    torch.testing.assert_close(res.grad, torch.func.grad(cost_fn)(res.x), rtol=1e-8, atol=1e-10)
    assert res.optimality == float(res.grad.abs().max())
    assert torch.equal(res.fun, p.torch_fun(res.x))


# -- 4. bounds -----------------------------------------------------------------------------

INF = math.inf
BOUND_CASES = [
    # (problem, x0 or None for the standard one, bounds); the comment says what is active.
    ("bard", None, ([0.0, 0.0, 0.0], [1.0, 5.0, 5.0])),  # interior, two-sided
    ("rosenbrock", (2.0, 1.0), ([1.5, -INF], INF)),  # lower, one-sided
    ("rosenbrock", (1.5, 1.0), ([1.5, -INF], INF)),  # lower, x0 on it
    ("rosenbrock", None, (-INF, [0.5, INF])),  # upper, one-sided
    ("rosenbrock", None, ([-2.0, -2.0], [0.5, 2.0])),  # upper, two-sided
    ("beale", None, ([-INF, -INF], [2.0, INF])),  # upper, one-sided
    ("osborne1", None, ([0.0, 0.0, -5.0, 0.0, 0.0], [5.0, 5.0, 0.0, 0.012, 5.0])),  # upper
    ("watson6", None, (-1.0, 1.0)),  # scalars: one lower and one upper active
]


@pytest.mark.parametrize(
    ("name", "x0", "bounds"),
    BOUND_CASES,
    ids=[
        "interior",
        "lower",
        "x0-on-lower",
        "upper",
        "upper-two-sided",
        "beale",
        "osborne1",
        "scalar",
    ],
)
def test_bounds_match_scipy_trf(name: str, x0: Any, bounds: Any) -> None:
    p = PROBLEMS[name]
    start = np.array(p.x0 if x0 is None else x0)
    ref = scipy.optimize.least_squares(
        p.numpy_fun, start, jac=p.numpy_jac, bounds=bounds, method="trf", **TIGHT
    )
    assert ref.status > 0
    res = so.least_squares(p.torch_fun, torch.tensor(start), bounds=bounds, **TIGHT)
    print(f"{name} {bounds}: nfev {res.nfev} scipy {ref.nfev}; active {ref.active_mask}")
    assert res.success
    # The change of variables carries its own curvature into the model, so an active
    # bound is reached at Newton's rate: a budget comparable to scipy's trf.
    assert res.nfev <= 3 * ref.nfev
    np.testing.assert_allclose(as_np(res.x), ref.x, rtol=1e-6, atol=1e-6)
    assert res.cost == pytest.approx(ref.cost, rel=1e-7)
    np.testing.assert_array_equal(as_np(res.active_mask), ref.active_mask)
    lb, ub = (np.broadcast_to(np.asarray(b, dtype=np.float64), start.shape) for b in bounds)
    x = as_np(res.x)
    assert np.all((lb <= x) & (x <= ub))
    # Scipy's trf reports optimality with Coleman-Li scaling: v = distance to the bound
    # the gradient points to (1 when there is none).
    g = as_np(res.grad)
    v = np.where((g < 0) & np.isfinite(ub), ub - x, np.where((g > 0) & np.isfinite(lb), x - lb, 1))
    assert res.optimality == pytest.approx(float(np.max(np.abs(g * v))), rel=1e-12, abs=1e-300)
    assert_grad_is_jt_f(res)


def test_scalar_bounds_broadcast_and_scipy_bounds_object() -> None:
    p = PROBLEMS["beale"]  # minimum (3, 0.5): x1 <= 2 is active
    n = len(p.x0)
    scalar = so.least_squares(p.torch_fun, p.x0_tensor, bounds=(-2.0, 2.0), **TIGHT)
    ref = scipy.optimize.least_squares(
        p.numpy_fun, np.array(p.x0), jac=p.numpy_jac, bounds=(-2.0, 2.0), **TIGHT
    )
    np.testing.assert_allclose(as_np(scalar.x), ref.x, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(as_np(scalar.active_mask), ref.active_mask)
    assert ref.active_mask.tolist() == [1, 0]
    for bounds in (
        (-2 * np.ones(n), 2 * np.ones(n)),
        ([-2.0] * n, [2.0] * n),
        (-2.0, [2.0] * n),
        scipy.optimize.Bounds(-2 * np.ones(n), 2 * np.ones(n)),
    ):
        other = so.least_squares(p.torch_fun, p.x0_tensor, bounds=bounds, **TIGHT)
        assert torch.equal(other.x, scalar.x)
        assert other.cost == scalar.cost
        assert torch.equal(other.active_mask, scalar.active_mask)
    # A Bounds object with infinite entries (one-sided), against scipy.
    p = PROBLEMS["rosenbrock"]
    b = scipy.optimize.Bounds([-INF, -INF], [0.5, INF])
    ref = scipy.optimize.least_squares(
        p.numpy_fun, np.array(p.x0), jac=p.numpy_jac, bounds=b, **TIGHT
    )
    res = so.least_squares(p.torch_fun, p.x0_tensor, bounds=b, **TIGHT)
    np.testing.assert_allclose(as_np(res.x), ref.x, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(as_np(res.active_mask), ref.active_mask)


def test_active_bound_at_default_tolerances_is_not_declared_converged_early() -> None:
    p = PROBLEMS["bard"]
    bounds = ([0.1, 0.0, 0.0], [1.0, 5.0, 5.0])
    ref = scipy.optimize.least_squares(p.numpy_fun, np.array(p.x0), jac=p.numpy_jac, bounds=bounds)
    res = so.least_squares(p.torch_fun, p.x0_tensor, bounds=bounds)
    assert ref.success and res.success
    assert res.cost == pytest.approx(ref.cost, rel=1e-6)
    np.testing.assert_allclose(as_np(res.x), ref.x, rtol=1e-4)
    assert res.nfev <= ref.nfev


def _ramp_line() -> tuple[np.ndarray, np.ndarray]:
    """A line over x up to 1e6 (slope 0.5, intercept 20): a long, narrow valley."""
    t = np.linspace(0.0, 1e6, 1000)
    return t, 0.5 * t + 20.0 + np.random.default_rng(0).standard_normal(t.size)


@pytest.mark.parametrize("upper", [1e3, 1e4])
def test_a_start_at_the_middle_of_two_sided_bounds_moves_to_scipys_solution(
    upper: float,
) -> None:
    # The middle of the bounds (curve_fit's start without p0) is y = 0 of the change of
    # variables; a first trust region sized from y = 0 could not leave it, and the fit
    # stopped there on ftol.  On the way, the intercept is driven to its lower bound
    # while the slope falls; a step test in the free variable stopped there on xtol.
    t, y = _ramp_line()
    bounds = ([0.0, -100.0], [upper, 100.0])
    middle = np.array([upper / 2, 0.0])
    ref = scipy.optimize.least_squares(lambda p: p[0] * t + p[1] - y, middle, bounds=bounds)
    tt, yt = torch.tensor(t), torch.tensor(y)
    for jac in ("2-point", "auto"):
        res = so.least_squares(
            lambda p: p[0] * tt + p[1] - yt, torch.tensor(middle), jac=jac, bounds=bounds
        )
        assert res.success
        np.testing.assert_allclose(as_np(res.x), ref.x, rtol=1e-6)
        assert res.cost == pytest.approx(ref.cost, rel=1e-9)
    popt, _ = so.curve_fit(lambda x, a, b: a * x + b, t, y, bounds=bounds)
    ref_popt, _ = scipy.optimize.curve_fit(lambda x, a, b: a * x + b, t, y, bounds=bounds)
    np.testing.assert_allclose(popt, ref_popt, rtol=1e-6)


@pytest.mark.parametrize("half_width", [1e6, 1e12, 1e20])
def test_the_middle_of_a_wide_box_is_exact(half_width: float) -> None:
    # Wide finite bounds standing in for infinite ones: x0 = 0 in the middle must be
    # evaluated as 0 (not 0 ± w·1e-16), and the fit must reach scipy's answer.
    seen: list[float] = []

    def fun(p: np.ndarray) -> np.ndarray:
        seen.append(float(p[0]))
        return np.array([p[0] - 0.5, 0.1 * (p[0] - 0.5) ** 2])

    res = so.least_squares(fun, np.zeros(1), bounds=(-half_width, half_width))
    assert seen[0] == 0.0
    assert res.success
    assert res.x[0] == pytest.approx(0.5, rel=1e-7)


def test_a_start_on_a_bound_leaves_it() -> None:
    # p0 = 0 on the lower bound 0 of (0, 10): the start is moved inside by 1e-10 and
    # the first trust region must still let the fit go where scipy's reaches from p0 = 1.
    t = np.linspace(0.0, 4.0, 50)
    y = 2.5 * np.exp(-1.3 * t) + 0.3 + 0.02 * np.random.default_rng(0).standard_normal(t.size)

    def fun(p: np.ndarray) -> np.ndarray:
        return p[0] * np.exp(-p[1] * t) + p[2] - y

    bounds = ([0.0, 0.0, 0.0], [10.0, 10.0, 10.0])
    ref = scipy.optimize.least_squares(fun, np.ones(3), bounds=bounds)
    res = so.least_squares(fun, np.zeros(3), bounds=bounds)
    assert res.success
    assert res.cost == pytest.approx(ref.cost, rel=1e-6)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-4)


@pytest.mark.parametrize("loss", ["soft_l1", "huber", "cauchy", "arctan"])
def test_robust_loss_reports_scipys_scaled_jacobian(loss: str) -> None:
    # scipy's res.jac under a robust loss is J with rows scaled by √(ρ' + 2zρ'') (floored
    # at eps): JᵀJ models the robust cost's Hessian, and curve_fit's pcov inverts it.
    t = np.linspace(0.0, 3.0, 40)
    clean = 2.0 * np.exp(-1.3 * t) + 0.5
    y = clean + 0.02 * np.random.default_rng(1).standard_normal(t.size)
    y[[5, 17, 30]] += [1.0, -0.8, 1.5]  # outliers

    def model(x, a, b, c):
        return a * np.exp(-b * x) + c

    kw = {"p0": [1.0, 1.0, 0.0], "loss": loss, "f_scale": 0.5, "method": "trf"}
    kw_tight = {**kw, "ftol": 1e-12, "xtol": 1e-12, "gtol": 1e-12}
    popt_ref, pcov_ref = scipy.optimize.curve_fit(model, t, y, **kw_tight)
    popt, pcov = so.curve_fit(model, t, y, **kw_tight)
    # Both take J by finite differences: agreement to about √eps.
    np.testing.assert_allclose(popt, popt_ref, rtol=1e-6)
    np.testing.assert_allclose(pcov, pcov_ref, rtol=1e-4)


# -- 5. a linear problem -------------------------------------------------------------------


def _linear_system(seed: int, consistent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Column scales from 1 to 1e-3: condition number ~1e3.
    A = torch.randn(40, 6, generator=g, dtype=F64) * torch.logspace(0, -3, 6, dtype=F64)
    b = torch.randn(40, generator=g, dtype=F64)
    if consistent:
        b = A @ torch.randn(6, generator=g, dtype=F64)
    return A, b


@pytest.mark.parametrize(
    ("consistent", "options", "rtol"),
    [
        (True, {}, 1e-10),
        # λ = 0 makes the first step Gauss-Newton's, as in MINPACK: the QR solve of J.
        (False, {"damping": 0.0}, 1e-10),
        # From λ = 1e-3 the iterates approach the solution geometrically, and stop at
        # 1e-10 to 3.5e-10 when further progress changes the cost by less than its roundoff.
        (False, {}, 1e-9),
    ],
    ids=["consistent", "inconsistent-gauss-newton", "inconsistent-default"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_linear_problem_lands_on_lstsq(
    seed: int, consistent: bool, options: dict[str, float], rtol: float
) -> None:
    A, b = _linear_system(seed, consistent)
    expected = torch.linalg.lstsq(A, b.unsqueeze(-1)).solution.squeeze(-1)
    res = so.least_squares(lambda x: A @ x - b, torch.zeros(6, dtype=F64), **options)
    assert res.success
    err = float(torch.linalg.vector_norm(res.x - expected) / torch.linalg.vector_norm(expected))
    print(f"relative error {err:.2e} after {res.nfev} evaluations")
    assert err <= rtol
    residual = A @ expected - b
    # (A consistent system's minimum is 0: both costs are roundoff, ~1e-28 here.)
    assert res.cost == pytest.approx(0.5 * float(residual @ residual), rel=1e-12, abs=1e-24)


# -- 6. every solver, damping matrix and damping rule --------------------------------------

VARIANTS = [
    pytest.param({"solver": "qr"}, id="qr"),
    pytest.param({"solver": "cg"}, id="cg"),
    pytest.param({"solver": "cholesky"}, id="cholesky"),
    pytest.param({"solver": "eigh"}, id="eigh"),
    pytest.param({"damping_matrix": "more"}, id="more"),
    pytest.param({"damping_matrix": "marquardt"}, id="marquardt"),
    pytest.param({"damping_matrix": "identity"}, id="identity"),
    pytest.param({"damping_rule": "nielsen"}, id="nielsen"),
    pytest.param({"damping_rule": "multiplicative"}, id="multiplicative"),
    pytest.param({"geodesic": True}, id="geodesic"),
    pytest.param({"geodesic": True, "damping_matrix": "identity"}, id="geodesic-identity"),
]


@pytest.mark.parametrize("options", VARIANTS)
@pytest.mark.parametrize("name", ["bard", "osborne1"])
def test_every_variant_reaches_scipys_cost(name: str, options: dict[str, Any]) -> None:
    p = PROBLEMS[name]
    ref = scipy_lm(p, **TIGHT)
    res = so.least_squares(p.torch_fun, p.x0_tensor, **options, **TIGHT)
    print(f"{name} {options}: nfev {res.nfev} scipy {ref.nfev}")
    assert res.success
    assert res.cost == pytest.approx(ref.cost, rel=1e-10)
    np.testing.assert_allclose(as_np(res.x), ref.x, rtol=1e-5)


def test_geodesic_with_numpy_function() -> None:
    p = PROBLEMS["bard"]
    ref = scipy_lm(p, **TIGHT)
    res = so.least_squares(p.numpy_fun, np.array(p.x0), geodesic=True, **TIGHT)
    assert res.cost == pytest.approx(ref.cost, rel=1e-8)


# -- 7. the NumPy interface, callable Jacobians, args and kwargs --------------------------


def test_numpy_function_and_x0_give_numpy_results() -> None:
    p = PROBLEMS["osborne1"]
    ref = scipy.optimize.least_squares(p.numpy_fun, np.array(p.x0), method="lm")
    res = so.least_squares(p.numpy_fun, np.array(p.x0))
    for name in ("x", "fun", "jac", "grad", "active_mask"):
        assert isinstance(getattr(res, name), np.ndarray), name
    assert res.x.dtype == np.float64
    assert res.jac.shape == (33, 5)
    assert res.success
    assert res.cost == pytest.approx(ref.cost, rel=1e-8)
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-5)
    np.testing.assert_array_equal(res.fun, p.numpy_fun(res.x))
    # The Jacobian of a NumPy function comes from 2-point differences.
    np.testing.assert_allclose(res.jac, p.numpy_jac(res.x), rtol=1e-5, atol=1e-6)
    assert_grad_is_jt_f(res)
    # A list is array-like too, and gives NumPy results.
    listed = so.least_squares(p.numpy_fun, list(p.x0))
    assert isinstance(listed.x, np.ndarray)
    np.testing.assert_array_equal(listed.x, res.x)


@pytest.mark.parametrize("jac", ["auto", "fwd", "rev", "2-point", "3-point"])
def test_jacobian_modes_of_a_torch_function(jac: str) -> None:
    p = PROBLEMS["osborne1"]
    ref = scipy_lm(p)
    res = so.least_squares(p.torch_fun, p.x0_tensor, jac=jac)
    assert res.success
    assert res.cost == pytest.approx(ref.cost, rel=1e-8)
    # The reported jac is computed the requested way: exact, or to FD accuracy.
    exact = torch.func.jacfwd(p.torch_fun)(res.x)
    # Finite differences: relative steps ~1e-8 (2-point) and ~6e-6 (3-point) on columns
    # whose entries reach 20 (t up to 320 in exp(-t x4)); observed error 2.4e-6 relative.
    tol = 1e-5 if jac in ("2-point", "3-point") else 1e-13
    scale = float(exact.abs().max())
    torch.testing.assert_close(res.jac, exact, rtol=tol, atol=tol * scale)


def _decay_np(x: np.ndarray, t: np.ndarray, y: np.ndarray, *, weight: float) -> np.ndarray:
    return weight * (x[0] * np.exp(-x[1] * t) + x[2] - y)


def _decay_jac_np(x: np.ndarray, t: np.ndarray, y: np.ndarray, *, weight: float) -> np.ndarray:
    e = np.exp(-x[1] * t)
    return weight * np.stack([e, -x[0] * t * e, np.ones_like(t)], axis=1)


def _decay_torch(
    x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, *, weight: float
) -> torch.Tensor:
    return weight * (x[0] * torch.exp(-x[1] * t) + x[2] - y)


def _decay_jac_torch(
    x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, *, weight: float
) -> torch.Tensor:
    e = torch.exp(-x[1] * t)
    return weight * torch.stack([e, -x[0] * t * e, torch.ones_like(t)], dim=1)


def test_callable_jacobians_args_and_kwargs() -> None:
    t = _T_EXP
    y = 3.0 * np.exp(-0.4 * t) + 0.5 + 0.01 * np.sin(7 * t)
    kwargs = {"weight": 2.0}
    x0 = np.array([1.0, 1.0, 0.0])
    ref = scipy.optimize.least_squares(
        _decay_np, x0, jac=_decay_jac_np, method="lm", args=(t, y), kwargs=kwargs
    )
    # NumPy function with a NumPy Jacobian.
    res_np = so.least_squares(_decay_np, x0, jac=_decay_jac_np, args=(t, y), kwargs=kwargs)
    # Torch function with a torch Jacobian.
    tt, yt = torch.tensor(t), torch.tensor(y)
    res_t = so.least_squares(
        _decay_torch, torch.tensor(x0), jac=_decay_jac_torch, args=(tt, yt), kwargs=kwargs
    )
    for res, x in ((res_np, res_np.x), (res_t, as_np(res_t.x))):
        assert res.success
        assert res.cost == pytest.approx(ref.cost, rel=1e-8)
        np.testing.assert_allclose(x, ref.x, rtol=1e-6)
        # The reported jac is the callable's, with args and kwargs, at x.
        np.testing.assert_allclose(as_np(res.jac), _decay_jac_np(x, t, y, **kwargs), rtol=1e-14)
        assert res.njev >= 1
    # kwargs reach fun: a different weight scales the cost by its square, same minimiser.
    heavier = so.least_squares(
        _decay_np, x0, jac=_decay_jac_np, args=(t, y), kwargs={"weight": 4.0}
    )
    assert heavier.cost == pytest.approx(4 * ref.cost, rel=1e-6)


# -- 8. bad input --------------------------------------------------------------------------


def _f(x: Any) -> Any:
    return x - 1


_X = torch.zeros(2, dtype=F64)


@pytest.mark.parametrize(
    ("fun", "x0", "options", "error", "match"),
    [
        (_f, torch.zeros(2, 2, dtype=F64), {}, ValueError, r"non-empty 1-D.*shape \(2, 2\)"),
        (_f, np.zeros((2, 2)), {}, ValueError, r"non-empty 1-D.*shape \(2, 2\)"),
        (_f, torch.zeros(0, dtype=F64), {}, ValueError, r"non-empty 1-D.*shape \(0,\)"),
        (_f, [], {}, ValueError, r"non-empty 1-D.*shape \(0,\)"),
        (_f, torch.tensor([0.0, math.nan]), {}, ValueError, r"x0 must be finite.*nan"),
        (_f, [0.0, math.inf], {}, ValueError, r"x0 must be finite.*inf"),
        (_f, ["a", "b"], {}, TypeError, r"x0 must be a 1-D array of numbers"),
        (torch.log, -torch.ones(2, dtype=F64), {}, ValueError, r"Residuals are not finite"),
        (lambda x: x + np.inf, np.zeros(2), {}, ValueError, r"Residuals are not finite"),
        (
            _f,
            _X,
            {"bounds": ([0.0, 2.0], [1.0, 1.0])},
            ValueError,
            r"lb\[1\]=2\.0 >= ub\[1\]=1\.0",
        ),
        (_f, _X, {"bounds": (1.0, 1.0)}, ValueError, r"lb\[0\]=1\.0 >= ub\[0\]=1\.0"),
        (_f, _X, {"bounds": (1.0, 2.0)}, ValueError, r"x0 is infeasible.*lb=\[1\.0, 1\.0\]"),
        (_f, _X, {"bounds": (-1.0, [2.0, -0.5])}, ValueError, r"x0 is infeasible"),
        (_f, _X, {"loss": "l2"}, ValueError, r"Unknown loss='l2'.*'soft_l1', 'huber'"),
        (_f, _X, {"jac": "oops"}, ValueError, r"Unknown jac='oops'.*'2-point', '3-point', 'cs'"),
        (_f, _X, {"solver": "lu"}, ValueError, r"Unknown solver='lu'.*'qr', 'cg'"),
        (
            _f,
            _X,
            {"damping_rule": "fixed"},
            ValueError,
            r"Unknown damping_rule='fixed'.*'nielsen', 'multiplicative'",
        ),
        (
            _f,
            _X,
            {"damping_matrix": "jacobi"},
            ValueError,
            r"Unknown damping_matrix='jacobi'.*'identity', 'marquardt', 'more'",
        ),
        (
            _f,
            _X,
            {"f_scale": 0.0},
            ValueError,
            r"Invalid f_scale=0\.0: must be a finite number > 0",
        ),
        (_f, _X, {"f_scale": -1.0}, ValueError, r"Invalid f_scale=-1\.0"),
        (_f, _X, {"ftol": -1e-8}, ValueError, r"Invalid ftol=-1e-08: must be a finite number >= 0"),
        (_f, _X, {"xtol": math.nan}, ValueError, r"Invalid xtol=nan"),
        (_f, _X, {"max_nfev": 0}, ValueError, r"Invalid max_nfev=0: must be an integer >= 1"),
        (None, _X, {}, TypeError, r"fun must be callable, got None"),
        ("abc", _X, {}, TypeError, r"fun must be callable, got 'abc'"),
    ],
)
def test_bad_input_is_refused_with_a_message(
    fun: Any, x0: Any, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        so.least_squares(fun, x0, **options)


# -- 9. the evaluation budget --------------------------------------------------------------


@pytest.mark.parametrize("max_nfev", [1, 5])
def test_max_nfev_reached_is_status_0(max_nfev: int) -> None:
    p = PROBLEMS["rosenbrock"]
    ref = scipy_lm(p, max_nfev=max_nfev)
    res = so.least_squares(p.torch_fun, p.x0_tensor, max_nfev=max_nfev)
    assert res.status == ref.status == 0
    assert res.success is False
    assert res.message == ref.message
    assert res.nfev == max_nfev
    # The result is still the best point seen, with consistent fields.
    assert res.cost < p.initial_cost() or max_nfev == 1
    assert res.cost == pytest.approx(0.5 * float((p.torch_fun(res.x) ** 2).sum()), rel=1e-14)


# -- 10. counting the calls of fun ---------------------------------------------------------
#
# The convention (least_squares's docstring): nfev counts every call of fun except those
# made inside an automatic-differentiation Jacobian, njev counts Jacobians.  "fwd" calls
# fun once per Jacobian, so fun runs exactly nfev + njev times with it and exactly nfev
# times with finite differences or a jac callable.  Reverse mode without bounds takes an
# accepted point's Jacobian from the vjp that evaluated its residuals: nfev + 1 calls
# (the Jacobian at x0 is the only one that calls fun).


class Counted:
    """A function that counts its calls (and keeps the points of NumPy calls)."""

    def __init__(self, fun: Callable[..., Any]) -> None:
        self.fun = fun
        self.calls = 0
        self.points: list[np.ndarray] = []

    def __call__(self, x: Any) -> Any:
        self.calls += 1
        if isinstance(x, np.ndarray):
            self.points.append(x.copy())
        return self.fun(x)


AUTODIFF_CASES = [
    pytest.param({"jac": "fwd"}, id="fwd"),
    pytest.param({"jac": "rev"}, id="rev"),
    pytest.param({}, id="auto"),
    pytest.param({"geodesic": True}, id="geodesic"),
    pytest.param({"bounds": ([0.0, 0.0, 0.0], [1.0, 5.0, 5.0])}, id="bounds"),
    pytest.param({"loss": "soft_l1", "solver": "cholesky"}, id="soft_l1"),
]


@pytest.mark.parametrize("options", AUTODIFF_CASES)
def test_autodiff_calls_fun_nfev_plus_njev_times_or_fused(options: dict[str, Any]) -> None:
    p = PROBLEMS["bard"]
    fun = Counted(p.torch_fun)
    res = so.least_squares(fun, p.x0_tensor, **options)
    assert res.nfev >= 2 and res.njev >= 1
    fused = options.get("jac") != "fwd" and "bounds" not in options  # bard: 15 x 3, rev
    assert fun.calls == res.nfev + (1 if fused else res.njev)
    # The reported residuals and Jacobian were cached along the way: they are res.x's
    # (the Jacobian scaled for a robust loss as scipy scales it: soft_l1's
    # ρ' + 2zρ'' = (1 + z)^-3/2).
    f = p.torch_fun(res.x)
    torch.testing.assert_close(res.fun, f, rtol=0, atol=0)
    jac = jacfwd(p.torch_fun)(res.x)
    if options.get("loss") == "soft_l1":
        jac = jac * ((1 + f**2) ** -0.75)[:, None]
    torch.testing.assert_close(res.jac, jac, rtol=1e-12, atol=1e-15)


FD_CASES = [
    pytest.param({}, 1, id="2-point"),
    pytest.param({"jac": "3-point"}, 2, id="3-point"),
    pytest.param({"geodesic": True}, 1, id="geodesic"),
    pytest.param({"bounds": ([0.0, 0.0, 0.0], [1.0, 5.0, 5.0])}, 1, id="bounds"),
]


@pytest.mark.parametrize(("options", "per_column"), FD_CASES)
def test_finite_differences_call_fun_nfev_times_never_twice_at_a_point(
    options: dict[str, Any], per_column: int
) -> None:
    p = PROBLEMS["bard"]
    fun = Counted(p.numpy_fun)
    res = so.least_squares(fun, np.array(p.x0), **options)
    assert fun.calls == res.nfev
    # Each Jacobian costs n (forward) or 2n (central) calls, all inside nfev.
    assert res.nfev >= 1 + per_column * 3 * res.njev
    distinct = {pt.tobytes() for pt in fun.points}
    assert len(distinct) == len(fun.points)
    np.testing.assert_array_equal(res.fun, p.numpy_fun(res.x))


def test_a_jac_callable_is_called_njev_times_and_fun_nfev_times() -> None:
    p = PROBLEMS["bard"]
    fun, jac = Counted(p.numpy_fun), Counted(p.numpy_jac)
    res = so.least_squares(fun, np.array(p.x0), jac=jac)
    assert (fun.calls, jac.calls) == (res.nfev, res.njev)
    assert res.njev >= 2


@pytest.mark.parametrize(
    ("fun_kind", "options", "calls"),
    [
        # One value and one Jacobian at x0 (before the fix: 6 calls with autodiff).
        ("torch", {}, 2),
        # One value and n = 2 forward-difference columns (before: 10 calls).
        ("numpy", {}, 3),
        # One value and 2n central-difference columns (before: 14 calls).
        ("numpy", {"jac": "3-point"}, 5),
    ],
)
def test_max_nfev_1_calls_fun_for_one_value_and_one_jacobian(
    fun_kind: str, options: dict[str, Any], calls: int
) -> None:
    p = PROBLEMS["rosenbrock"]
    fun = Counted(p.torch_fun if fun_kind == "torch" else p.numpy_fun)
    x0 = p.x0_tensor if fun_kind == "torch" else np.array(p.x0)
    res = so.least_squares(fun, x0, max_nfev=1, **options)
    assert res.status == 0
    assert fun.calls == calls
    assert fun.calls == res.nfev + (res.njev if fun_kind == "torch" else 0)


@pytest.mark.parametrize("name", ["rosenbrock", "bard", "osborne1"])
def test_nfev_against_scipy_lm(name: str) -> None:
    """Our counts against the calls scipy's MINPACK makes, on the same problems.

    scipy 1.17's "lm" reports nfev without its finite-difference calls (its docs say
    they are counted), so the calls are counted here as fun sees them.  Recorded with
    scipy 1.17.1, (ours, scipy):

    ==========  ======================  ===================================
    problem     calls, differences      nfev (njev), exact Jacobian
    ==========  ======================  ===================================
    rosenbrock  (57, 53)                (21 (18), 21 (16))
    bard        (32, 24)                (8 (8), 6 (5))
    osborne1    (133, 98)               (23 (22), 18 (15))
    ==========  ======================  ===================================
    """
    p = PROBLEMS[name]
    ours, theirs = Counted(p.numpy_fun), Counted(p.numpy_fun)
    res = so.least_squares(ours, np.array(p.x0))
    ref = scipy.optimize.least_squares(theirs, np.array(p.x0), method="lm")
    exact = so.least_squares(p.torch_fun, p.x0_tensor)
    ref_exact = scipy_lm(p)
    print(
        f"{name}: differences: calls {ours.calls} scipy {theirs.calls}; exact: nfev "
        f"{exact.nfev} ({exact.njev}) scipy {ref_exact.nfev} ({ref_exact.njev})"
    )
    assert res.success and ref.success
    assert res.nfev == ours.calls
    # Same order of magnitude: both are MINPACK-style LM from the same start.
    assert 0.5 <= ours.calls / theirs.calls <= 2
    assert 0.5 <= exact.nfev / ref_exact.nfev <= 2
