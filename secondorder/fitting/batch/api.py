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

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..._validation import check_choice, check_integer, check_number
from ..losses import LOSSES
from ..result import MESSAGES
from .driver import RunOptions, chunk_size, make_progress, run
from .problem import BatchProblem, Objective
from .rule import BatchTrustRegion

__all__ = ["BATCH_MESSAGES", "ESTIMATORS", "BatchResult", "curve_fit_batch", "least_squares_batch"]

ESTIMATORS = ("lse", "mle")
#: The sentence for each ``status`` of a batched fit (scipy's, and -1 for a fit whose
#: numbers stopped being finite).
BATCH_MESSAGES = {
    **MESSAGES,
    -1: "The residuals, cost or Jacobian are not finite (NaN or inf in the data, the start "
    "or the model's values).",
}
_EPS = float(np.finfo(np.float64).eps)


class BatchResult(dict[str, Any]):
    """Per-fit results of a batched fit: a dict whose keys are also attributes.

    Fields, one entry per fit (tensors on the fits' device): ``x`` ``(B, n)``, ``cost``
    (``½Σρ(f²)``; half the deviance for Poisson fits), ``fun`` ``(B, m)`` (residuals, or
    the model for Poisson fits), ``nfev``, ``njev``, ``nit``, ``status`` (scipy's: 0
    max_nfev, 1 gtol, 2 ftol, 3 xtol, 4 both; -1 not finite), ``success``
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
        ydata: ``(B, m)`` data, one row per fit (counts for ``estimator="mle"``).
        p0: ``(B, n)`` or ``(n,)`` (the same start for every fit); default ones, their
            number read from ``f``'s signature (within bounds, scipy's feasible start).
        sigma: a scalar, ``(m,)`` or ``(B, m)`` standard deviations of ``ydata``.
        absolute_sigma: ``pcov`` unscaled (``sigma`` in the data's units) or scaled by
            the reduced chi-square ``2·cost/(m - n)`` (scipy's rule).
        bounds: ``(lb, ub)``, each a scalar, ``(n,)`` or ``(B, n)``; least_squares'
            change of variables.
        jac: ``jac(xdata, p1, ..., pn) -> (B, m, n)``, the derivatives of ``f``; default
            forward-mode autodiff (one ``jvp`` per parameter, vectorised).
        estimator: ``"lse"`` (least squares) or ``"mle"`` (Poisson maximum likelihood
            for counts, Gpufit's MLE: minimises the deviance; ``pcov`` is the inverse
            Fisher information, ``Σ ∂μ∂μᵀ/μ``).
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

    Returns:
        ``(popt, pcov, info)``: ``popt`` ``(B, n)``, ``pcov`` ``(B, n, n)`` (inf where
        undetermined) and a :class:`BatchResult`.
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {f!r}")
    check_choice("estimator", estimator, ESTIMATORS)
    if not isinstance(absolute_sigma, bool):
        raise TypeError(f"absolute_sigma must be True or False, got {absolute_sigma!r}")
    dt, dev = _dtype_device(dtype, device, ydata, p0)
    y = _tensor("ydata", ydata, dt, dev)
    if y.ndim != 2 or y.shape[1] == 0:
        raise ValueError(
            f"ydata must be 2-D (B, m), one row of m > 0 points per fit, got shape {tuple(y.shape)}"
        )
    b, m = y.shape
    n = _parameter_count(f, p0)
    lb, ub = _bounds(bounds, b, n, dt, dev)
    p = _start(f, p0, b, n, lb, ub, dt, dev, name="p0")
    x = _xdata(xdata, dt, dev)
    per_fit = _per_fit(x, xdata_per_fit, b, m)
    if estimator == "mle":
        if sigma is not None:
            raise ValueError(
                f"sigma={_short(sigma)} with estimator='mle': Poisson counts have variance "
                "μ, so there are no weights to give; drop sigma, or pass estimator='lse'"
            )
        if loss != "linear":
            raise ValueError(
                f"loss={loss!r} with estimator='mle': a robust loss applies to least "
                "squares; pass loss='linear' or estimator='lse'"
            )
    inv_sigma = _inverse_sigma(sigma, b, m, dt, dev)
    model = _model(f, n, m)
    rows: list[Tensor] = [y]
    if inv_sigma is not None and inv_sigma.shape[0] == b and inv_sigma.ndim == 2:
        rows.append(inv_sigma)
        shared_w = None
    else:
        shared_w = inv_sigma
    if per_fit:
        rows.append(x)
    weighted = inv_sigma is not None and inv_sigma.ndim == 2

    def column_residuals(cols: list[Tensor], ys: Tensor, *rest: Tensor) -> Tensor:
        xs = rest[-1] if per_fit else x
        mu = model(cols, xs)
        if estimator == "mle":
            return mu
        w = rest[0] if weighted else shared_w
        return (mu - ys) if w is None else (mu - ys) * w

    def residuals(q: Tensor, *rows: Tensor) -> Tensor:
        return column_residuals([q[:, j : j + 1] for j in range(n)], *rows)

    jac_fn = None
    if jac is not None:
        if not callable(jac):
            raise TypeError(f"jac must be None or a callable jac(xdata, *params), got {jac!r}")

        def jac_fn(q: Tensor, ys: Tensor, *rest: Tensor) -> Tensor:
            xs = rest[-1] if per_fit else x
            J = jac(xs, *[q[:, j : j + 1] for j in range(n)])
            J = J if isinstance(J, Tensor) else torch.as_tensor(J)
            J = J.to(q.dtype)
            if estimator == "mle":
                return J
            w = rest[0] if weighted else shared_w
            return J if w is None else J * (w if w.ndim == 0 else w.reshape(-1, m))[..., None]

    objective = Objective("poisson" if estimator == "mle" else "lse", loss, float(f_scale))
    _check_loss(loss, f_scale)
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
        x_scale=x_scale,
        max_nfev=max_nfev,
        check_every=check_every,
        chunk=chunk_size,
        memory_budget=memory_budget,
        progress=progress,
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
    dt, dev = _dtype_device(None, None, None, x0)
    x_start = _tensor("x0", x0, dt, dev)
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
    lb, ub = _bounds(bounds, b, n, dt, dev)
    _check_loss(loss, f_scale)

    def residuals(q: Tensor, *r: Tensor) -> Tensor:
        out: Tensor = fun(q, *r, **kw)
        return out

    jac_fn = None
    if jac is not None:

        def jac_fn(q: Tensor, *r: Tensor) -> Tensor:
            out = jac(q, *r, **kw)
            return (out if isinstance(out, Tensor) else torch.as_tensor(out)).to(q.dtype)

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
        x_scale=x_scale,
        max_nfev=max_nfev,
        check_every=check_every,
        chunk=chunk_size,
        memory_budget=memory_budget,
        progress=progress,
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
    x_scale: Any,
    max_nfev: int | None,
    check_every: int,
    chunk: int | None,
    memory_budget: int | None,
    progress: Any,
    covariance: bool,
    absolute_sigma: bool,
) -> tuple[BatchResult, Tensor | None]:
    """Check the run's options, build the rule and the change of variables, run, report."""
    tols = _tolerances(ftol, xtol, gtol)
    check_integer("max_nfev", max_nfev, allow_none=True)
    check_integer("check_every", check_every)
    check_integer("chunk_size", chunk, allow_none=True)
    check_integer("memory_budget", memory_budget, allow_none=True)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise TypeError(
            f"progress must be None, True/False or a callable progress(done, total), got "
            f"{progress!r}"
        )
    b, n = p.shape
    scale = _x_scale(x_scale, b, n, p.dtype, p.device)
    lo, hi = torch.isfinite(problem.lb), torch.isfinite(problem.ub)
    bounded = bool((lo | hi).any())
    _feasible(p, problem.lb, problem.ub)
    problem = _with_transform(problem, scale, bounded)
    transform = problem.transform
    y0 = transform.to_y(transform.strictly_feasible(p))
    rule = BatchTrustRegion(ftol=tols[0], xtol=tols[1], gtol=tols[2], identity=scale is not None)
    budget = int(max_nfev) if max_nfev is not None else 100 * n
    size = chunk or chunk_size(b, problem.m, n, p.dtype, p.device, memory_budget)
    opts = RunOptions(
        budget=budget,
        damping=1e-3,
        check_every=int(check_every),
        chunk=max(1, size),
        progress=make_progress(progress, b),
        xtol_in_x=tols[1] if bounded else 0.0,
        covariance=covariance,
        absolute_sigma=absolute_sigma,
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


def _with_transform(problem: BatchProblem, scale: Tensor | None, bounded: bool) -> BatchProblem:
    from dataclasses import replace

    return replace(problem, scale=scale, bounded=bounded)


# ---------------------------------------------------------------------------------------
# Checking the call


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dtype_device(
    dtype: torch.dtype | None, device: Any, ydata: Any, p0: Any
) -> tuple[torch.dtype, torch.device]:
    """The computation's dtype and device: given, else the data's, else float64 on the CPU."""
    if dtype is not None and dtype not in (torch.float32, torch.float64):
        raise ValueError(f"Invalid dtype={dtype!r}: must be torch.float32 or torch.float64.")
    source = next((t for t in (ydata, p0) if isinstance(t, Tensor) and t.is_floating_point()), None)
    if dtype is None:
        dtype = source.dtype if source is not None else torch.float64
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"the data's dtype {dtype} is not supported: pass float32 or float64 "
                "tensors, or dtype=torch.float32 / torch.float64"
            )
    try:
        dev = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"Invalid device={device!r}: {exc}") from None
    if dev is None:
        dev = source.device if source is not None else torch.device("cpu")
    return dtype, dev


def _tensor(name: str, value: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        if value.is_complex():
            raise ValueError(f"{name} must be real, got a complex tensor")
        return value.detach().to(device=device, dtype=dtype)
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of numbers, got {_short(value)}") from exc
    return torch.as_tensor(arr, dtype=dtype, device=device)


def _xdata(xdata: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``xdata`` as a tensor on the fits' device when it is numeric, else as given."""
    if isinstance(xdata, Tensor):
        return xdata.detach().to(device=device, dtype=dtype)
    if isinstance(xdata, (np.ndarray, list, tuple, int, float)):
        try:
            return torch.as_tensor(np.asarray(xdata, dtype=np.float64), dtype=dtype, device=device)
        except (TypeError, ValueError):
            return xdata
    return xdata


def _per_fit(x: Any, flag: bool | None, b: int, m: int) -> bool:
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"xdata_per_fit must be None, True or False, got {flag!r}")
    leading = isinstance(x, Tensor) and x.ndim >= 2 and tuple(x.shape[:2]) == (b, m)
    if flag is None:
        return leading
    if flag and not leading:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"xdata_per_fit=True needs xdata of shape (B, m, ...) = ({b}, {m}, ...), got {shape}"
        )
    return flag


def _parameter_count(f: Callable[..., Any], p0: Any) -> int:
    if p0 is not None:
        shape = tuple(p0.shape) if isinstance(p0, Tensor) else np.shape(p0)
        if len(shape) not in (1, 2) or shape[-1] == 0:
            raise ValueError(f"p0 must be (n,) or (B, n) with n > 0 parameters, got shape {shape}")
        return int(shape[-1])
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        raise ValueError(
            "p0 is None and the number of parameters of f cannot be read from its "
            "signature; pass p0"
        ) from None
    params = [
        p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) < 2:
        raise ValueError(
            f"p0 is None and f{sig} takes no parameters after x; pass p0 or write f(x, p1, p2, ...)"
        )
    return len(params) - 1


def _start(
    f: Callable[..., Any],
    p0: Any,
    b: int,
    n: int,
    lb: Tensor,
    ub: Tensor,
    dtype: torch.dtype,
    device: torch.device,
    *,
    name: str,
) -> Tensor:
    """``(B, n)`` starts: ``p0`` broadcast, or scipy's default (ones; feasible in bounds)."""
    if p0 is None:
        p = torch.ones(b, n, dtype=dtype, device=device)
        lo, hi = torch.isfinite(lb), torch.isfinite(ub)
        p = torch.where(lo & hi, 0.5 * (lb + ub), p)
        p = torch.where(lo & ~hi, lb + 1, p)
        return torch.where(~lo & hi, ub - 1, p)
    p = _tensor(name, p0, dtype, device)
    if p.ndim == 1:
        p = p.expand(b, n)
    if p.shape != (b, n):
        raise ValueError(f"{name} must be (n,) or (B, n) = ({b}, {n}), got {tuple(p.shape)}")
    return p.clone()


def _bounds(
    bounds: Any, b: int, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(lb, ub)`` as ``(B, n)`` tensors; each side a scalar, ``(n,)`` or ``(B, n)``."""
    if bounds is None:
        bounds = (-math.inf, math.inf)
    if hasattr(bounds, "lb") and hasattr(bounds, "ub"):  # scipy.optimize.Bounds
        bounds = (bounds.lb, bounds.ub)
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"bounds must be a pair (lb, ub), got {_short(bounds)}")
    sides = []
    for side, value in zip(("lb", "ub"), bounds, strict=True):
        t = _tensor(f"bounds {side}", value, dtype, device)
        if t.ndim == 0 or t.shape in ((n,), (b, n)):
            t = t.expand(b, n)
        else:
            raise ValueError(
                f"bounds {side} must be a scalar, ({n},) or ({b}, {n}), got {tuple(t.shape)}"
            )
        if bool(torch.isnan(t).any()):
            raise ValueError(f"bounds {side} contains NaN")
        sides.append(t)
    lb, ub = sides
    if bool((lb >= ub).any()):
        raise ValueError(
            "Each lower bound must be strictly less than each upper bound (bounds lb >= ub "
            "somewhere): pass lb < ub"
        )
    return lb, ub


def _feasible(p: Tensor, lb: Tensor, ub: Tensor) -> None:
    outside = (p < lb) | (p > ub)
    if bool(outside.any()):
        fit = int(torch.nonzero(outside.any(-1))[0])
        raise ValueError(
            f"p0 is outside the bounds for fit {fit}: p0={p[fit].tolist()}, lb={lb[fit].tolist()}"
            f", ub={ub[fit].tolist()}; pass starts within the bounds"
        )


def _inverse_sigma(
    sigma: Any, b: int, m: int, dtype: torch.dtype, device: torch.device
) -> Tensor | None:
    if sigma is None:
        return None
    s = _tensor("sigma", sigma, dtype, device)
    if s.shape not in ((), (1,), (m,), (b, m)):
        raise ValueError(
            f"sigma must be a scalar, ({m},) or ({b}, {m}) standard deviations, got shape "
            f"{tuple(s.shape)}"
        )
    if bool((s <= 0).any()):
        raise ValueError(
            "sigma must be > 0 everywhere (standard deviations of ydata); a fit with a "
            "NaN sigma fails alone, a zero or negative one is refused"
        )
    return (1.0 / s).reshape(()) if s.numel() == 1 and s.shape != (b, m) else 1.0 / s


def _check_loss(loss: Any, f_scale: Any) -> None:
    if not isinstance(loss, str):
        raise TypeError(
            f"loss must be one of {LOSSES} for batched fits (a callable loss runs on NumPy, "
            f"one fit at a time), got {loss!r}"
        )
    check_choice("loss", loss, LOSSES)
    check_number("f_scale", f_scale, above=0, type_error=False)


def _tolerances(ftol: Any, xtol: Any, gtol: Any) -> tuple[float, float, float]:
    values = {"ftol": ftol, "xtol": xtol, "gtol": gtol}
    for name, tol in values.items():
        if tol is not None:
            check_number(name, tol, at_least=0, type_error=False)
    tols = tuple(float(v or 0.0) for v in values.values())
    if all(t < _EPS for t in tols):
        raise ValueError(
            f"At least one of the tolerances must be higher than machine epsilon "
            f"({_EPS:.2e}), got ftol={ftol!r}, xtol={xtol!r}, gtol={gtol!r}: without one "
            "the iteration would stop only on max_nfev"
        )
    return tols[0], tols[1], tols[2]


def _x_scale(
    x_scale: Any, b: int, n: int, dtype: torch.dtype, device: torch.device
) -> Tensor | None:
    """``None`` for ``"jac"`` (Moré's scaling), else the ``(B, n)`` fixed scales."""
    if isinstance(x_scale, str):
        if x_scale == "jac":
            return None
        raise ValueError(
            f"Invalid x_scale={x_scale!r}: must be 'jac' or positive numbers (a scalar, (n,) "
            "or (B, n))."
        )
    s = _tensor("x_scale", x_scale, dtype, device)
    if s.ndim == 0 or s.shape in ((n,), (b, n)):
        s = s.expand(b, n)
    else:
        raise ValueError(
            f"x_scale must be 'jac', a scalar, ({n},) or ({b}, {n}), got {tuple(s.shape)}"
        )
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(f"Invalid x_scale={_short(x_scale)}: must be finite and > 0 everywhere.")
    return s.clone()


def _model(f: Callable[..., Any], n: int, m: int) -> Callable[[list[Tensor], Any], Tensor]:
    """``(columns, xs) -> f(xs, *columns)`` as ``(B, m)``, each column ``(B, 1)``."""

    def call(cols: list[Tensor], xs: Any) -> Tensor:
        out = f(xs, *cols)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"f must return a tensor (write it with torch operations), got {type(out).__name__}"
            )
        want = (cols[0].shape[0], m)
        try:
            return torch.broadcast_to(out, want)
        except RuntimeError:
            raise ValueError(
                f"f returned shape {tuple(out.shape)} for {want[0]} fits; expected (B, m) = "
                f"{want}, or a shape that broadcasts to it (parameters come as (B, 1) columns)"
            ) from None

    return call
