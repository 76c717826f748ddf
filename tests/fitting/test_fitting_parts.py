"""The parts least_squares is built from, each against autograd or a closed form.

Losses (ρ and its derivatives), the bounds' change of variables, the finite-difference
Jacobian and the problem's linearisation are public within ``secondorder.fitting``;
these tests pin them down on their own, and every error message of the input checks
they carry.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch.func import grad, jacfwd

import secondorder as so
from secondorder.fitting.bounds import BoxTransform, parse_bounds
from secondorder.fitting.differences import finite_difference
from secondorder.fitting.losses import LOSSES, doubled_cost, rho
from secondorder.fitting.problem import FunctionProblem

F64 = torch.float64
# Squared scaled residuals on both sides of huber's kink at z = 1 (not on it).
Z = torch.tensor([1e-3, 0.2, 0.7, 1.5, 4.0, 30.0], dtype=F64)


@pytest.mark.parametrize("loss", LOSSES)
def test_rho_derivatives_are_autograds(loss: str) -> None:
    def value(z: torch.Tensor) -> torch.Tensor:
        return rho(loss, z)[0]

    _, d1, d2 = rho(loss, Z)
    auto1 = torch.stack([grad(value)(z) for z in Z])
    auto2 = torch.stack([grad(grad(value))(z) for z in Z])
    torch.testing.assert_close(d1, auto1, rtol=1e-13, atol=0)
    torch.testing.assert_close(d2, auto2, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss", LOSSES)
def test_doubled_cost_is_twice_scipys_cost(loss: str) -> None:
    # scipy: cost = ½ f_scale² Σ ρ((f/f_scale)²); linear: ½‖f‖².
    f = torch.tensor([0.3, -2.0, 5.0], dtype=F64)
    f_scale = 0.7
    closed = {
        "linear": (f / f_scale) ** 2,
        "soft_l1": 2 * (torch.sqrt(1 + (f / f_scale) ** 2) - 1),
        "huber": torch.where(
            (f / f_scale) ** 2 <= 1, (f / f_scale) ** 2, 2 * (f / f_scale).abs() - 1
        ),
        "cauchy": torch.log1p((f / f_scale) ** 2),
        "arctan": torch.arctan((f / f_scale) ** 2),
    }[loss]
    expected = f_scale**2 * closed.sum()
    torch.testing.assert_close(doubled_cost(f, loss, f_scale), expected, rtol=1e-14, atol=0)


def test_unknown_loss_in_rho_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"Unknown loss='l1'; valid choices are \('linear'"):
        rho("l1", Z)


# -- bounds ---------------------------------------------------------------------------------

LB = torch.tensor([0.0, -1.0, -math.inf, -math.inf], dtype=F64)
UB = torch.tensor([2.0, math.inf, 3.0, math.inf], dtype=F64)


def test_to_y_inverts_to_x_inside_the_box() -> None:
    box = BoxTransform(LB, UB)
    x = torch.tensor([0.5, 4.0, -7.0, 1.25], dtype=F64)
    torch.testing.assert_close(box.to_x(box.to_y(x)), x, rtol=1e-14, atol=1e-15)


def test_transform_derivatives_are_autograds() -> None:
    box = BoxTransform(LB, UB)
    y = torch.tensor([0.4, -1.3, 0.8, 2.0], dtype=F64)
    d1, d2 = box.derivatives(y)
    J = jacfwd(box.to_x)(y)
    torch.testing.assert_close(d1, J.diagonal(), rtol=1e-14, atol=0)
    H = jacfwd(jacfwd(box.to_x))(y)  # (n, n, n); x_i depends on y_i only
    torch.testing.assert_close(d2, torch.stack([H[i, i, i] for i in range(4)]), rtol=1e-13, atol=0)


@pytest.mark.parametrize("y0", [0.4, -0.8, 1.3, -1.4, 2.9, 4.6, -7.7])
def test_two_sided_map_is_smooth_across_its_three_formulas(y0: float) -> None:
    # x is computed from lb, from the middle or from ub (by sin y): one smooth map.
    box = BoxTransform(torch.tensor([-1.0], dtype=F64), torch.tensor([3.0], dtype=F64))
    y = torch.tensor([y0], dtype=F64)
    torch.testing.assert_close(box.to_x(y), 1.0 + 2.0 * torch.sin(y), rtol=1e-15, atol=4e-16)
    d1, d2 = box.derivatives(y)
    torch.testing.assert_close(d1, jacfwd(box.to_x)(y).diagonal(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(d2[0], jacfwd(jacfwd(box.to_x))(y)[0, 0, 0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("lb", "ub", "x"),
    [
        (0.0, math.inf, 3.3e-15),  # a saturation current above 0
        (-math.inf, 2.0, 2.0 - 7e-13),  # just below an upper bound
        (0.0, 1e-6, 1e-14),  # two-sided, near lb
        (0.0, 1.0, 1.0 - 3e-12),  # two-sided, near ub
        (-1e3, 1e3, 1.5),  # two-sided, in the middle
        (5.0, math.inf, 5.0 + 2e-9),
    ],
)
def test_points_near_a_bound_keep_their_distance_to_it(lb: float, ub: float, x: float) -> None:
    # x - lb (or ub - x, or x - the middle) survives the round trip to digits, where
    # √(y² + 1) - 1 and (sin y + 1)/2 lost all but a few of them.
    box = BoxTransform(torch.tensor([lb], dtype=F64), torch.tensor([ub], dtype=F64))
    t = torch.tensor([x], dtype=F64)
    back = float(box.to_x(box.to_y(t))[0])
    ref = min(
        abs(x - lb), abs(ub - x), abs(x - (lb + ub) / 2) if math.isfinite(lb + ub) else math.inf
    )
    assert abs(back - x) <= 1e-12 * ref + 4 * np.spacing(abs(x))


def test_active_mask_and_strictly_feasible() -> None:
    box = BoxTransform(LB, UB)
    x = torch.tensor([2.0, -1.0, 3.0, 0.0], dtype=F64)
    assert box.active(x).tolist() == [1, -1, 1, 0]
    inside = box.strictly_feasible(x)
    assert bool((inside > LB).all()) and bool((inside < UB).all())
    assert box.active(inside, tol=0.0).tolist() == [0, 0, 0, 0]


def test_scipy_bounds_read_like_a_pair() -> None:
    from scipy.optimize import Bounds

    lb, ub = parse_bounds(Bounds([0.0, -1.0], [1.0, np.inf]), 2)
    lb2, ub2 = parse_bounds(([0.0, -1.0], [1.0, np.inf]), 2)
    assert torch.equal(lb, lb2) and torch.equal(ub, ub2)


@pytest.mark.parametrize(
    ("bounds", "match"),
    [
        ((0.0, 1.0, 2.0), r"bounds must be a pair \(lb, ub\), got \(0\.0, 1\.0, 2\.0\)"),
        (("a", 1.0), r"bounds lb must be numbers, got 'a'"),
        ((0.0, [1.0, 2.0, 3.0]), r"bounds ub must be a scalar or have shape \(2,\), got \(3,\)"),
        ((math.nan, 1.0), r"bounds lb contains NaN: \[nan, nan\]"),
    ],
)
def test_bad_bounds_are_refused_with_a_message(bounds: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        so.least_squares(lambda x: x, torch.zeros(2, dtype=F64), bounds=bounds)


# -- Jacobians and the problem --------------------------------------------------------------


def _fun(x: torch.Tensor) -> torch.Tensor:
    t = torch.linspace(0, 1, 5, dtype=F64)
    return x[0] * torch.exp(-x[1] * t) + x[1] ** 2 - t


@pytest.mark.parametrize(("scheme", "tol"), [("2-point", 1e-6), ("3-point", 1e-9)])
def test_finite_differences_approach_the_exact_jacobian(scheme: str, tol: float) -> None:
    x = torch.tensor([1.5, 0.7], dtype=F64)
    torch.testing.assert_close(
        finite_difference(_fun, scheme)(x), jacfwd(_fun)(x), rtol=0, atol=tol
    )


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("bounded", [False, True])
def test_linearisation_gradient_is_the_costs_gradient(loss: str, bounded: bool) -> None:
    # Triggs' rows and the curvature rows of the bounds leave Jᵀr = ∇(cost) in y.
    lb = torch.tensor([1.0, -math.inf], dtype=F64) if bounded else torch.full((2,), -math.inf)
    ub = torch.tensor([3.0, 2.0], dtype=F64) if bounded else torch.full((2,), math.inf)
    box = BoxTransform(lb.to(F64), ub.to(F64))
    f_scale = 0.3
    problem = FunctionProblem(
        _fun, jacfwd(_fun), box, loss, f_scale, need_gram=True, differentiable=True
    )
    y = torch.tensor([0.4, 0.9], dtype=F64)
    system = problem.linearize(y, problem.residuals(y))

    def cost(t: torch.Tensor) -> torch.Tensor:
        return 0.5 * doubled_cost(_fun(box.to_x(t)), loss, f_scale)

    torch.testing.assert_close(system.grad, grad(cost)(y), rtol=1e-12, atol=1e-14)
    assert system.gram is not None and system.jac is not None
    torch.testing.assert_close(system.gram, system.jac.T @ system.jac, rtol=1e-14, atol=0)
    assert problem.nfev == 1 and problem.njev == 1


def test_second_directional_by_differences_matches_the_exact_one() -> None:
    box = BoxTransform(torch.tensor([0.0, -math.inf], dtype=F64), torch.full((2,), math.inf))
    y = torch.tensor([0.8, 0.3], dtype=F64)
    v = torch.tensor([0.2, -0.5], dtype=F64)
    out = []
    for differentiable in (True, False):
        problem = FunctionProblem(
            _fun, jacfwd(_fun), box, "cauchy", 1.0, need_gram=False, differentiable=differentiable
        )
        system = problem.linearize(y, problem.residuals(y))
        out.append(problem.second_directional(y, v, system))
    (b_exact, r_exact), (b_fd, r_fd) = out
    assert r_exact is not None and r_fd is not None
    torch.testing.assert_close(r_fd, r_exact, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b_fd, b_exact, rtol=1e-6, atol=1e-7)


# -- error messages of the call ---------------------------------------------------------------


def _np(x: Any) -> Any:
    return np.asarray(x) * 2.0


class _TensorThenList:
    """A fun that answers the probe with a tensor and later calls with a list."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> Any:
        self.calls += 1
        return x * 1.0 if self.calls == 1 else [1.0]


@pytest.mark.parametrize(
    ("fun", "x0", "options", "error", "match"),
    [
        (_np, [0.0], {"args": 3}, TypeError, r"args must be a tuple of extra arguments.*3"),
        (_np, [0.0], {"geodesic": 1}, TypeError, r"Invalid geodesic=1: must be True or False\."),
        (_np, np.ones(2, dtype=complex), {}, ValueError, r"x0 must be real, got a complex"),
        (lambda x: x[:0], torch.zeros(2, dtype=F64), {}, ValueError, r"fun returned no residuals"),
        (
            _TensorThenList(),
            torch.zeros(1, dtype=F64),
            {},
            TypeError,
            r"fun returned list, expected a tensor",
        ),
        (
            lambda x: (x > 0).long(),
            torch.zeros(1, dtype=F64),
            {},
            TypeError,
            r"fun must return real floating-point residuals, got torch\.int64",
        ),
        (
            lambda x: (x > 0).astype(int),
            np.zeros(1),
            {},
            TypeError,
            r"fun must return real floating-point residuals, got dtype int64",
        ),
        (
            lambda x: x * 1.0,
            torch.zeros(2, dtype=F64),
            {"jac": lambda x: None},
            ValueError,
            r"jac returned None; expected an \(m, n\) array",
        ),
        (
            lambda x: x * 1.0,
            torch.zeros(2, dtype=F64),
            {"jac": lambda x: torch.ones(3, 2)},
            ValueError,
            r"jac returned shape \(3, 2\); expected \(m, n\) = \(2, 2\)",
        ),
        (
            torch.sqrt,
            torch.tensor([0.0, 1.0], dtype=F64),
            {},
            ValueError,
            r"The Jacobian \(jac\) is not finite at x0; cannot take a step\.",
        ),
    ],
)
def test_bad_calls_are_refused_with_a_message(
    fun: Any, x0: Any, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        so.least_squares(fun, x0, **options)


@pytest.mark.parametrize(("scheme", "per_column"), [("2-point", 1), ("3-point", 2)])
def test_finite_differences_reuse_the_known_residuals(scheme: str, per_column: int) -> None:
    calls = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.clone())
        return _fun(x)

    x = torch.tensor([1.5, 0.7], dtype=F64)
    J = finite_difference(counted, scheme)(x, _fun(x))
    assert len(calls) == per_column * x.numel()
    assert not any(torch.equal(c, x) for c in calls)
    torch.testing.assert_close(J, finite_difference(_fun, scheme)(x), rtol=0, atol=0)
