"""A NumPy fit of a few parameters kept in arrays, LAPACK without its wrappers.

* :class:`~secondorder.fitting.host.HostQRSolver` factors a host system with NumPy's
  LAPACK gufuncs called directly: its steps and search norms are bitwise those of
  ``QRSolver(host=True)`` (``np.linalg.qr``/``svd``/``solve``), which the small-problem
  tests compare with the torch QR solver; anything else falls back to that solver.
* :meth:`~secondorder.fitting.differences.NumpyDifference.of_arrays` is bitwise the
  tensor call's J; :func:`~secondorder.fitting.functions.numpy_residuals` with
  ``owned=True`` never returns the user's own buffer.
* ``least_squares`` on a NumPy ``fun`` through the array path gives bitwise the run
  through the tensor adapters (same x, cost, nfev), and matches scipy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import scipy.optimize
import torch

import secondorder as so
from secondorder.fitting import host as host_module
from secondorder.fitting.bounds import BoxTransform, parse_bounds
from secondorder.fitting.differences import NumpyDifference, finite_difference
from secondorder.fitting.functions import CallCounter, numpy_residuals
from secondorder.fitting.host import HostQRSolver, has_lapack_gufuncs
from secondorder.fitting.problem import FunctionProblem
from secondorder.lm.linalg import HostArrays, NormalEquations, QRSolver

F64 = torch.float64


def _host_system(J: torch.Tensor, r: torch.Tensor) -> NormalEquations:
    """A system as FunctionProblem forms it on the host: tensors plus their arrays."""
    j, rn = J.numpy(), r.numpy()
    loss = float(np.vdot(rn, rn))
    grad, col_sq = j.T.dot(rn), (j * j).sum(0)
    return NormalEquations(
        loss_sum=torch.tensor(loss, dtype=F64),
        count=rn.size,
        grad=torch.from_numpy(grad),
        col_sq=torch.from_numpy(col_sq),
        jac=J,
        residuals=r,
        host=HostArrays(loss=loss, grad=grad, col_sq=col_sq, jac=j, residuals=rn),
    )


def _case(m: int, n: int, spread: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    g = torch.Generator().manual_seed(seed)
    J = torch.randn(m, n, generator=g, dtype=F64)
    if spread:  # columns 1e-6 .. 1e6 apart, as on NIST's Bennett5 or MGH10
        J = J * torch.logspace(-6, 6, n, dtype=F64)
    r = torch.randn(m, generator=g, dtype=F64)
    d = (J * J).sum(0) * torch.rand(n, generator=g, dtype=F64).add(0.5)
    return J, r, d


def _steps(fact: Any, w: torch.Tensor) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for lam in (0.0, 1e-10, 1e-3, 1.0, 1e4):
        step = fact.solve_scaled(lam, w)
        out.append((lam, None if step is None else (step[0].numpy().tobytes(), step[1])))
        out.append((lam, fact.scaled_norm(lam, w)))
    return out


@pytest.mark.parametrize(("m", "n"), [(2, 2), (14, 2), (40, 7), (250, 9), (16, 16)])
@pytest.mark.parametrize("spread", [False, True])
def test_lean_factorisation_is_bitwise_the_wrapped_one(m: int, n: int, spread: bool) -> None:
    assert has_lapack_gufuncs()
    J, r, d = _case(m, n, spread, seed=m * 31 + n)
    system = _host_system(J, r)
    assert system.scalars()[0]  # read first, as the engine does
    lean = HostQRSolver().factor(system, d)
    wrapped = QRSolver(host=True).factor(system, d)
    assert type(lean).__name__ == "_LeanHostSVD" and lean.on_host
    assert np.array_equal(lean.sqrt_d, wrapped.sqrt_d)  # type: ignore[attr-defined]
    # Each factorisation's -r is the engine's w for it (recognised by identity).
    assert lean.w is not None and wrapped.w is not None  # type: ignore[attr-defined]
    assert torch.equal(lean.w, wrapped.w)  # type: ignore[attr-defined]
    assert _steps(lean, lean.w) == _steps(wrapped, wrapped.w)  # type: ignore[attr-defined]
    # Another w (geodesic acceleration's) forms Q0: the same steps again.
    other = torch.randn(m, generator=torch.Generator().manual_seed(1), dtype=F64)
    assert _steps(lean, other) == _steps(wrapped, other)


def test_a_singular_r0_takes_the_svd_step_at_zero_damping_as_the_wrapped_one() -> None:
    J, r, d = _case(12, 3, False, seed=4)
    J[:, 2] = J[:, 0]  # rank 2: R0's last diagonal entry is rounding, not zero
    J[:, 1] = 0.0  # an exact zero column: R0 singular
    system = _host_system(J, r)
    system.scalars()
    d = torch.where(d > 0, d, torch.ones_like(d))
    lean, wrapped = HostQRSolver().factor(system, d), QRSolver(host=True).factor(system, d)
    assert _steps(lean, -r) == _steps(wrapped, -r)


def test_lean_factorisation_falls_back_to_the_wrapped_solver() -> None:
    # Fewer residuals than parameters, or a system without host arrays: QRSolver(host=True).
    J, r, d = _case(3, 5, False, seed=2)
    wide = HostQRSolver().factor(_host_system(J, r), d)
    assert type(wide).__name__ == "HostSVD"
    J, r, d = _case(20, 3, False, seed=3)
    plain = NormalEquations(
        loss_sum=r @ r, count=20, grad=J.T @ r, col_sq=(J * J).sum(0), jac=J, residuals=r
    )
    assert type(HostQRSolver().factor(plain, d)).__name__ == "HostSVD"


def test_without_the_gufuncs_the_wrapped_factorisation_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    J, r, d = _case(30, 4, True, seed=8)
    system = _host_system(J, r)
    system.scalars()
    lean = HostQRSolver().factor(system, d)
    monkeypatch.setattr(host_module, "_LAPACK", None)
    assert not has_lapack_gufuncs()
    fallback = HostQRSolver().factor(system, d)
    assert type(fallback).__name__ == "HostSVD"
    assert _steps(lean, -r) == _steps(fallback, -r)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_lean_factorisation_of_non_finite_numbers_fails_like_a_qr(bad: float) -> None:
    J, r, d = _case(10, 3, False, seed=6)
    r[4] = bad
    system = _host_system(J, r)
    assert not system.scalars()[0]
    with pytest.raises(torch.linalg.LinAlgError, match="not finite"):
        HostQRSolver().factor(system, d)
    J, r, d = _case(10, 3, False, seed=6)
    d[1] = 0.0  # D^-½ infinite: R0 D^-½ is not finite
    system = _host_system(J, r)
    system.scalars()
    with pytest.raises(torch.linalg.LinAlgError, match=r"R0 D\^-1/2 is not finite"):
        HostQRSolver().factor(system, d)


def _exp_fun(x: np.ndarray) -> np.ndarray:
    t = np.linspace(0.0, 4.0, 25)
    return x[0] * np.exp(-x[1] * t) + x[2] - (2.0 * np.exp(-0.7 * t) + 0.3)


@pytest.mark.parametrize("scheme", ["2-point", "3-point"])
@pytest.mark.parametrize("minpack", [False, True])
def test_difference_on_arrays_is_bitwise_the_tensor_call(scheme: str, minpack: bool) -> None:
    counter = CallCounter(_exp_fun)
    host = numpy_residuals(counter, (), {})
    jac = finite_difference(
        lambda x: torch.from_numpy(host(x.numpy())), scheme, numpy_fun=host, minpack=minpack
    )
    assert isinstance(jac, NumpyDifference)
    x = np.array([1.5, -0.0, 0.2])  # a -0.0 stays -0.0 in the perturbed points
    f0 = _exp_fun(x)
    tensor = jac(torch.from_numpy(x), torch.from_numpy(f0)).numpy()
    arrays = jac.of_arrays(x, f0)
    assert arrays.tobytes() == tensor.tobytes()
    # The torch path (no NumPy fun) is the same J to the last bit as well.
    plain = finite_difference(lambda t: torch.from_numpy(_exp_fun(t.numpy())), scheme)
    if not minpack:
        assert plain(torch.from_numpy(x), torch.from_numpy(f0)).numpy().tobytes() == (
            arrays.tobytes()
        )


def test_owned_residuals_never_alias_the_users_buffer() -> None:
    buffer = np.zeros(4)

    def fun(x: np.ndarray) -> np.ndarray:
        buffer[:] = x.sum()
        return buffer

    counter = CallCounter(fun)
    borrowed, owned = numpy_residuals(counter, (), {}), numpy_residuals(counter, (), {}, owned=True)
    assert borrowed(np.ones(2)) is buffer
    kept = owned(np.ones(2))
    assert kept is not buffer and np.array_equal(kept, [2.0] * 4)
    owned(np.zeros(2))
    assert np.array_equal(kept, [2.0] * 4) and counter.calls == 3


def _bounded_identity(differentiable: bool) -> FunctionProblem:
    """``f(x) = x`` on the unit box: a problem whose variables are transformed."""
    bounds = BoxTransform(*parse_bounds(([0.0, 0.0], [1.0, 1.0]), 2))
    return FunctionProblem(
        lambda x: x,
        lambda x, f0=None: torch.eye(2, dtype=F64),
        bounds,
        "linear",
        1.0,
        need_gram=False,
        differentiable=differentiable,
        takes_residuals=True,
    )


def test_the_array_path_refuses_bounds() -> None:
    problem = _bounded_identity(differentiable=False)
    with pytest.raises(ValueError, match="host path takes no bounds or x_scale"):
        problem.on_host(np.asarray, None)


def _thurber(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
    num = x[0] + x[1] * t + x[2] * t**2 + x[3] * t**3
    return num / (1.0 + x[4] * t + x[5] * t**2 + x[6] * t**3) - y


@pytest.mark.parametrize("method", ["lm", "trf"])
def test_least_squares_through_arrays_is_bitwise_the_adapter_run(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = np.linspace(-3.0, 2.0, 40)
    truth = np.array([1288.0, 1491.0, 583.0, 75.4, 0.97, 0.40, 0.050])
    y = _thurber(truth, t, np.zeros_like(t)) + 0.5 * np.sin(7.0 * t)
    x0 = np.array([1000.0, 1000.0, 400.0, 40.0, 0.7, 0.3, 0.03])
    kw = {"args": (t, y), "method": method, "ftol": 1e-12, "xtol": 1e-12, "gtol": 1e-12}
    fast = so.least_squares(_thurber, x0, **kw)
    monkeypatch.setattr(FunctionProblem, "on_host", lambda self, fun, jac: None)
    slow = so.least_squares(_thurber, x0, **kw)
    assert fast.x.tobytes() == slow.x.tobytes() and fast.cost == slow.cost
    assert (fast.nfev, fast.njev, fast.nit) == (slow.nfev, slow.njev, slow.nit)
    assert fast.jac.tobytes() == slow.jac.tobytes()
    ref = scipy.optimize.least_squares(_thurber, x0, **kw)
    assert fast.cost == pytest.approx(ref.cost, rel=1e-8)
    np.testing.assert_allclose(fast.x, ref.x, rtol=1e-5)


def test_a_point_modified_in_place_after_its_evaluation_is_evaluated_again() -> None:
    # The problem keeps the points it evaluated without copying them: a point changed in
    # place since must not be answered with the residuals of its old values.
    calls: list[np.ndarray] = []

    def fun(x: np.ndarray) -> np.ndarray:
        calls.append(x.copy())
        return np.array([x[0] - 1.0, 2.0 * x[1], x[0] * x[1]])

    counter = CallCounter(fun)
    problem = FunctionProblem(
        lambda t: torch.from_numpy(fun(t.numpy())),
        lambda t, f0=None: torch.zeros(3, 2, dtype=F64),
        BoxTransform(*parse_bounds(None, 2)),
        "linear",
        1.0,
        need_gram=False,
        differentiable=False,
        counter=counter,
    )
    problem.on_host(numpy_residuals(counter, (), {}, owned=True), None)
    y = torch.tensor([3.0, 4.0], dtype=F64)
    first = problem.residuals(y)
    assert problem.residuals(y) is first and len(calls) == 1  # the same point: free
    assert problem.residuals(y.clone()) is first and len(calls) == 1  # equal values: free
    y[1] = 5.0
    again = problem.residuals(y)
    assert len(calls) == 2 and np.array_equal(again.numpy(), fun(np.array([3.0, 5.0])))
    assert np.array_equal(first.numpy(), [2.0, 8.0, 12.0])  # the old residuals untouched
    # The base (the linearisation point) likewise.
    problem.linearize(y, again)
    assert problem.base is not None and problem.jacobian(y, again) is problem.base[2]
    y[0] = 0.5
    problem.residuals(y)
    assert problem.njev == 1
    problem.jacobian(y, problem.residuals(y))
    assert problem.njev == 2


@pytest.mark.parametrize("seed", range(4))
def test_more_floor_at_the_smallest_damping_equals_the_array_expression(seed: int) -> None:
    # At λ = damping_min only unusable columns (zero, subnormal, not finite) are floored;
    # the fast path for a D whose columns are all usable must give the same D.
    from secondorder.lm.damping import DampingState, MoreMatrix

    rng = np.random.default_rng(seed)
    matrix, state = MoreMatrix(), DampingState(damping=0.0)
    tiny = float(np.finfo(np.float64).tiny)
    specials = [0.0, tiny / 4, tiny, math.inf, math.nan, 1e308]
    for _ in range(200):
        d = np.abs(rng.standard_normal(int(rng.integers(1, 10)))) * 10.0 ** rng.integers(-300, 300)
        if rng.random() < 0.5:
            d[rng.integers(d.size)] = specials[int(rng.integers(len(specials)))]
        got = matrix._floored_host(d, state, 0.0)
        usable = np.isfinite(d) & (d >= tiny)
        largest = float(np.where(usable, d, 0.0).max())
        ref = (
            np.where(usable, d, max(largest * matrix.floor, tiny))
            if largest > 0
            else np.ones(d.size)
        )
        assert got.tobytes() == ref.tobytes(), d
        assert got is not d


def _torch_decay(x: torch.Tensor) -> torch.Tensor:
    t = torch.linspace(0.0, 4.0, 30, dtype=F64)
    return x[0] * torch.exp(-x[1] * t) + x[2] * t - torch.cos(t)


def _fused_problem(fun: Any, m: int, n: int) -> tuple[FunctionProblem, CallCounter]:
    from secondorder.fitting.functions import jacobian_function, residual_function

    counter = CallCounter(fun)
    residuals = residual_function(counter, (), {}, numpy_fun=False)
    jac = jacobian_function(
        "rev", residuals, numpy_fun=False, shape=(m, n), args=(), kwargs={}, counter=counter
    )
    problem = FunctionProblem(
        residuals,
        jac,
        BoxTransform(*parse_bounds(None, n)),
        "linear",
        1.0,
        need_gram=False,
        differentiable=True,
        counter=counter,
        takes_residuals=True,
    )
    problem.fuse(fun, m)
    return problem, counter


def test_a_fused_evaluation_gives_jacrevs_jacobian_without_calling_fun() -> None:
    problem, counter = _fused_problem(_torch_decay, 30, 3)
    y = torch.tensor([2.0, 0.7, -0.1], dtype=F64)
    f = problem.residuals(y)
    assert torch.equal(f, _torch_decay(y)) and counter.calls == 1
    J = problem.jacobian(y, f)
    assert counter.calls == 1 and problem.njev == 1 and problem.nfev == 1
    assert torch.equal(J, torch.func.jacrev(_torch_decay)(y))
    # The pullback serves its own point once: another point, or this one modified in
    # place, is differentiated by the transform (one call of fun inside it).
    z = torch.tensor([1.0, 0.3, 0.2], dtype=F64)
    fz = problem.residuals(z)
    z[0] = 1.5
    Jz = problem.jacobian(z, _torch_decay(z))
    assert torch.equal(Jz, torch.func.jacrev(_torch_decay)(z))
    assert counter.calls == 3 and counter.jacobian_calls == 1 and problem.nfev == 2
    assert not torch.equal(fz, _torch_decay(z))  # the residuals kept are those of z then


def test_a_fused_evaluation_that_torch_func_refuses_takes_the_plain_call() -> None:
    def numpy_inside(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(x.detach().numpy() ** 2 - 1.0))

    problem, counter = _fused_problem(numpy_inside, 3, 3)
    y = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    f = problem.residuals(y)  # vjp refuses the NumPy round trip: the adapter's call
    assert torch.equal(f, torch.tensor([0.0, 3.0, 8.0], dtype=F64))
    assert counter.calls == 2 and problem._pullback is None


def test_fused_evaluations_refuse_bounds() -> None:
    problem = _bounded_identity(differentiable=True)
    with pytest.raises(ValueError, match="fused evaluations take no bounds or x_scale"):
        problem.fuse(lambda x: x, 2)
