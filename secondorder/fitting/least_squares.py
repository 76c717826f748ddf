"""Functional nonlinear least squares with scipy.optimize.least_squares's interface.

:func:`least_squares` minimises ``½ Σ ρ(fᵢ(x)²)`` over a 1-D parameter vector with
the same Levenberg-Marquardt engine as the model optimizer, in float64, with the
Jacobian from automatic differentiation (or a callable, or finite differences for
functions written with NumPy).  Its result object has scipy's fields and meanings, so
porting a fit is a change of import.

Robust losses follow scipy's definitions and enter the Gauss-Newton model through
Triggs' correction: with ``z = (f/f_scale)²`` each residual and row of J is rescaled
so that the model's gradient is the loss's exact gradient and its curvature keeps the
loss's second-order term where that is positive.

Box bounds are handled by a change of variables (as in MINUIT and lmfit):
``x = lb + (ub - lb)(sin y + 1)/2`` for two-sided bounds, ``x = lb - 1 + sqrt(y² + 1)``
for a lower bound and ``x = ub + 1 - sqrt(y² + 1)`` for an upper one.  The unbounded
problem in ``y`` is solved, so every iterate is feasible and a solution on a bound is
reached exactly; the reported ``jac``, ``grad`` and ``optimality`` are those of ``x``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import jacfwd, jacrev

from .._validation import check_choice, check_integer, check_number
from ..lm.damping import (
    DAMPING_MATRICES,
    DAMPING_RULES,
    DampingState,
    make_damping_matrix,
    make_damping_rule,
)
from ..lm.engine import EngineConfig, iterate
from ..lm.linalg import NormalEquations, make_solver

__all__ = ["LOSSES", "OptimizeResult", "least_squares"]

LOSSES = ("linear", "soft_l1", "huber", "cauchy", "arctan")
JACS = ("auto", "fwd", "rev", "2-point", "3-point")

MESSAGES = {
    -1: "Improper input parameters status returned from the solver.",
    0: "The maximum number of function evaluations is exceeded.",
    1: "`gtol` termination condition is satisfied.",
    2: "`ftol` termination condition is satisfied.",
    3: "`xtol` termination condition is satisfied.",
    4: "Both `ftol` and `xtol` termination conditions are satisfied.",
}


@dataclass
class OptimizeResult:
    """The result of :func:`least_squares`, with scipy's field names and meanings.

    Attributes:
        x: the solution (a tensor, or a NumPy array when ``x0`` was one).
        cost: ``½ Σ ρ(f²)`` at the solution (``½‖f‖²`` for the linear loss).
        fun: residuals at the solution.
        jac: Jacobian of the residuals at the solution (unscaled by the loss).
        grad: gradient of the cost, ``Jᵀ(ρ'·f)``.
        optimality: first-order optimality, ``‖grad‖∞`` (scaled by the distance to
            active bounds as scipy's "trf" does, when bounds are given).
        active_mask: -1/0/1 for a lower bound active, none, upper bound active.
        nfev: residual evaluations (finite-difference evaluations are not counted).
        njev: Jacobian evaluations.
        status: 0 max_nfev reached, 1 gtol, 2 ftol, 3 xtol, 4 ftol and xtol.
        message: a sentence for ``status``.
        success: ``status > 0``.
        damping: λ at the end (specific to secondorder).
        reason: the engine's account of how the last iteration ended.
    """

    x: Any
    cost: float
    fun: Any
    jac: Any
    grad: Any
    optimality: float
    active_mask: Any
    nfev: int
    njev: int
    status: int
    message: str
    success: bool
    damping: float = 0.0
    reason: str = ""
    history: list[float] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


# ---------------------------------------------------------------------------------------
# Robust losses: rho(z), rho'(z), rho''(z) for z = (f / f_scale)²


def _rho(loss: str, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if loss == "linear":
        return z, torch.ones_like(z), torch.zeros_like(z)
    if loss == "soft_l1":
        t = 1 + z
        return 2 * (t.sqrt() - 1), t.rsqrt(), -0.5 * t ** (-1.5)
    if loss == "huber":
        inner = z <= 1
        zs = torch.where(inner, torch.ones_like(z), z)
        return (
            torch.where(inner, z, 2 * zs.sqrt() - 1),
            torch.where(inner, torch.ones_like(z), zs.rsqrt()),
            torch.where(inner, torch.zeros_like(z), -0.5 * zs ** (-1.5)),
        )
    if loss == "cauchy":
        t = 1 + z
        return torch.log1p(z), 1 / t, -1 / t**2
    if loss == "arctan":
        t = 1 + z * z
        return torch.arctan(z), 1 / t, -2 * z / t**2
    raise ValueError(f"Unknown loss={loss!r}; valid choices are {LOSSES}.")


# ---------------------------------------------------------------------------------------
# Bounds as a change of variables


class _Bounds:
    def __init__(self, lb: Tensor, ub: Tensor) -> None:
        self.lb, self.ub = lb, ub
        self.lo = torch.isfinite(lb)
        self.hi = torch.isfinite(ub)
        self.both = self.lo & self.hi
        self.any = bool((self.lo | self.hi).any())

    def to_x(self, y: Tensor) -> Tensor:
        if not self.any:
            return y
        lb = torch.where(self.lo, self.lb, torch.zeros_like(self.lb))
        ub = torch.where(self.hi, self.ub, torch.zeros_like(self.ub))
        root = torch.sqrt(y * y + 1)
        two = lb + (ub - lb) * (torch.sin(y) + 1) / 2
        low = lb - 1 + root
        high = ub + 1 - root
        return torch.where(self.both, two, torch.where(self.lo, low, torch.where(self.hi, high, y)))

    def to_y(self, x: Tensor) -> Tensor:
        if not self.any:
            return x
        lb = torch.where(self.lo, self.lb, torch.zeros_like(self.lb))
        ub = torch.where(self.hi, self.ub, torch.zeros_like(self.ub))
        width = torch.where(self.both, ub - lb, torch.ones_like(ub))
        two = torch.arcsin(torch.clamp(2 * (x - lb) / width - 1, -1.0, 1.0))
        low = torch.sqrt(torch.clamp((x - lb + 1) ** 2 - 1, min=0.0))
        high = torch.sqrt(torch.clamp((ub - x + 1) ** 2 - 1, min=0.0))
        return torch.where(self.both, two, torch.where(self.lo, low, torch.where(self.hi, high, x)))

    def derivatives(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(x'(y), x''(y))`` elementwise (ones and zeros where x is unbounded)."""
        width = torch.where(self.both, self.ub - self.lb, torch.zeros_like(self.ub))
        root = torch.sqrt(y * y + 1)
        one, zero = torch.ones_like(y), torch.zeros_like(y)
        d1 = torch.where(
            self.both,
            width * torch.cos(y) / 2,
            torch.where(self.lo, y / root, torch.where(self.hi, -y / root, one)),
        )
        d2 = torch.where(
            self.both,
            -width * torch.sin(y) / 2,
            torch.where(self.lo, root**-3, torch.where(self.hi, -(root**-3), zero)),
        )
        return d1, d2

    def strictly_feasible(self, x: Tensor) -> Tensor:
        """Move points on a bound slightly inside, where the change of variables has slope."""
        step = 1e-10 * torch.clamp(x.abs(), min=1.0)
        x = torch.where(self.lo & (x <= self.lb), self.lb + step, x)
        x = torch.where(self.hi & (x >= self.ub), self.ub - step, x)
        return torch.where(self.both & (self.ub - self.lb <= 2 * step), (self.lb + self.ub) / 2, x)

    def active(self, x: Tensor, tol: float = 1e-10) -> Tensor:
        scale = tol * torch.clamp(x.abs(), min=1.0)
        mask = torch.zeros_like(x, dtype=torch.int64)
        mask = torch.where(self.lo & (x - self.lb <= scale), -1, mask)
        return torch.where(self.hi & (self.ub - x <= scale), 1, mask)

    def cl_scale(self, x: Tensor, g: Tensor) -> Tensor:
        """Coleman-Li scaling, as scipy's "trf" reports optimality under bounds."""
        v = torch.ones_like(x)
        v = torch.where((g < 0) & self.hi, self.ub - x, v)
        return torch.where((g > 0) & self.lo, x - self.lb, v)


# ---------------------------------------------------------------------------------------
# The problem in y for the engine


class _FunctionProblem:
    def __init__(
        self,
        fun: Callable[[Tensor], Tensor],
        jac: Callable[[Tensor], Tensor],
        bounds: _Bounds,
        loss: str,
        f_scale: float,
        *,
        need_gram: bool,
        differentiable: bool,
    ) -> None:
        self.fun = fun
        self.need_gram = need_gram
        self.differentiable = differentiable
        self.jac = jac
        self.bounds = bounds
        self.loss = loss
        self.f_scale = f_scale
        self.nfev = 0
        self.njev = 0
        #: The last point evaluated and its residuals, so an accepted trial is not redone.
        self.last: tuple[Tensor, Tensor] | None = None
        #: Triggs' row scaling of the last linearisation (robust losses), else None.
        self.row_scale: Tensor | None = None
        #: Rows appended to J for the curvature of the bounds' change of variables.
        self.extra_rows = 0

    def _cost2(self, f: Tensor) -> Tensor:
        """``2·cost = f_scale² Σ ρ((f/f_scale)²)``."""
        if self.loss == "linear":
            return torch.dot(f, f)
        z = (f / self.f_scale) ** 2
        return self.f_scale**2 * _rho(self.loss, z)[0].sum()

    def residuals(self, y: Tensor) -> Tensor:
        if self.last is not None and torch.equal(self.last[0], y):
            return self.last[1]
        self.nfev += 1
        # Values only: a fun closing over tensors that require grad must not drag a
        # graph along (autograd is used inside the Jacobian transforms alone).
        f = self.fun(self.bounds.to_x(y)).detach()
        self.last = (y.clone(), f)
        return f

    def loss_sum(self, y: Tensor) -> Tensor:
        f = self.residuals(y)
        return self._cost2(f) if bool(torch.isfinite(f).all()) else torch.tensor(math.inf)

    def linearize(self, y: Tensor, f: Tensor) -> NormalEquations:
        self.njev += 1
        J = self.jac(self.bounds.to_x(y)).detach()
        r, Js = f, J
        self.row_scale = None
        if self.loss != "linear":
            z = (f / self.f_scale) ** 2
            _, rho1, rho2 = _rho(self.loss, z)
            scale = torch.clamp(rho1 + 2 * rho2 * z, min=torch.finfo(f.dtype).eps).sqrt()
            r = f * rho1 / scale
            Js = J * scale[:, None]
            self.row_scale = scale
        scale_sq = None if Js is J else (J * J).sum(0)
        self.extra_rows = 0
        if self.bounds.any:
            # Chain rule through x(y), column by column.  Gauss-Newton would drop the
            # transform's own curvature g_x·x''(y), but at an active bound that term is
            # all the curvature there is (J's column vanishes with x'(y)), and without it
            # every step towards the bound overshoots.  Where it is positive it enters
            # the model as an extra row sqrt(g_x·x'')·eᵢ with residual 0, which adds it
            # to diag(JᵀJ) and leaves the gradient Jᵀr unchanged.
            d1, d2 = self.bounds.derivatives(y)
            curv = torch.clamp((Js.T @ r) * d2, min=0.0)
            J, Js = J * d1, Js * d1
            scale_sq = None if scale_sq is None else (J * J).sum(0)
            rows = torch.nonzero(curv > 0).flatten()
            if rows.numel() > 0:
                extra = torch.zeros(rows.numel(), Js.shape[1], dtype=Js.dtype)
                extra[torch.arange(rows.numel()), rows] = curv[rows].sqrt()
                Js = torch.cat([Js, extra])
                r = torch.cat([r, torch.zeros(rows.numel(), dtype=r.dtype)])
                self.extra_rows = rows.numel()
                if scale_sq is not None:
                    scale_sq = scale_sq + curv
        return NormalEquations(
            loss_sum=self._cost2(f),
            count=f.numel(),
            grad=Js.T @ r,
            col_sq=(Js * Js).sum(0),
            gram=Js.T @ Js if self.need_gram else None,
            jac=Js,
            residuals=r,
            scale_sq=scale_sq,
        )

    def second_directional(
        self, y: Tensor, v: Tensor, system: NormalEquations
    ) -> tuple[Tensor, Tensor | None]:
        def f(t: Tensor) -> Tensor:
            return self.fun(self.bounds.to_x(t))

        assert system.jac is not None
        if self.differentiable:

            def jv(t: Tensor) -> Tensor:
                out: Tensor = torch.func.jvp(f, (t,), (v,))[1]
                return out

            rvv = torch.func.jvp(jv, (y,), (v,))[1].detach()
        else:
            # A NumPy residual cannot be differentiated twice: take the second
            # directional derivative by a central difference along v, with the step
            # that balances truncation (O(h²)) against roundoff (O(eps/h²)).
            vnorm = float(torch.linalg.vector_norm(v))
            if vnorm == 0.0:
                return torch.zeros_like(system.grad), torch.zeros_like(system.jac[:, 0])
            h = torch.finfo(y.dtype).eps ** 0.25 * max(1.0, float(torch.linalg.vector_norm(y)))
            t = h / vnorm
            rvv = ((f(y + t * v) - 2.0 * f(y) + f(y - t * v)) / (t * t)).detach()
        if self.row_scale is not None:
            # The rows of J were rescaled for the robust loss; rescale r_vv alike.
            rvv = rvv * self.row_scale
        if self.extra_rows:
            rvv = torch.cat([rvv, torch.zeros(self.extra_rows, dtype=rvv.dtype)])
        return system.jac.T @ rvv, rvv


# ---------------------------------------------------------------------------------------
# Input handling


def _finite_difference(fun: Callable[[Tensor], Tensor], scheme: str) -> Callable[[Tensor], Tensor]:
    eps = torch.finfo(torch.float64).eps

    def jac(x: Tensor) -> Tensor:
        f0 = fun(x)
        cols = []
        for i in range(x.numel()):
            if scheme == "2-point":
                h = math.sqrt(eps) * max(1.0, abs(float(x[i])))
                e = torch.zeros_like(x)
                e[i] = h
                cols.append((fun(x + e) - f0) / h)
            else:
                h = eps ** (1 / 3) * max(1.0, abs(float(x[i])))
                e = torch.zeros_like(x)
                e[i] = h
                cols.append((fun(x + e) - fun(x - e)) / (2 * h))
        return torch.stack(cols, dim=1)

    return jac


def _as_bounds(bounds: Any, n: int) -> tuple[Tensor, Tensor]:
    if bounds is None:
        bounds = (-math.inf, math.inf)
    if hasattr(bounds, "lb") and hasattr(bounds, "ub"):  # scipy.optimize.Bounds
        bounds = (bounds.lb, bounds.ub)
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"bounds must be a pair (lb, ub), got {bounds!r}")
    out = []
    for name, b in zip(("lb", "ub"), bounds, strict=True):
        try:
            t = torch.as_tensor(np.asarray(b, dtype=np.float64), dtype=torch.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bounds {name} must be numbers, got {b!r}") from exc
        if t.ndim == 0:
            t = t.expand(n).clone()
        if t.shape != (n,):
            raise ValueError(
                f"bounds {name} must be a scalar or have shape ({n},), got {tuple(t.shape)}"
            )
        if bool(torch.isnan(t).any()):
            raise ValueError(f"bounds {name} contains NaN: {t.tolist()}")
        out.append(t)
    lb, ub = out
    bad = lb >= ub
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"Each lower bound must be strictly less than each upper bound: "
            f"lb[{i}]={float(lb[i])!r} >= ub[{i}]={float(ub[i])!r}"
        )
    return lb, ub


def _finite_system(system: NormalEquations) -> bool:
    """Whether the linearisation holds finite numbers only (J, Jᵀr, column norms)."""
    parts = [system.grad, system.col_sq] + ([system.jac] if system.jac is not None else [])
    return all(bool(torch.isfinite(t).all()) for t in parts)


def least_squares(
    fun: Callable[..., Any],
    x0: Any,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    jac: str | Callable[..., Any] = "auto",
    loss: str = "linear",
    f_scale: float = 1.0,
    bounds: Any = None,
    ftol: float = 1e-8,
    xtol: float = 1e-8,
    gtol: float = 1e-8,
    max_nfev: int | None = None,
    damping: float = 1e-3,
    damping_rule: str = "nielsen",
    damping_matrix: str = "more",
    solver: str = "qr",
    geodesic: bool = False,
) -> OptimizeResult:
    """Solve ``min_x ½ Σ ρ(fᵢ(x)²)`` by Levenberg-Marquardt, with scipy's interface.

    Args:
        fun: ``fun(x, *args, **kwargs)`` returning the residuals (any shape,
            flattened) for a 1-D float64 ``x``.  Written with torch operations it is
            differentiated exactly; written with NumPy (``x0`` a NumPy array and
            ``fun`` returning one) its Jacobian comes from finite differences or
            from ``jac``.
        x0: starting point, 1-D and finite (tensor, array or sequence).
        jac: ``"auto"`` (forward mode when residuals outnumber parameters, else
            reverse), ``"fwd"``, ``"rev"``, ``"2-point"``, ``"3-point"``, or a
            callable ``jac(x, *args, **kwargs) -> (m, n)``.
        loss: ``"linear"``, ``"soft_l1"``, ``"huber"``, ``"cauchy"``, ``"arctan"``
            with scipy's definitions, applied to ``(f / f_scale)²``.
        f_scale: soft margin between inlier and outlier residuals.
        bounds: ``(lb, ub)`` scalars or arrays (``±inf`` for none), or a
            ``scipy.optimize.Bounds``; ``lb < ub`` elementwise, ``x0`` within.
        ftol: scipy's tolerance on the relative reduction of the cost.
        xtol: scipy's tolerance on the relative step.
        gtol: scipy's tolerance on the cosine between residuals and columns of J
            (MINPACK's measure).
        max_nfev: evaluations allowed (default ``100·n``).
        damping: initial λ.
        damping_rule: ``"nielsen"`` or ``"multiplicative"``.
        damping_matrix: ``"more"``, ``"marquardt"`` or ``"identity"``.
        solver: ``"qr"``, ``"cholesky"``, ``"eigh"`` or ``"cg"``.
        geodesic: add geodesic acceleration.  The defaults of these LM parts
            mirror MINPACK (Moré's scaling and a QR of J).

        args: extra positional arguments of ``fun`` (and of a callable ``jac``).
        kwargs: extra keyword arguments of ``fun`` (and of a callable ``jac``).

    Returns:
        An :class:`OptimizeResult` with scipy's fields.
    """
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments of fun, got {args!r}")
    if not isinstance(geodesic, bool):
        raise TypeError(f"geodesic must be a bool, got {geodesic!r}")
    kwargs = dict(kwargs or {})
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}")
    if (isinstance(x0, Tensor) and x0.is_complex()) or (
        not isinstance(x0, Tensor) and np.iscomplexobj(x0)
    ):
        raise ValueError(f"x0 must be real, got a complex array {x0!r}")
    if isinstance(x0, Tensor) and x0.device.type != "cpu":
        raise ValueError(
            f"x0 is on device {x0.device}; least_squares runs on the CPU: pass x0.cpu()"
        )
    numpy_in = not isinstance(x0, Tensor)
    try:
        x_start = torch.as_tensor(np.asarray(x0, dtype=np.float64)) if numpy_in else x0
    except (TypeError, ValueError) as exc:
        raise TypeError(f"x0 must be a 1-D array of numbers, got {x0!r}") from exc
    if not x_start.is_floating_point():
        x_start = x_start.to(torch.float64)
    x_start = x_start.detach().to(torch.float64).clone()
    if x_start.ndim != 1 or x_start.numel() == 0:
        raise ValueError(f"x0 must be a non-empty 1-D array, got shape {tuple(x_start.shape)}")
    if not bool(torch.isfinite(x_start).all()):
        raise ValueError(f"x0 must be finite, got {x_start.tolist()}")
    n = x_start.numel()
    if not callable(jac):
        check_choice("jac", jac, JACS, extra=" or a callable")
    check_choice("loss", loss, LOSSES)
    check_number("f_scale", f_scale, above=0, type_error=False)
    for name, tol in (("ftol", ftol), ("xtol", xtol), ("gtol", gtol)):
        check_number(name, tol, at_least=0, type_error=False)
    check_integer("max_nfev", max_nfev, allow_none=True)
    check_choice("damping_rule", damping_rule, DAMPING_RULES)
    check_choice("damping_matrix", damping_matrix, DAMPING_MATRICES)
    check_choice("solver", solver, ("cholesky", "eigh", "qr", "cg"))
    check_number("damping", damping, at_least=0, type_error=False)
    lb, ub = _as_bounds(bounds, n)
    if bool(((x_start < lb) | (x_start > ub)).any()):
        raise ValueError(
            f"x0 is infeasible: it lies outside bounds lb={lb.tolist()}, ub={ub.tolist()}"
        )

    # Decide whether fun speaks torch (differentiable) or NumPy: it is called with the
    # kind of array x0 is, and what it returns decides.
    probe = fun(x_start.numpy().copy() if numpy_in else x_start.clone(), *args, **kwargs)
    numpy_fun = not isinstance(probe, Tensor)

    def f_torch(x: Tensor) -> Tensor:
        if numpy_fun:
            raw = np.asarray(fun(x.detach().numpy(), *args, **kwargs))
            if not np.issubdtype(raw.dtype, np.floating):
                raise TypeError(
                    f"fun must return real floating-point residuals, got dtype {raw.dtype}"
                )
            out = raw.astype(np.float64)
            return torch.from_numpy(out.reshape(-1).copy())
        res = fun(x, *args, **kwargs)
        if not isinstance(res, Tensor):
            raise TypeError(f"fun returned {type(res).__name__}, expected a tensor")
        if not res.is_floating_point():
            raise TypeError(f"fun must return real floating-point residuals, got {res.dtype}")
        return res.reshape(-1).to(torch.float64)

    f0 = f_torch(x_start).detach()
    if f0.numel() == 0:
        raise ValueError("fun returned no residuals at x0")
    if not bool(torch.isfinite(f0).all()):
        raise ValueError("Residuals are not finite in the initial point x0.")
    m = f0.numel()

    jac_fn: Callable[[Tensor], Tensor]
    if callable(jac):
        user_jac = jac

        def user_jac_fn(x: Tensor) -> Tensor:
            arg: Any = x.detach().numpy() if numpy_fun else x
            raw = user_jac(arg, *args, **kwargs)
            if raw is None:
                raise ValueError("jac returned None; expected an (m, n) array")
            J = torch.as_tensor(np.asarray(raw, dtype=np.float64) if numpy_fun else raw)
            if tuple(J.shape) != (m, n):
                raise ValueError(
                    f"jac returned shape {tuple(J.shape)}; expected (m, n) = ({m}, {n}) "
                    "(residuals by parameters)"
                )
            return J.to(torch.float64)

        jac_fn = user_jac_fn
    elif numpy_fun or jac in ("2-point", "3-point"):
        jac_fn = _finite_difference(f_torch, "2-point" if jac == "auto" else str(jac))
    else:
        mode = jac if jac != "auto" else ("fwd" if m >= n else "rev")
        jac_fn = jacfwd(f_torch) if mode == "fwd" else jacrev(f_torch)

    bnds = _Bounds(lb, ub)
    x_start = bnds.strictly_feasible(x_start)
    problem = _FunctionProblem(
        f_torch,
        jac_fn,
        bnds,
        loss,
        float(f_scale),
        need_gram=solver in ("cholesky", "eigh"),
        differentiable=not numpy_fun,
    )
    engine = EngineConfig(
        max_attempts=1 << 30,
        min_gain_ratio=1e-4,
        # No floor: near a singular solution (Powell's) JᵀJ shrinks without bound
        # while D keeps its scale, and any fixed floor would cap the step.
        damping_min=0.0,
        damping_max=1e15,
        ftol=ftol,
        xtol=xtol,
        gtol=gtol,
        geodesic=geodesic,
    )
    rule = make_damping_rule(damping_rule)
    matrix = make_damping_matrix(damping_matrix)
    state = DampingState(damping=float(damping))
    lin_solver = make_solver(solver)
    budget = int(max_nfev) if max_nfev is not None else 100 * n

    y = bnds.to_y(x_start)
    f = problem.residuals(y)
    system = problem.linearize(y, f)
    if not _finite_system(system):
        raise ValueError("The Jacobian (jac) is not finite at x0; cannot take a step.")
    status, reason = 0, ""
    history = [0.5 * float(system.loss_sum)]
    while True:
        remaining = budget - problem.nfev
        if remaining <= 0:
            status, reason = 0, "max_nfev reached"
            break
        before = problem.nfev
        out = iterate(
            problem,
            y,
            system,
            solver=lin_solver,
            rule=rule,
            matrix=matrix,
            state=state,
            config=engine,
            max_attempts=remaining,
        )
        reason = out.reason
        if out.accepted:
            y = out.x
            history.append(0.5 * out.loss_sum)
        if out.status > 0:
            status = out.status
            break
        if out.stop and problem.nfev - before < remaining and not out.accepted:
            # λ reached its maximum: steps are as short as the arithmetic allows.
            status = 3
            break
        if out.accepted:
            system = problem.linearize(y, problem.residuals(y))
            if not _finite_system(system):
                # No linear model here: stop without claiming convergence.
                status, reason = -1, "the Jacobian (jac) is not finite at the current point"
                break

    x = bnds.to_x(y).detach()
    f = f_torch(x).detach()
    J = jac_fn(x).detach()
    cost2 = problem._cost2(f)
    rho1 = torch.ones_like(f) if loss == "linear" else _rho(loss, (f / f_scale) ** 2)[1]
    grad = J.T @ (rho1 * f)
    opt_vec = grad * bnds.cl_scale(x, grad) if bnds.any else grad
    optimality = float(opt_vec.abs().max())
    active = bnds.active(x)

    def out_arr(t: Tensor) -> Any:
        return t.numpy() if numpy_in else t

    return OptimizeResult(
        x=out_arr(x),
        cost=0.5 * float(cost2),
        fun=out_arr(f.detach()),
        jac=out_arr(J),
        grad=out_arr(grad.detach()),
        optimality=optimality,
        active_mask=out_arr(active),
        nfev=problem.nfev,
        njev=problem.njev,
        status=status,
        message=reason if status == -1 else MESSAGES[status],
        success=status > 0,
        damping=state.damping,
        reason=reason,
        history=history,
    )
