"""Many independent fits in one call: :func:`curve_fit_batch` and :func:`least_squares_batch`.

Each fit is what :func:`~secondorder.curve_fit` (or :func:`~secondorder.least_squares`)
would do with it alone, with scipy's conventions per fit, but every fit advances at
once: the model is evaluated for the whole batch in one call (parameters as ``(B, 1)``
columns that broadcast), Jacobians come from forward mode over the few parameters, and
the small normal equations of all fits are solved together (:mod:`.small_linalg`).
The iteration stays on the device (:mod:`.engine`); the host reads one mask every
``check_every`` attempts (:mod:`.driver`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from ..._validation import check_choice, check_integer
from ..result import MESSAGES
from . import arguments as check
from .compiled import CPU_SLOTS
from .driver import RunOptions, make_progress, run
from .driver import chunk_size as fits_per_chunk
from .engine import COUNT, OWN_MESSAGES
from .problem import BatchProblem, Objective
from .rule import BatchTrustRegion
from .weights import data_weights

__all__ = ["BATCH_MESSAGES", "ESTIMATORS", "BatchResult", "curve_fit_batch", "least_squares_batch"]

ESTIMATORS = ("lse", "mle")
#: The sentence for each ``status`` of a batched fit (scipy's; -1 a fit whose numbers
#: stopped being finite, -3 a Poisson fit stopped against μ = 0).
BATCH_MESSAGES = {**MESSAGES, **OWN_MESSAGES}


class BatchResult(dict[str, Any]):
    """Per-fit results of a batched fit: a dict whose keys are also attributes.

    Fields, one entry per fit (tensors on the fits' device): ``x`` ``(B, n)``, ``cost``
    (``½Σρ(f²)``; half the deviance for Poisson fits), ``fun`` ``(B, m)`` (residuals, or
    the model for Poisson fits), ``nfev``, ``njev``, ``nit``, ``status`` (scipy's: 0
    max_nfev, 1 gtol, 2 ftol, 3 xtol, 4 both; -1 not finite, -3 a Poisson fit stopped
    against μ = 0), ``success``
    (``status > 0``); ``message`` a list of sentences (:data:`BATCH_MESSAGES`).
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


def curve_fit_batch(
    f: Callable[..., Any],
    xdata: Any,
    ydata: Any,
    p0: Any = None,
    sigma: Any = None,
    absolute_sigma: bool = False,
    bounds: Any = (-math.inf, math.inf),
    *,
    jac: Callable[..., Any] | None = None,
    estimator: str = "lse",
    loss: str = "linear",
    f_scale: float = 1.0,
    ftol: float | None = 1e-8,
    xtol: float | None = 1e-8,
    gtol: float | None = 1e-8,
    x_scale: Any = "jac",
    max_nfev: int | None = None,
    xdata_per_fit: bool | None = None,
    dtype: torch.dtype | None = None,
    device: Any = None,
    check_every: int = 4,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    progress: Any = None,
    compile: bool = False,
) -> tuple[Tensor, Tensor, BatchResult]:
    """Fit ``ydata[b] ≈ f(xdata, *p[b])`` for every fit ``b``; scipy's ``curve_fit`` per fit.

    The model is the one written for ``curve_fit``: ``f`` is called once per attempt
    for all fits, each parameter a ``(B, 1)`` tensor, so broadcasting evaluates every
    fit at once::

        def decay(t, a, tau):
            return a * torch.exp(-t / tau)       # t (m,), a and tau (B, 1) -> (B, m)

        popt, pcov, info = so.curve_fit_batch(decay, t, y, p0=[1.0, 2.0])  # y (B, m)

    Each fit runs :func:`~secondorder.least_squares`' iteration (the trust region,
    gain ratio and ftol/xtol/gtol tests) with its own λ; a fit whose data hold NaN fails
    alone (status -1) and leaves the others' numbers untouched.

    Args:
        f: ``f(xdata, p1, ..., pn) -> (B, m)`` (or anything that broadcasts to it).
        xdata: passed to ``f`` as given (a tensor on the fits' device and dtype when it
            is numeric): shared, e.g. ``(m,)`` or scipy's ``(k, m)``; or per fit,
            ``(B, m, ...)``, then ``f`` gets the rows of the fits it evaluates.
        ydata: ``(B, m)`` data, one row per fit (counts ≥ 0 for ``estimator="mle"``).
        p0: ``(B, n)`` or ``(n,)`` (the same start for every fit); default ones, their
            number read from ``f``'s signature (within bounds, scipy's feasible start).
        sigma: ``ydata``'s standard deviations, a scalar, ``(m,)`` or ``(B, m)``; or,
            scipy's 2-D ``sigma``, their covariance, ``(m, m)`` or ``(B, m, m)`` (the
            residuals are then whitened by its Cholesky factor).
        absolute_sigma: ``pcov`` unscaled (``sigma`` in the data's units) or scaled by
            the reduced chi-square ``2·cost/(m - n)`` (scipy's rule).
        bounds: ``(lb, ub)``, each a scalar, ``(n,)`` or ``(B, n)``; least_squares'
            change of variables.
        jac: ``jac(xdata, p1, ..., pn) -> (B, m, n)``, the derivatives of ``f``; default
            forward-mode autodiff (one ``jvp`` per parameter, vectorised).
        estimator: ``"lse"`` (least squares) or ``"mle"`` (Poisson maximum likelihood
            for counts, Gpufit's MLE: minimises the deviance; ``pcov`` is the inverse
            Fisher information, ``Σ ∂μ∂μᵀ/μ``).  A step to ``μ < 0`` is refused, so
            bound a parameter that can take μ there (a background: ``lb = 0``): a
            fit pressed against ``μ = 0`` where its counts are 0 otherwise stops short
            on its step size, and is reported so (status -3, ``success`` False).
        loss: a robust loss, one of scipy's names (``"lse"`` only).
        f_scale: the robust loss's soft margin between inliers and outliers.
        ftol: scipy's tolerance on the relative reduction of the cost, per fit.
        xtol: scipy's tolerance on the relative step, per fit.  The defaults are
            scipy's, tighter than float32 resolves: float32 fits usually end on xtol.
        gtol: scipy's tolerance on the gradient's cosine with the residuals.
        x_scale: ``"jac"`` (Moré's scaling) or positive numbers, a scalar, ``(n,)``
            or ``(B, n)``.
        max_nfev: evaluations allowed per fit (default ``100·n``).
        xdata_per_fit: whether ``xdata``'s first axis runs over the fits; default: when
            its shape starts with ``(B, m)``.
        dtype: float32 or float64 (default: ``ydata``'s when a floating tensor, else
            ``p0``'s, else float64).
        device: where the fits run (default: ``ydata``'s, else the CPU).
        check_every: attempts between two reads of the "all done?" mask on the host.
        chunk_size: fits per chunk (default: sized from ``memory_budget``).
        memory_budget: bytes a chunk may use (default: half the GPU's free memory, 1
            GiB on a CPU).
        progress: ``True`` for a progress bar (tqdm if installed), or a callable
            ``progress(done, total)`` called as fits finish.
        compile: run each attempt through ``torch.compile`` (opt-in): each attempt
            (and the covariance's pass) is then a few fused loops over the fits
            instead of thousands of tensor operations, after a first call that
            compiles them for the model and dtype (torch caches them on disk; how
            long, and the speed-up, are in ``benchmarks/BATCH_FITS.md``): worth it
            for many fits.  Fits run in
            ``chunk_size`` slots refilled as fits finish (default on a CPU: 4096).

    Returns:
        ``(popt, pcov, info)``: ``popt`` ``(B, n)``, ``pcov`` ``(B, n, n)`` (inf where
        undetermined) and a :class:`BatchResult`.
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {f!r}")
    check_choice("estimator", estimator, ESTIMATORS)
    if not isinstance(absolute_sigma, bool):
        raise TypeError(f"absolute_sigma must be True or False, got {absolute_sigma!r}")
    dt, dev = check.dtype_device(dtype, device, ydata, p0)
    y = check.as_tensor("ydata", ydata, dt, dev)
    if y.ndim != 2 or y.shape[1] == 0:
        raise ValueError(
            f"ydata must be 2-D (B, m), one row of m > 0 points per fit, got shape {tuple(y.shape)}"
        )
    b, m = y.shape
    n = check.parameter_count(f, p0)
    lb, ub = check.bounds_pair(bounds, b, n, dt, dev)
    p = check.starts(f, p0, b, n, lb, ub, dt, dev, name="p0")
    x = check.xdata(xdata, dt, dev)
    per_fit = check.per_fit(x, xdata_per_fit, b, m)
    if estimator == "mle":
        if sigma is not None:
            raise ValueError(
                f"sigma={check.short(sigma)} with estimator='mle': Poisson counts have variance "
                "μ, so there are no weights to give; drop sigma, or pass estimator='lse'"
            )
        if loss != "linear":
            raise ValueError(
                f"loss={loss!r} with estimator='mle': a robust loss applies to least "
                "squares; pass loss='linear' or estimator='lse'"
            )
        check.counts(y)
    weights = data_weights(sigma, b, m, dt, dev)
    model = check.column_model(f, n, m)
    rows: list[Tensor] = [y]
    weighted = weights is not None and weights.per_fit
    if weights is not None and weights.per_fit:
        rows.append(weights.value)
    if per_fit:
        rows.append(x)

    def column_residuals(cols: list[Tensor], ys: Tensor, *rest: Tensor) -> Tensor:
        xs = rest[-1] if per_fit else x
        mu = model(cols, xs)
        if estimator == "mle":
            return mu
        if weights is None:
            return mu - ys
        return weights.residuals(mu - ys, rest[0] if weighted else None)

    def residuals(q: Tensor, *rows: Tensor) -> Tensor:
        return column_residuals([q[:, j : j + 1] for j in range(n)], *rows)

    jac_fn = None
    if jac is not None:
        if not callable(jac):
            raise TypeError(f"jac must be None or a callable jac(xdata, *params), got {jac!r}")

        def jac_fn(q: Tensor, ys: Tensor, *rest: Tensor) -> Tensor:
            xs = rest[-1] if per_fit else x
            J = jac(xs, *[q[:, j : j + 1] for j in range(n)])
            J = J if isinstance(J, Tensor) else torch.as_tensor(J, device=q.device)
            J = check.on_device("jac", J, q.device).to(q.dtype)
            if estimator == "mle" or weights is None:
                return J
            return weights.jacobian(J, rest[0] if weighted else None)

    objective = Objective("poisson" if estimator == "mle" else "lse", loss, float(f_scale))
    check.check_loss(loss, f_scale)
    scale = check.x_scale(x_scale, b, n, dt, dev)
    check.feasible(p, lb, ub, name="p0")
    problem = BatchProblem(
        fun=residuals,
        jac=jac_fn,
        rows=tuple(rows),
        counts=y if estimator == "mle" else None,
        objective=objective,
        lb=lb,
        ub=ub,
        scale=None,
        bounded=False,
        m=m,
        n=n,
        columns=column_residuals,
    )
    res, pcov = _solve(
        problem,
        p,
        ftol=ftol,
        xtol=xtol,
        gtol=gtol,
        scale=scale,
        max_nfev=max_nfev,
        check_every=check_every,
        chunk=chunk_size,
        memory_budget=memory_budget,
        progress=progress,
        compile=compile,
        covariance=True,
        absolute_sigma=absolute_sigma or estimator == "mle",
    )
    assert pcov is not None
    return res.x, pcov.to(dt), res


def least_squares_batch(
    fun: Callable[..., Any],
    x0: Any,
    jac: Callable[..., Any] | None = None,
    bounds: Any = (-math.inf, math.inf),
    ftol: float | None = 1e-8,
    xtol: float | None = 1e-8,
    gtol: float | None = 1e-8,
    x_scale: Any = "jac",
    loss: str = "linear",
    f_scale: float = 1.0,
    max_nfev: int | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    check_every: int = 4,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    progress: Any = None,
    compile: bool = False,
) -> BatchResult:
    """Solve ``min ½Σρ(f_b(x_b)²)`` for every fit ``b``; scipy's ``least_squares`` per fit.

    ``fun(x, *args, **kwargs)`` takes ``x`` ``(B, n)`` and returns the residuals
    ``(B, m)``, row ``b`` depending on ``x[b]`` alone.  It is called with any subset of
    the fits (a chunk, or the fits not yet finished) together with the same rows of
    each of ``args``: per-fit data must come through ``args``, not a closure.  Each
    fit runs :func:`~secondorder.least_squares`' iteration; in float64 a fit's iterates
    are those of ``least_squares`` run on it alone (up to the rounding of the solves).

    Args:
        fun: the residuals of every fit, ``(B, n) -> (B, m)``, written with torch.
        x0: ``(B, n)`` starting points; its dtype and device are the computation's
            (float32 or float64; a NumPy array or sequence is float64 on the CPU).
        jac: ``jac(x, *args, **kwargs) -> (B, m, n)``; default forward-mode autodiff.
        bounds: ``(lb, ub)``, each a scalar, ``(n,)`` or ``(B, n)``.
        ftol: as :func:`curve_fit_batch`.
        xtol: as :func:`curve_fit_batch`.
        gtol: as :func:`curve_fit_batch`.
        x_scale: as :func:`curve_fit_batch`.
        loss: a robust loss, one of scipy's names.
        f_scale: the robust loss's soft margin.
        max_nfev: evaluations allowed per fit (default ``100·n``).
        args: per-fit tensors, each with ``B`` rows (sliced with ``x``).
        kwargs: shared keyword arguments of ``fun`` and ``jac``.
        check_every: attempts between two reads of the "all done?" mask.
        chunk_size: as :func:`curve_fit_batch`.
        memory_budget: as :func:`curve_fit_batch`.
        progress: as :func:`curve_fit_batch`.
        compile: as :func:`curve_fit_batch`.

    Returns:
        A :class:`BatchResult`.
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r}")
    if jac is not None and not callable(jac):
        raise TypeError(f"jac must be None or a callable jac(x, *args, **kwargs), got {jac!r}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of shared keyword arguments, got {kwargs!r}")
    kw = dict(kwargs or {})
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of per-fit tensors, got {args!r}")
    _check_options(
        ftol, xtol, gtol, max_nfev, check_every, chunk_size, memory_budget, compile, progress
    )
    dt, dev = check.dtype_device(None, None, None, x0, fix="pass x0 as float32 or float64")
    x_start = check.as_tensor("x0", x0, dt, dev)
    if x_start.ndim != 2 or x_start.shape[1] == 0:
        raise ValueError(
            f"x0 must be 2-D (B, n), one start of n > 0 parameters per fit, got shape "
            f"{tuple(x_start.shape)}"
        )
    b, n = x_start.shape
    rows = []
    for i, a in enumerate(args):
        if not isinstance(a, Tensor) or a.ndim == 0 or a.shape[0] != b:
            shape = tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__
            raise ValueError(
                f"args[{i}] must be a tensor with one row per fit (first dimension {b}), got "
                f"{shape}: per-fit data are sliced with x; pass shared data in kwargs"
            )
        rows.append(a.to(dev))
    lb, ub = check.bounds_pair(bounds, b, n, dt, dev)
    check.check_loss(loss, f_scale)
    scale = check.x_scale(x_scale, b, n, dt, dev)
    # Before the call of fun below that reads m: a refused start costs no evaluation.
    check.feasible(x_start, lb, ub, name="x0")

    def residuals(q: Tensor, *r: Tensor) -> Tensor:
        out = fun(q, *r, **kw)
        return check.on_device("fun", out, q.device) if isinstance(out, Tensor) else out

    jac_fn = None
    if jac is not None:

        def jac_fn(q: Tensor, *r: Tensor) -> Tensor:
            out = jac(q, *r, **kw)
            out = out if isinstance(out, Tensor) else torch.as_tensor(out, device=q.device)
            return check.on_device("jac", out, q.device).to(q.dtype)

    probe = fun(x_start[:1], *[r[:1] for r in rows], **kw) if b else None
    if b and not isinstance(probe, Tensor):
        raise TypeError(f"fun must return a tensor (B, m), got {type(probe).__name__}")
    m = int(probe.shape[-1]) if isinstance(probe, Tensor) and probe.ndim >= 1 else 1
    if b and probe is not None and tuple(probe.shape) != (1, m):
        raise ValueError(
            f"fun must return (B, m) residuals for x of shape (B, n); for one fit it "
            f"returned shape {tuple(probe.shape)}"
        )
    problem = BatchProblem(
        fun=residuals,
        jac=jac_fn,
        rows=tuple(rows),
        counts=None,
        objective=Objective("lse", loss, float(f_scale)),
        lb=lb,
        ub=ub,
        scale=None,
        bounded=False,
        m=m,
        n=n,
    )
    res, _ = _solve(
        problem,
        x_start,
        ftol=ftol,
        xtol=xtol,
        gtol=gtol,
        scale=scale,
        max_nfev=max_nfev,
        check_every=check_every,
        chunk=chunk_size,
        memory_budget=memory_budget,
        progress=progress,
        compile=compile,
        covariance=False,
        absolute_sigma=False,
    )
    return res


# ---------------------------------------------------------------------------------------
# The shared run


def _solve(
    problem: BatchProblem,
    p: Tensor,
    *,
    ftol: float | None,
    xtol: float | None,
    gtol: float | None,
    scale: Tensor | None,
    max_nfev: int | None,
    check_every: int,
    chunk: int | None,
    memory_budget: int | None,
    progress: Any,
    compile: bool,
    covariance: bool,
    absolute_sigma: bool,
) -> tuple[BatchResult, Tensor | None]:
    """Check the run's options, build the rule and the change of variables, run, report.

    ``p``: starts within the bounds; ``scale``: the checked ``x_scale`` (None: Moré's).
    """
    tols = _check_options(
        ftol, xtol, gtol, max_nfev, check_every, chunk, memory_budget, compile, progress
    )
    b, n = p.shape
    lo, hi = torch.isfinite(problem.lb), torch.isfinite(problem.ub)
    bounded = bool((lo | hi).any())
    problem = replace(problem, scale=scale, bounded=bounded)
    transform = problem.transform
    y0 = transform.to_y(transform.strictly_feasible(p))
    rule = BatchTrustRegion(ftol=tols[0], xtol=tols[1], gtol=tols[2], identity=scale is not None)
    budget = int(max_nfev) if max_nfev is not None else 100 * n
    # The fits count evaluations in int32 (COUNT): a larger budget would wrap around
    # to a negative one in ``budget - nfev``; it is never reached, so cap it.
    budget = min(budget, torch.iinfo(COUNT).max)
    size = chunk or fits_per_chunk(b, problem.m, n, p.dtype, p.device, memory_budget)
    if compile and chunk is None and p.device.type == "cpu":
        size = min(size, CPU_SLOTS)
    opts = RunOptions(
        budget=budget,
        damping=1e-3,
        check_every=int(check_every),
        chunk=max(1, size),
        progress=make_progress(progress, b),
        xtol_in_x=tols[1] if bounded else 0.0,
        covariance=covariance,
        absolute_sigma=absolute_sigma,
        compiled=compile,
    )
    out = run(problem, y0, rule, opts)
    statuses = out.status.tolist()
    res = BatchResult(
        x=out.x,
        cost=0.5 * out.cost2,
        fun=out.f,
        nfev=out.nfev,
        njev=out.njev,
        nit=out.nit,
        status=out.status,
        success=out.status > 0,
        message=[BATCH_MESSAGES[s] for s in statuses],
    )
    return res, out.pcov


def _check_options(
    ftol: Any,
    xtol: Any,
    gtol: Any,
    max_nfev: Any,
    check_every: Any,
    chunk: Any,
    memory_budget: Any,
    compile: Any,
    progress: Any,
) -> tuple[float, float, float]:
    """Refuse a bad run option before anything runs; the tolerances as floats."""
    tols = check.tolerances(ftol, xtol, gtol)
    check_integer("max_nfev", max_nfev, allow_none=True)
    check_integer("check_every", check_every)
    check_integer("chunk_size", chunk, allow_none=True)
    check_integer("memory_budget", memory_budget, allow_none=True)
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise TypeError(
            f"progress must be None, True/False or a callable progress(done, total), got "
            f"{progress!r}"
        )
    return tols
