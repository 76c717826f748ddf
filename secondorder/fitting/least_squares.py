"""Functional nonlinear least squares with scipy.optimize.least_squares's interface.

:func:`least_squares` minimises ``½ Σ ρ(fᵢ(x)²)`` over a 1-D parameter vector with
the same Levenberg-Marquardt engine as the model optimizer, in float64, with the
Jacobian from automatic differentiation (or a callable, or finite differences for
functions written with NumPy).  It takes scipy's arguments in scipy's order, and its
result is a dict with scipy's fields, so porting a fit is a change of import.

It runs in named steps: check the call (:class:`_Options`, :func:`_start_point`), adapt
the user's functions (:mod:`.functions`), build the problem in the free variable of the
bounds' change of variables (:mod:`.bounds`, :mod:`.problem`; robust losses in
:mod:`.losses`), run the engine until a termination test, the budget or the callback
stops it (:func:`_solve`), and report in ``x`` (:func:`_result`).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._validation import check_choice, check_integer, check_number
from ..lm.damping import (
    DAMPING_MATRICES,
    FITTING_DAMPING_RULES,
    DampingState,
    make_damping_matrix,
    make_damping_rule,
)
from ..lm.engine import EngineConfig, iterate
from ..lm.linalg import NormalEquations, make_solver
from .bounds import BoxTransform, parse_bounds
from .functions import (
    CallCounter,
    NumpyDifference,
    auto_mode,
    check_sparsity,
    flat_residuals,
    jacobian_function,
    numpy_residuals,
    output_eps,
    residual_function,
)
from .host import HostQRSolver
from .losses import LOSSES, check_loss_output, rho
from .problem import FunctionProblem, is_finite_system
from .result import MESSAGES, OptimizeResult

# LOSSES, MESSAGES and OptimizeResult stay importable from here (the old module path).
__all__ = [
    "JACS",
    "LOSSES",
    "MESSAGES",
    "METHODS",
    "SOLVERS",
    "OptimizeResult",
    "least_squares",
]

JACS = ("auto", "fwd", "rev", "2-point", "3-point", "cs")
SOLVERS = ("cholesky", "eigh", "qr", "cg")
METHODS = ("trf", "dogbox", "lm")
TR_SOLVERS = (None, "exact", "lsmr")
#: ``tr_options`` for ``tr_solver="lsmr"`` and what they become for the CG solver.
LSMR_OPTIONS = ("atol", "btol", "maxiter", "regularize")
_EPS = float(np.finfo(np.float64).eps)


def least_squares(
    fun: Callable[..., Any],
    x0: Any,
    jac: str | Callable[..., Any] = "auto",
    bounds: Any = None,
    method: str = "trf",
    ftol: float | None = 1e-8,
    xtol: float | None = 1e-8,
    gtol: float | None = 1e-8,
    x_scale: Any = None,
    loss: str | Callable[..., Any] = "linear",
    f_scale: float = 1.0,
    diff_step: Any = None,
    tr_solver: str | None = None,
    tr_options: dict[str, Any] | None = None,
    jac_sparsity: Any = None,
    max_nfev: int | None = None,
    verbose: int = 0,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    callback: Callable[..., Any] | None = None,
    workers: Any = None,
    *,
    damping: float = 1e-3,
    damping_rule: str = "trust",
    damping_matrix: str | None = None,
    solver: str | None = None,
    geodesic: bool = False,
) -> OptimizeResult:
    """Solve ``min_x ½ Σ ρ(fᵢ(x)²)`` by Levenberg-Marquardt, with scipy's interface.

    Every ``method`` runs the same damped Gauss-Newton iteration
    ``(JᵀJ + λD) δ = -Jᵀr``: scipy's "lm" is this iteration, and "trf"/"dogbox" are
    trust-region methods whose region λ and D describe.  Bounds are a change of
    variables (:mod:`.bounds`), not a reflective or dogleg region, so "trf" and
    "dogbox" give the same iterates; "lm" refuses what scipy's refuses (bounds, a
    robust loss, fewer residuals than variables, ``jac_sparsity``, a sparse
    Jacobian) and reports ``njev=None`` with finite differences, as scipy does.

    Args:
        fun: ``fun(x, *args, **kwargs)`` returning the residuals (any shape,
            flattened) for a 1-D float64 ``x``.  Written with torch operations it is
            differentiated exactly; written with NumPy its Jacobian comes from finite
            differences or from ``jac``.  ``fun`` is first called with the kind of
            array ``x0`` is; if that raises and the other kind works (a NumPy ``fun``
            with a tensor ``x0``), the other kind is used throughout, and the result
            still has ``x0``'s kind.
        x0: starting point: a scalar or 1-D, finite (tensor, array or sequence).
        jac: ``"auto"`` (reverse mode for up to 16 parameters and 256 residuals or
            fewer residuals than parameters, else forward mode; finite differences for a
            NumPy ``fun``), ``"fwd"``, ``"rev"``,
            ``"2-point"``, ``"3-point"``, ``"cs"`` (complex step: ``fun`` must accept
            complex input), or a callable ``jac(x, *args, **kwargs) -> (m, n)``; a
            scipy.sparse result is made dense, a ``LinearOperator`` is refused.
        bounds: ``(lb, ub)`` scalars or arrays (``±inf`` for none), or a
            ``scipy.optimize.Bounds``; ``lb < ub`` elementwise, ``x0`` within.
        method: ``"trf"``, ``"dogbox"`` or ``"lm"``, as described above.
        ftol: scipy's tolerance on the relative reduction of the cost.  ``None``
            disables a tolerance; at least one of the three must exceed machine
            epsilon (all three for "lm").
        xtol: scipy's tolerance on the relative step (in the scaled variables); with
            bounds, trf's test on x itself, ``‖Δx‖ ≤ xtol·(xtol + ‖x‖)`` (in
            ``x/x_scale`` for an array ``x_scale``).
        gtol: scipy's tolerance on the cosine between the residuals and the columns
            of J (MINPACK's measure).
        x_scale: the scale of each variable: the damping matrix becomes
            ``D = diag(1/x_scale²)`` (MINPACK's fixed ``diag``), so steps are
            measured in ``x/x_scale``.  A positive scalar or array, or ``"jac"``
            (Moré's running scaling by the Jacobian's column norms, the default, as
            scipy's "lm").  Under bounds the scaling applies to the free variable of
            the change of variables.
        loss: ``"linear"``, ``"soft_l1"``, ``"huber"``, ``"cauchy"``, ``"arctan"``
            with scipy's definitions, or a callable ``rho(z) -> (3, m)`` array of
            ``ρ, ρ', ρ''``, applied to ``z = (f / f_scale)²``.
        f_scale: soft margin between inlier and outlier residuals.
        diff_step: relative finite-difference step: ``h = diff_step·sign(x)·max(1,
            |x|)`` (default ``√eps`` for "2-point" and "cs", ``eps^⅓`` for
            "3-point", with ``eps`` the precision ``fun`` computes in).  With
            ``method="lm"`` "2-point" takes MINPACK's step, as scipy's "lm" does:
            ``h = max(diff_step, √eps)·|x|`` (that factor itself where ``x = 0``).
        tr_solver: ``"exact"`` (a dense factorisation of the damped system, the
            ``solver`` "qr" by default) or ``"lsmr"`` (an iterative solve: the
            matrix-free conjugate-gradient ``solver="cg"``); ``None`` picks
            ``"lsmr"`` when ``tr_options`` are given, else ``"exact"``.
        tr_options: for ``"lsmr"``: ``atol``/``btol`` (the smaller is CG's relative
            tolerance), ``maxiter`` (CG's iteration limit) and ``regularize``
            (accepted: λ always regularises the system).
        jac_sparsity: ``(m, n)`` 0/1 pattern of J (dense or scipy.sparse) for finite
            differences: structurally orthogonal columns are perturbed together, so
            a Jacobian costs one evaluation per group of columns.  Ignored with a
            ``jac`` callable (as scipy does); refused with autodiff.
        max_nfev: calls of ``fun`` allowed, counted as ``nfev`` is (default
            ``100·n``, or ``100·n·(n+1)`` with finite differences, as scipy's "lm").
            The run stops once it is spent; the Jacobian at the last accepted point
            may take it past by one Jacobian's calls.  ``max_nfev=1`` calls ``fun``
            for the value and the Jacobian at ``x0`` only: 2 calls with autodiff
            (the first records a graph to check the residuals depend on ``x``),
            ``1 + n`` with ``"2-point"``, ``1 + 2n`` with ``"3-point"``.
        verbose: 0 silent; 1 prints the termination message and a summary; 2 also a
            line per iteration (not with "lm", as scipy's MINPACK prints none).
        args: extra positional arguments of ``fun`` (and of a callable ``jac``).
        kwargs: a dict of extra keyword arguments of ``fun`` (and of ``jac``).
        callback: called after every iteration as ``callback(intermediate_result=
            res)`` when that is its only parameter (``res`` has ``x``, ``fun``,
            ``cost``, ``nit``, ``nfev``), else as ``callback(x)``; raising
            ``StopIteration`` stops with ``status=-2``.  Honoured for "lm" too.
        workers: only ``None`` or 1 (``fun`` is called serially).
        damping: initial λ.
        damping_rule: ``"trust"`` (MINPACK's trust region on ``‖D^½δ‖``; ``damping``
            is then only its first guess of λ), ``"nielsen"`` or ``"multiplicative"``.
        damping_matrix: ``"more"`` (default), ``"marquardt"`` or ``"identity"``;
            not together with an array ``x_scale``.
        solver: ``"qr"``, ``"cholesky"``, ``"eigh"`` or ``"cg"`` (see ``tr_solver``).
        geodesic: add geodesic acceleration.  The defaults of these LM parts
            mirror MINPACK (Moré's scaling and a QR of J).

    Returns:
        An :class:`OptimizeResult` (a dict with attribute access) with scipy's fields.
        ``nfev`` counts every call of ``fun`` except those made inside an
        automatic-differentiation Jacobian: residual values (the first at ``x0``
        included), finite-difference columns and geodesic second derivatives (scipy
        1.17 leaves finite-difference calls out).  ``njev`` counts Jacobian
        evaluations.  Automatic differentiation calls ``fun`` once per Jacobian, so
        ``fun`` is called exactly ``nfev + njev`` times, except that reverse mode
        (``"rev"``, and ``"auto"`` for small problems) on a torch ``fun`` of ``x``
        alone with flat float64 residuals and no bounds evaluates each trial point
        by ``torch.func.vjp`` and takes an accepted point's Jacobian from that
        evaluation (no call): ``fun`` then runs ``nfev + 1`` times (the one
        Jacobian at ``x0``).  Finite differences and a ``jac`` callable: exactly
        ``nfev`` times.  Nothing is evaluated twice.
    """
    kwargs = _check_call(fun, args, kwargs, geodesic, callback, workers)
    x_start, numpy_in = _start_point(x0)
    n = x_start.numel()
    opts = _Options(
        jac=jac,
        method=method,
        loss=loss,
        f_scale=f_scale,
        ftol=ftol,
        xtol=xtol,
        gtol=gtol,
        max_nfev=max_nfev,
        damping=damping,
        damping_rule=damping_rule,
        damping_matrix=damping_matrix,
        solver=solver,
        geodesic=geodesic,
        tr_solver=tr_solver,
        tr_options=tr_options,
        verbose=verbose,
        jac_sparsity=jac_sparsity,
    )
    scale = _x_scale(x_scale, n, opts)
    if isinstance(diff_step, (str, bytes)):
        raise TypeError(f"diff_step must be a positive number or array, got {diff_step!r}")
    rel_step = None if diff_step is None else _positive_vector("diff_step", diff_step, n)
    lb, ub = parse_bounds(bounds, n)
    transform = BoxTransform(lb, ub, scale=scale)
    if method == "lm" and transform.bounded:
        raise ValueError(
            "Method 'lm' doesn't support bounds (as in scipy): pass method='trf' (bounds are "
            "a change of variables here), or drop bounds"
        )
    _check_feasible(x_start, transform)
    y_start = transform.to_y(transform.strictly_feasible(x_start))
    problem = _build_problem(fun, args, kwargs, y_start, numpy_in, transform, opts, rel_step)
    if max_nfev is not None:
        budget = int(max_nfev)
    else:
        # scipy's "lm" default: finite-difference columns count as evaluations too.
        budget = 100 * n * (n + 1) if problem.differences else 100 * n
    run = _solve(problem, y_start, opts, budget=budget, callback=callback, numpy_in=numpy_in)
    res = _result(problem, run, opts, numpy_in=numpy_in)
    if verbose >= 1:
        initial_cost = run.history[0]
        print(res.message)
        print(
            f"Function evaluations {res.nfev}, initial cost {initial_cost:.4e}, "
            f"final cost {res.cost:.4e}, first-order optimality {res.optimality:.2e}."
        )
    return res


# ---------------------------------------------------------------------------------------
# Checking the call


@dataclass(frozen=True)
class _Options:
    """The solver's options, checked on construction with the messages users see."""

    jac: str | Callable[..., Any]
    method: str
    loss: str | Callable[..., Any]
    f_scale: float
    ftol: float | None
    xtol: float | None
    gtol: float | None
    max_nfev: int | None
    damping: float
    damping_rule: str
    damping_matrix: str | None
    solver: str | None
    geodesic: bool
    tr_solver: str | None
    tr_options: dict[str, Any] | None
    verbose: int
    jac_sparsity: Any

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        if not callable(self.jac):
            check_choice("jac", self.jac, JACS, extra=" or a callable")
        if not callable(self.loss):
            check_choice("loss", self.loss, LOSSES, extra=" or a callable rho(z) -> (3, m)")
        if self.method == "lm" and self.loss != "linear":
            raise ValueError(
                f"method='lm' supports only the 'linear' loss (as in scipy), got "
                f"loss={self.loss!r}: pass method='trf' for a robust loss"
            )
        check_number("f_scale", self.f_scale, above=0, type_error=False)
        for name, tol in (("ftol", self.ftol), ("xtol", self.xtol), ("gtol", self.gtol)):
            if tol is not None:
                check_number(name, tol, at_least=0, type_error=False)
        self._check_tolerances()
        check_integer("max_nfev", self.max_nfev, allow_none=True)
        check_choice("damping_rule", self.damping_rule, FITTING_DAMPING_RULES)
        if self.damping_matrix is not None:
            check_choice("damping_matrix", self.damping_matrix, DAMPING_MATRICES)
        if self.solver is not None:
            check_choice("solver", self.solver, SOLVERS)
        check_number("damping", self.damping, at_least=0, type_error=False)
        if self.verbose not in (0, 1, 2) or isinstance(self.verbose, bool):
            raise ValueError(f"Invalid verbose={self.verbose!r}: must be 0, 1 or 2 (as in scipy).")
        self._check_trust_region_solver()
        if self.jac_sparsity is not None and self.method == "lm":
            raise ValueError(
                "method='lm' does not support jac_sparsity (as in scipy): pass method='trf', "
                "or drop jac_sparsity"
            )
        if self.jac_sparsity is not None and self.jac in ("fwd", "rev"):
            raise ValueError(
                f"jac_sparsity groups finite-difference columns, but jac={self.jac!r} is "
                "automatic differentiation (exact, with no columns to group): drop "
                "jac_sparsity, or pass jac='2-point'"
            )

    def _check_tolerances(self) -> None:
        tols = {
            k: v or 0.0 for k, v in (("ftol", self.ftol), ("xtol", self.xtol), ("gtol", self.gtol))
        }
        if self.method == "lm" and any(v < _EPS for v in tols.values()):
            low = [f"{k}={v!r}" for k, v in tols.items() if v < _EPS]
            raise ValueError(
                f"All tolerances must be higher than machine epsilon ({_EPS:.2e}) for method "
                f"'lm' (as in scipy), got {', '.join(low)}: raise them or pass method='trf'"
            )
        if all(v < _EPS for v in tols.values()):
            raise ValueError(
                f"At least one of the tolerances must be higher than machine epsilon "
                f"({_EPS:.2e}), got ftol={self.ftol!r}, xtol={self.xtol!r}, gtol={self.gtol!r}: "
                "without one the iteration would stop only on max_nfev"
            )

    def _check_trust_region_solver(self) -> None:
        check_choice("tr_solver", self.tr_solver, TR_SOLVERS)
        if self.tr_options is not None and not isinstance(self.tr_options, dict):
            raise TypeError(f"tr_options must be a dict, got {self.tr_options!r}")
        if self.solver is not None and self.tr_solver is not None:
            iterative = self.solver == "cg"
            if iterative != (self.tr_solver == "lsmr"):
                raise ValueError(
                    f"tr_solver={self.tr_solver!r} and solver={self.solver!r} disagree: "
                    "'lsmr' is the iterative solver='cg', 'exact' a factorisation ('qr', "
                    "'cholesky', 'eigh'); pass one of them"
                )
        options = self.tr_options or {}
        if options and self.linear_solver != "cg":
            raise ValueError(
                f"tr_options={options!r} apply to tr_solver='lsmr' (the iterative solver); "
                f"the solver here is {self.linear_solver!r}: pass tr_solver='lsmr' or drop them"
            )
        unknown = sorted(set(options) - set(LSMR_OPTIONS))
        if unknown:
            raise TypeError(
                f"tr_options has unsupported keys {unknown}; valid keys are {LSMR_OPTIONS} "
                "(LSMR's atol/btol/maxiter become the CG solver's tolerance and iteration "
                "limit)"
            )
        for key in ("atol", "btol"):
            if key in options:
                check_number(f"tr_options['{key}']", options[key], above=0, type_error=False)
        if "maxiter" in options:
            check_integer("tr_options['maxiter']", options["maxiter"], allow_none=True)

    @property
    def linear_solver(self) -> str:
        """The solver that runs: ``solver``, else ``"cg"`` for "lsmr", else ``"qr"``."""
        if self.solver is not None:
            return self.solver
        lsmr = self.tr_solver == "lsmr" or (self.tr_solver is None and bool(self.tr_options))
        return "cg" if lsmr else "qr"


def _check_call(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    geodesic: bool,
    callback: Callable[..., Any] | None,
    workers: Any,
) -> dict[str, Any]:
    """Check ``args``, ``kwargs``, ``geodesic``, ``callback``, ``workers`` and ``fun``."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments of fun, got {args!r}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(
            f"kwargs must be a dict of extra keyword arguments of fun, got "
            f"{type(kwargs).__name__} {kwargs!r}: pass kwargs={{'name': value}}"
        )
    if not isinstance(geodesic, bool):
        raise TypeError(f"geodesic must be a bool, got {geodesic!r}")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {callback!r}")
    if workers not in (None, 1):
        raise ValueError(
            f"workers={workers!r} is not supported: secondorder calls fun serially; "
            "pass workers=None (or vectorise fun)"
        )
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}")
    return dict(kwargs or {})


def _start_point(x0: Any) -> tuple[Tensor, bool]:
    """``x0`` as a fresh 1-D finite float64 tensor, and whether it came as NumPy/sequence.

    A scalar is a one-parameter problem (scipy's ``atleast_1d``).
    """
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
    if x_start.ndim == 0:
        x_start = x_start.reshape(1)
    if x_start.ndim != 1 or x_start.numel() == 0:
        raise ValueError(f"x0 must be a non-empty 1-D array, got shape {tuple(x_start.shape)}")
    if not bool(torch.isfinite(x_start).all()):
        raise ValueError(f"x0 must be finite, got {x_start.tolist()}")
    return x_start, numpy_in


def _positive_vector(name: str, value: Any, n: int) -> Tensor:
    """A positive finite scalar or length-``n`` array, as an ``(n,)`` float64 tensor."""
    try:
        t = torch.as_tensor(np.asarray(value, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{name} must be a positive number or an array of {n} positive numbers, got {value!r}"
        ) from exc
    if t.ndim == 0:
        t = t.expand(n).clone()
    if t.shape != (n,):
        raise ValueError(
            f"{name} must be a scalar or have x0's shape ({n},), got shape {tuple(t.shape)}"
        )
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise ValueError(f"{name} must be finite and > 0 everywhere, got {t.tolist()}")
    return t


def _x_scale(x_scale: Any, n: int, opts: _Options) -> Tensor | None:
    """The fixed scaling vector for an array ``x_scale``; ``None`` for ``"jac"``/default."""
    if x_scale is None or (isinstance(x_scale, str) and x_scale == "jac"):
        if isinstance(x_scale, str) and opts.damping_matrix not in (None, "more"):
            raise ValueError(
                f"x_scale='jac' is Moré's scaling, damping_matrix='more', but "
                f"damping_matrix={opts.damping_matrix!r} was passed: pass one of them"
            )
        return None
    if isinstance(x_scale, str) or np.iscomplexobj(x_scale):
        raise ValueError(
            f"x_scale must be 'jac' or positive numbers (a scalar or one per variable), "
            f"got {x_scale!r}"
        )
    if opts.damping_matrix is not None:
        raise ValueError(
            f"x_scale={x_scale!r} sets the damping matrix to diag(1/x_scale²), but "
            f"damping_matrix={opts.damping_matrix!r} was passed too: pass one of them"
        )
    return _positive_vector("x_scale", x_scale, n)


def _check_feasible(x_start: Tensor, transform: BoxTransform) -> None:
    lb, ub = transform.lb, transform.ub
    if bool(((x_start < lb) | (x_start > ub)).any()):
        raise ValueError(
            f"Initial guess is outside of provided bounds: x0 is infeasible, "
            f"x0={x_start.tolist()} with lb={lb.tolist()}, ub={ub.tolist()}; pass an x0 "
            "within the bounds"
        )


# ---------------------------------------------------------------------------------------
# Building the problem


def _build_problem(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    y_start: Tensor,
    numpy_in: bool,
    transform: BoxTransform,
    opts: _Options,
    rel_step: Tensor | None,
) -> FunctionProblem:
    """Adapt ``fun`` and ``jac`` to tensors, check the residuals at ``x0``, wire the problem.

    Whether ``fun`` speaks torch (differentiable) or NumPy is decided by calling it once
    with the kind of array ``x0`` is (and the other kind if that raises): what it
    returns decides, and it is kept as the residuals at the start ``x(y_start)`` (the
    first of ``nfev``).
    """
    counter = CallCounter(fun)
    x_eval = transform.to_x(y_start)
    autodiff = isinstance(opts.jac, str) and opts.jac in ("auto", "fwd", "rev")
    probe, numpy_fun = _probe(counter, args, kwargs, x_eval, numpy_in, autodiff=autodiff)
    residuals = residual_function(counter, args, kwargs, numpy_fun=numpy_fun)
    f0 = flat_residuals(probe, numpy_fun=numpy_fun).detach()
    if f0.device != x_eval.device:
        raise ValueError(
            f"fun returned residuals on {f0.device} for x0 on {x_eval.device}: "
            "least_squares runs on the CPU, so return CPU tensors from fun "
            "(.to(x.device) or .cpu() on its result)"
        )
    m, n = f0.numel(), x_eval.numel()
    if m == 0:
        raise ValueError("fun returned no residuals at x0")
    if not bool(torch.isfinite(f0).all()):
        bad = torch.nonzero(~torch.isfinite(f0.reshape(-1))).flatten().tolist()
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        raise ValueError(
            f"Residuals are not finite in the initial point x0: {len(bad)} of {m} entries "
            f"are NaN or inf (at {shown}). Check the data fun compares against (ydata, "
            "xdata and sigma in curve_fit) as well as x0."
        )
    if opts.method == "lm" and m < n:
        raise ValueError(
            f"Method 'lm' doesn't work when the number of residuals ({m}) is less than the "
            f"number of variables ({n}) (as in scipy): pass method='trf'"
        )
    if callable(opts.loss):
        check_loss_output(opts.loss, (f0 / opts.f_scale) ** 2)
    differences = not callable(opts.jac) and (numpy_fun or opts.jac in JACS[3:])
    sparsity = None
    if opts.jac_sparsity is not None and not callable(opts.jac):
        if not differences:
            raise ValueError(
                "jac_sparsity groups finite-difference columns, but fun is differentiated "
                "exactly by torch (jac='auto'): drop jac_sparsity, or pass jac='2-point'"
            )
        sparsity = check_sparsity(opts.jac_sparsity, (m, n))
    flat = _flat_float64(probe, args, kwargs)
    jac = jacobian_function(
        opts.jac,
        residuals,
        numpy_fun=numpy_fun,
        shape=(m, n),
        args=args,
        kwargs=kwargs,
        eps=output_eps(probe),
        counter=counter,
        rel_step=rel_step,
        sparsity=sparsity,
        dense_only=opts.method == "lm",
        # scipy's "lm" differences in MINPACK (fdjac2), with MINPACK's relative step.
        minpack=opts.method == "lm",
        flat_fun=fun if flat else None,
    )
    rev = auto_mode(m, n) == "rev"
    problem = FunctionProblem(
        residuals,
        jac,
        transform,
        opts.loss,
        float(opts.f_scale),
        need_gram=opts.linear_solver in ("cholesky", "eigh"),
        differentiable=not numpy_fun,
        counter=counter,
        takes_residuals=True,
    )
    problem.differences = differences
    if flat and not transform.any and (opts.jac == "rev" or (opts.jac == "auto" and rev)):
        # Reverse mode: a point's residuals by vjp, its J from that forward pass.
        problem.fuse(fun, m)
    if numpy_fun and not transform.any:
        # x = y: the NumPy fun (and its differences) called on arrays, no adapter.
        host_jac = jac.of_arrays if isinstance(jac, NumpyDifference) else None
        problem.on_host(numpy_residuals(counter, args, kwargs, owned=True), host_jac)
    problem.remember(y_start, f0)
    return problem


def _flat_float64(probe: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a torch ``fun`` of ``x`` alone returned flat float64 residuals at ``x0``."""
    return (
        not args
        and not kwargs
        and isinstance(probe, Tensor)
        and probe.ndim == 1
        and probe.dtype == torch.float64
    )


def _probe(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    x_start: Tensor,
    numpy_in: bool,
    *,
    autodiff: bool,
) -> tuple[Any, bool]:
    """``(fun(x0), numpy_fun)``; a torch ``fun`` to be differentiated is checked to depend on ``x``.

    ``fun`` is called with ``x0``'s kind of array first; if that raises, with the other
    kind, and if that raises too the first error is raised.  Autodiff of residuals that
    were detached from ``x`` (``.detach()``, ``.item()``, a NumPy round trip,
    ``torch.no_grad()``) gives a zero Jacobian, and the zero gradient would pass the
    gtol test at ``x0``: a false success.  So a torch call records a graph and the
    residuals must reach ``x`` through it.
    """

    def as_numpy() -> Any:
        return fun(x_start.numpy().copy(), *args, **kwargs)

    def as_torch() -> tuple[Any, Tensor | None]:
        if not autodiff:
            return fun(x_start.clone(), *args, **kwargs), None
        leaf = x_start.clone().requires_grad_(True)
        with torch.enable_grad(), warnings.catch_warnings():
            # float(x[i]) on the recording x warns; the check below says what is wrong.
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
            return fun(leaf.clone(), *args, **kwargs), leaf

    leaf: Tensor | None = None
    try:
        if numpy_in:
            out = as_numpy()
        else:
            out, leaf = as_torch()
    except Exception as first:
        try:
            if numpy_in:
                out, leaf = as_torch()
            else:
                out = as_numpy()
        except Exception:
            raise first from None
        numpy_in = not numpy_in
    if leaf is not None and isinstance(out, Tensor) and out.is_floating_point():
        with torch.enable_grad():
            connected = out.requires_grad and (
                torch.autograd.grad(out.sum(), leaf, allow_unused=True)[0] is not None
            )
        if not connected:
            raise ValueError(
                "fun's residuals do not depend on the parameters x: the residuals at x0 are "
                "not connected to x by autograd (detached with .detach(), .item(), .numpy() "
                "or torch.no_grad(), or computed from other tensors only), so their Jacobian "
                "would be 0 and x0 would pass for a minimum; compute the residuals from x "
                "with torch operations, or pass jac= (a callable, '2-point' or '3-point')"
            )
    numpy_fun = not isinstance(out, Tensor)
    return (out.detach() if isinstance(out, Tensor) else out), numpy_fun


# ---------------------------------------------------------------------------------------
# Running the engine


@dataclass(frozen=True)
class _Run:
    """How the iterations ended: the point in ``y``, scipy's status and the cost history."""

    y: Tensor
    status: int
    reason: str
    history: list[float]
    damping: float
    nit: int


def _engine_config(opts: _Options) -> EngineConfig:
    return EngineConfig(
        max_attempts=1 << 30,
        min_gain_ratio=1e-4,
        # No floor: near a singular solution (Powell's) JᵀJ shrinks without bound
        # while D keeps its scale, and any fixed floor would cap the step.
        damping_min=0.0,
        damping_max=1e15,
        ftol=opts.ftol or 0.0,
        xtol=opts.xtol or 0.0,
        gtol=opts.gtol or 0.0,
        geodesic=opts.geodesic,
    )


def _first_system(problem: FunctionProblem, y: Tensor) -> NormalEquations:
    system = problem.linearize(y, problem.residuals(y))
    if not is_finite_system(system):
        raise ValueError("The Jacobian (jac) is not finite at x0; cannot take a step.")
    return system


def _make_solver(opts: _Options) -> Any:
    if opts.linear_solver == "qr":
        # A few parameters: QR's solves on the host (NumPy), LAPACK without wrappers.
        return HostQRSolver()
    options = opts.tr_options or {}
    tols = [float(options[k]) for k in ("atol", "btol") if k in options]
    return make_solver(
        opts.linear_solver,
        cg_rtol=min(tols) if tols else 1e-6,
        cg_max_iter=options.get("maxiter"),
        # A few parameters: QR's solves on the host (NumPy), not as torch calls.
        host=True,
    )


def _damping_matrix_name(opts: _Options, problem: FunctionProblem) -> str:
    # A fixed x_scale is applied as a change of variables u = y / x_scale, in which the
    # damping matrix is the identity: D = diag(1/x_scale²) in y (MINPACK's mode 2).
    if problem.bounds.scale is not None:
        return "identity"
    return opts.damping_matrix or "more"


class _Printer:
    """Scipy's per-iteration table for ``verbose=2`` (columns of 15 characters)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        if on:
            names = ("Iteration", "Total nfev", "Cost", "Cost reduction", "Step norm")
            print("".join(f"{k:^15}" for k in names) + f"{'Optimality':^15}")

    def row(
        self,
        it: int,
        nfev: int,
        cost: float,
        reduction: float | None,
        step: float | None,
        opt: float,
    ) -> None:
        if not self.on:
            return
        red = " " * 15 if reduction is None else f"{reduction:^15.2e}"
        stp = " " * 15 if step is None else f"{step:^15.2e}"
        print(f"{it:^15}{nfev:^15}{cost:^15.4e}{red}{stp}{opt:^15.2e}")


def _solve(
    problem: FunctionProblem,
    y: Tensor,
    opts: _Options,
    *,
    budget: int,
    callback: Callable[..., Any] | None,
    numpy_in: bool,
) -> _Run:
    """LM iterations from ``y`` until a termination test, ``budget`` or ``callback`` stops.

    Each :func:`~secondorder.lm.engine.iterate` call (one *iteration*, as scipy counts
    them) retries with larger λ until a step is accepted or the evaluations left run
    out; the Jacobian is re-evaluated only after an accepted step.
    """
    rule = make_damping_rule(opts.damping_rule)
    matrix = make_damping_matrix(_damping_matrix_name(opts, problem))
    state = DampingState(damping=float(opts.damping))
    solver = _make_solver(opts)
    bounds = problem.bounds
    # Under bounds the step test is trf's, on x itself: in the bounds' free variable
    # y, scaled by D, a step that leaves one coordinate far from where it goes can look
    # negligible beside another coordinate's large ‖D^½y‖ (a fit driven against one
    # bound by a slow valley would stop there, reporting convergence).
    xtol = opts.xtol or 0.0
    xtol_in_x = bounds.bounded and xtol > 0
    config = _engine_config(opts)
    if xtol_in_x:
        config = replace(config, xtol=0.0)
    system = _first_system(problem, y)
    # MINPACK's first trust radius is factor·‖D^½x₀‖, the size of the start.  Measured
    # in the bounds' free variable it is the size of y₀, which says nothing of x₀: at
    # the middle of two-sided bounds (curve_fit's start without p0) y₀ = 0 and the
    # region would start at `factor` in D's units, far too small to leave the start.
    # So x₀'s size counts too, in the free variable's units (start_size).
    size = bounds.start_size(y) if bounds.bounded else None
    status, reason = 0, ""
    history = [0.5 * float(system.loss_sum)]
    printer = _Printer(opts.verbose == 2 and opts.method != "lm")
    if printer.on:
        printer.row(0, problem.nfev, history[0], None, None, _optimality(problem, y, opts))
    call = _wrap_callback(callback)
    nit = 0
    while True:
        remaining = budget - problem.nfev
        if remaining <= 0:
            status, reason = 0, "max_nfev reached"
            break
        before, y_before = problem.nfev, y
        out = iterate(
            problem,
            y,
            system,
            solver=solver,
            rule=rule,
            matrix=matrix,
            state=state,
            config=config,
            max_attempts=remaining,
            size=size if state.radius is None else None,
        )
        reason = out.reason
        if out.accepted:
            y = out.x
            history.append(0.5 * out.loss_sum)
        if out.status > 0:
            status = out.status
        elif out.stop and problem.nfev - before < remaining and not out.accepted:
            # λ reached its maximum: steps are as short as the arithmetic allows.
            status = 3
        if out.accepted and xtol_in_x and status in (0, 2):
            unit = 1.0 if bounds.scale is None else bounds.scale
            x_new = bounds.to_x(y) / unit
            dx = float(torch.linalg.vector_norm(x_new - bounds.to_x(y_before) / unit))
            if dx <= xtol * (xtol + float(torch.linalg.vector_norm(x_new))):
                status = 4 if status == 2 else 3
        if out.accepted:
            system = problem.linearize(y, problem.residuals(y))
            if not is_finite_system(system):
                # No linear model here: stop without claiming convergence.
                status, reason = -1, "the Jacobian (jac) is not finite at the current point"
        if out.attempts == 0:
            break  # gtol held at the current point: no iteration was run
        nit += 1
        if printer.on:
            x_step = problem.bounds.to_x(y) - problem.bounds.to_x(y_before)
            printer.row(
                nit,
                problem.nfev,
                history[-1],
                0.5 * (out.loss_sum_before - out.loss_sum) if out.accepted else 0.0,
                float(torch.linalg.vector_norm(x_step)),
                _optimality(problem, y, opts) if status != -1 else math.nan,
            )
        if call is not None and _stopped_by(call, problem, y, history[-1], nit, numpy_in):
            status, reason = -2, "callback raised StopIteration"
            break
        if status != 0:
            break
    return _Run(y=y, status=status, reason=reason, history=history, damping=state.damping, nit=nit)


def _wrap_callback(callback: Callable[..., Any] | None) -> Callable[[OptimizeResult], Any] | None:
    """Scipy's two forms: ``callback(intermediate_result=res)`` or ``callback(x)``."""
    if callback is None:
        return None
    try:
        params = set(inspect.signature(callback).parameters)
    except (TypeError, ValueError):
        params = set()
    if params == {"intermediate_result"}:

        def keyword(res: OptimizeResult) -> Any:
            return callback(intermediate_result=res)

        return keyword

    def positional(res: OptimizeResult) -> Any:
        x = res["x"]
        return callback(x.copy() if isinstance(x, np.ndarray) else x.clone())

    return positional


def _stopped_by(
    call: Callable[[OptimizeResult], Any],
    problem: FunctionProblem,
    y: Tensor,
    cost: float,
    nit: int,
    numpy_in: bool,
) -> bool:
    """Call the callback with the current iterate; ``True`` when it raised StopIteration."""
    x = problem.bounds.to_x(y).detach().clone()
    f = problem.residuals(y).clone()
    res = OptimizeResult(
        x=x.numpy() if numpy_in else x,
        fun=f.numpy() if numpy_in else f,
        nit=nit,
        nfev=problem.nfev,
        cost=cost,
    )
    try:
        call(res)
    except StopIteration:
        return True
    return False


# ---------------------------------------------------------------------------------------
# Reporting in x


def _gradient(problem: FunctionProblem, f: Tensor, J: Tensor, opts: _Options) -> Tensor:
    """``Jᵀ(ρ'·f)``, the gradient of the cost in ``x``."""
    if opts.loss == "linear":
        return J.T @ f
    return J.T @ (rho(opts.loss, (f / opts.f_scale) ** 2)[1] * f)


def _reported_jacobian(f: Tensor, J: Tensor, opts: _Options) -> Tensor:
    """The ``res.jac`` scipy reports: J, under a robust loss with rows scaled by ``√(ρ' + 2zρ'')``.

    ``z = (f/f_scale)²``, the factor floored at machine epsilon as scipy floors it: then
    ``JᵀJ`` is the Gauss-Newton model of the robust cost's Hessian, which is what
    :func:`~secondorder.fitting.covariance` (and scipy's ``curve_fit``) invert.
    """
    if opts.loss == "linear":
        return J
    z = (f / opts.f_scale) ** 2
    _, d1, d2 = rho(opts.loss, z)
    return J * torch.clamp(d1 + 2 * z * d2, min=_EPS).sqrt()[:, None]


def _optimality(problem: FunctionProblem, y: Tensor, opts: _Options) -> float:
    """Scipy's first-order optimality at ``y``: ``‖grad‖∞``, Coleman-Li scaled under bounds."""
    transform = problem.bounds
    x = transform.to_x(y).detach()
    f = problem.residuals(y)
    grad = _gradient(problem, f, problem.jacobian(y, f), opts)
    vec = grad * transform.cl_scale(x, grad) if transform.bounded else grad
    return float(vec.abs().max())


def _result(
    problem: FunctionProblem, run: _Run, opts: _Options, *, numpy_in: bool
) -> OptimizeResult:
    """The result's fields at the solution ``x(y)``: its residuals and Jacobian in ``x``.

    Both were computed by the run (the residuals when the point was tried, the Jacobian
    when it was linearised) and are reused; only a point accepted in the last iteration
    needs its Jacobian, counted in ``njev``.  Under bounds ``optimality`` is Coleman-Li
    scaled, as scipy's "trf" reports it.
    """
    transform = problem.bounds
    x = transform.to_x(run.y).detach()
    f = problem.residuals(run.y)
    J = problem.jacobian(run.y, f)
    cost2 = problem.cost2(f)
    grad = _gradient(problem, f, J, opts)
    opt_vec = grad * transform.cl_scale(x, grad) if transform.bounded else grad
    optimality = float(opt_vec.abs().max())
    active = transform.active(x)

    def out_arr(t: Tensor) -> Any:
        return t.numpy() if numpy_in else t

    njev: int | None = problem.njev
    if opts.method == "lm" and problem.differences:
        njev = None  # scipy's "lm" reports no Jacobian evaluations with finite differences
    return OptimizeResult(
        x=out_arr(x),
        cost=0.5 * float(cost2),
        fun=out_arr(f.detach()),
        jac=out_arr(_reported_jacobian(f.detach(), J, opts)),
        grad=out_arr(grad.detach()),
        optimality=optimality,
        active_mask=out_arr(active),
        nfev=problem.nfev,
        njev=njev,
        status=run.status,
        message=run.reason if run.status == -1 else MESSAGES[run.status],
        success=run.status > 0,
        nit=run.nit,
        damping=run.damping,
        reason=run.reason,
        history=run.history,
    )
