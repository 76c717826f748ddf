"""Functional nonlinear least squares with scipy.optimize.least_squares's interface.

:func:`least_squares` minimises ``½ Σ ρ(fᵢ(x)²)`` over a 1-D parameter vector with
the same Levenberg-Marquardt engine as the model optimizer, in float64, with the
Jacobian from automatic differentiation (or a callable, or finite differences for
functions written with NumPy).  It takes scipy's arguments in scipy's order, and its
result is a dict with scipy's fields, so porting a fit is a change of import.

It runs in four stages, one module each: check the call (:mod:`.options`), build the
problem in the free variable of the bounds' change of variables (:mod:`.build`, with
:mod:`.functions`, :mod:`.differences`, :mod:`.bounds`, :mod:`.problem` and :mod:`.losses`), run the
engine until a termination test, the budget or the callback stops it (:mod:`.run`),
and report in ``x`` (:mod:`.outcome`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .bounds import BoxTransform, parse_bounds
from .build import build_problem
from .options import (
    Options,
    check_call,
    check_feasible,
    positive_vector,
    scale_vector,
    start_point,
)
from .outcome import result_in_x
from .result import OptimizeResult
from .run import run_iterations

__all__ = ["least_squares"]


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
    kwargs = check_call(fun, args, kwargs, geodesic, callback, workers)
    x_start, numpy_in = start_point(x0)
    n = x_start.numel()
    opts = Options(
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
    scale = scale_vector(x_scale, n, opts)
    if isinstance(diff_step, (str, bytes)):
        raise TypeError(f"diff_step must be a positive number or array, got {diff_step!r}")
    rel_step = None if diff_step is None else positive_vector("diff_step", diff_step, n)
    lb, ub = parse_bounds(bounds, n)
    transform = BoxTransform(lb, ub, scale=scale)
    if method == "lm" and transform.bounded:
        raise ValueError(
            "Method 'lm' doesn't support bounds (as in scipy): pass method='trf' (bounds are "
            "a change of variables here), or drop bounds"
        )
    check_feasible(x_start, transform)
    y_start = transform.to_y(transform.strictly_feasible(x_start))
    problem = build_problem(fun, args, kwargs, y_start, numpy_in, transform, opts, rel_step)
    if max_nfev is not None:
        budget = int(max_nfev)
    else:
        # scipy's "lm" default: finite-difference columns count as evaluations too.
        budget = 100 * n * (n + 1) if problem.differences else 100 * n
    run = run_iterations(
        problem, y_start, opts, budget=budget, callback=callback, numpy_in=numpy_in
    )
    res = result_in_x(problem, run, opts, numpy_in=numpy_in)
    if verbose >= 1:
        initial_cost = run.history[0]
        print(res.message)
        print(
            f"Function evaluations {res.nfev}, initial cost {initial_cost:.4e}, "
            f"final cost {res.cost:.4e}, first-order optimality {res.optimality:.2e}."
        )
    return res
