r"""Curve fitting with scipy's interface: ``ydata ≈ f(xdata, *params)``.

:func:`curve_fit` has the same call and return values as
:func:`scipy.optimize.curve_fit`, so porting a fit is a change of import.  It runs on
:func:`~secondorder.fitting.least_squares` with residuals ``W (f(xdata, *p) - ydata)``,
``W = diag(1/sigma)`` or ``L⁻¹`` for a covariance ``sigma = L Lᵀ``: a model function
written with torch operations is differentiated exactly, one written with NumPy gets
finite differences.  The covariance of the result is explained in :mod:`.report`, whose
:func:`covariance`, :func:`standard_errors`, :func:`correlation` and :func:`fit_report`
are importable from here too (the old module path).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .arrays import as_float64
from .bounds import parse_bounds
from .least_squares import least_squares
from .report import (
    FitReport,
    correlation,
    covariance,
    fit_report,
    pivoted_qr,
    standard_errors,
)

__all__ = [
    "FitReport",
    "correlation",
    "covariance",
    "curve_fit",
    "fit_report",
    "standard_errors",
]

METHODS = (None, "lm", "trf", "dogbox")

Weight = Callable[[Tensor], Tensor]


def curve_fit(
    f: Callable[..., Any],
    xdata: Any,
    ydata: Any,
    p0: Any = None,
    sigma: Any = None,
    absolute_sigma: bool = False,
    check_finite: bool | None = None,
    bounds: Any = None,
    method: str | None = None,
    jac: str | Callable[..., Any] | None = None,
    *,
    full_output: bool = False,
    nan_policy: str | None = None,
    **kwargs: Any,
) -> tuple[Any, ...]:
    """Fit ``ydata ≈ f(xdata, *params)``; scipy.optimize.curve_fit's call and return values.

    Minimises ``Σ ((f(xdata, *p) - ydata) / sigma)²`` by Levenberg-Marquardt
    (:func:`~secondorder.fitting.least_squares`) and returns the optimal parameters and their
    covariance (see :func:`covariance` for its meaning)::

        def decay(t, a, k):
            return a * torch.exp(-k * t)   # or np.exp: NumPy works too

        popt, pcov = so.curve_fit(decay, t, y, p0=[1.0, 0.1])
        perr = np.sqrt(np.diag(pcov))

    A model written with torch operations is differentiated exactly (forward mode), or
    by the finite differences ``jac`` names; one written with NumPy gets finite
    differences.  One call of ``f`` with tensors decides which it is.

    (Over 80 lines only because this docstring lists scipy's arguments; the body is a
    sequence of named steps.)

    Args:
        f: ``f(x, p1, ..., pn)`` returning predictions with ``ydata``'s size.
        xdata: the independent variable, passed to ``f`` as given (converted to a
            float64 tensor or array when it is numeric).
        ydata: the data, ``m`` values, or a scalar that ``f``'s output is compared
            with elementwise (scipy's broadcast).
        p0: initial parameters (default all ones, their number read from ``f``'s
            signature; with bounds, a feasible point as scipy picks it: the middle of
            two-sided bounds, one inside a one-sided bound).  A tensor ``p0`` makes
            ``popt`` and ``pcov`` tensors.
        sigma: a scalar or ``m`` standard deviations of ``ydata`` (residuals are
            divided by them), or an ``(m, m)`` covariance matrix of ``ydata``
            (residuals are whitened by its Cholesky factor).
        absolute_sigma: ``True`` when ``sigma`` is in the data's units, so ``pcov`` is
            ``(JᵀJ)⁻¹`` unscaled; ``False`` scales it by the reduced chi-square.
        check_finite: refuse NaN or inf in the data (default ``True``, ``False`` when
            a ``nan_policy`` is given).
        bounds: ``(lb, ub)`` or a ``scipy.optimize.Bounds``.
        method: ``"lm"``, ``"trf"``, ``"dogbox"`` or ``None`` (scipy's: "lm" without
            bounds, else "trf"; "trf" also when a robust ``loss`` is passed), with
            :func:`~secondorder.fitting.least_squares`'s meaning: all run secondorder's LM, and
            "lm" refuses bounds and more parameters than data points, as scipy does.
        jac: ``None`` (exact derivatives for a torch ``f``), ``"2-point"``,
            ``"3-point"``, ``"cs"``, or ``jac(x, p1, ..., pn) -> (m, n)`` of ``f``.
        full_output: also return ``infodict``, ``mesg`` and ``ier``.  ``infodict`` has
            scipy's ``nfev`` and ``fvec`` and MINPACK's ``fjac``, ``ipvt`` and ``qtf``
            (see :func:`pivoted_qr`), plus ``njev`` and ``result`` (the full
            :class:`~secondorder.fitting.OptimizeResult`, for :func:`fit_report`).
            With method "lm" ``ier`` is MINPACK's (1: ftol, 2: xtol, 3: both, 4: gtol)
            as in scipy; otherwise least_squares' ``status``.
        nan_policy: ``None``; ``"raise"`` (NaN in the data raises); ``"omit"`` (points
            where ``xdata`` or ``ydata`` is NaN are dropped, with their ``sigma``);
            ``"propagate"`` is refused, as scipy refuses it.
        **kwargs: passed to :func:`~secondorder.fitting.least_squares` (``ftol``, ``xtol``,
            ``gtol``, ``max_nfev``, ``loss``, ``f_scale``, ``x_scale``, ``diff_step``,
            ...); scipy's ``maxfev`` is read as ``max_nfev``.  Not ``args`` or
            ``kwargs``: ``f`` takes its parameters only, nor leastsq's ``epsfcn``,
            ``diag``, ``factor`` or ``col_deriv`` (the error says what to pass instead).

    Returns:
        ``(popt, pcov)``, or ``(popt, pcov, infodict, mesg, ier)`` with
        ``full_output=True``.

    Raises:
        RuntimeError: when the solver stops on its evaluation budget, as scipy's does.
    """
    kwargs = _check_call(f, method, nan_policy, absolute_sigma, kwargs)
    lb, ub = parse_bounds(bounds, _parameter_count(f, p0))
    p = _initial_parameters(f, p0, lb, ub)
    method = _method(method, lb, ub, kwargs)
    y, x, sigma = _data(xdata, ydata, sigma, check_finite=check_finite, nan_policy=nan_policy)
    if method == "lm" and y.numel() != 1 and p.numel() > y.numel():
        raise TypeError(
            f"The number of func parameters={p.numel()} must not exceed the number of data "
            f"points={y.numel()} with method='lm' (as in scipy): pass fewer parameters or "
            "more data, or method='trf'"
        )
    weight = _weighting(sigma, y.numel())
    use_torch = _torch_friendly(f, x, p)
    residuals: Callable[[Any], Any]
    ls_jac: str | Callable[..., Any] = "auto"
    x_start: Any
    if use_torch:
        residuals, x_start = _torch_residuals(f, x, y, weight), p
        if callable(jac):
            ls_jac = _torch_jacobian(jac, x, weight, shape=(y.numel(), p.numel()))
        elif jac is not None:
            ls_jac = jac
    else:
        residuals, x_start = _numpy_residuals(f, x, y, weight), p.numpy()
        if callable(jac):
            ls_jac = _numpy_jacobian(jac, x, weight, shape=(y.numel(), p.numel()))
        elif jac is not None:
            ls_jac = jac
    res = least_squares(residuals, x_start, jac=ls_jac, bounds=(lb, ub), method=method, **kwargs)
    return _outputs(
        res,
        absolute_sigma=absolute_sigma,
        tensors=isinstance(p0, Tensor),
        full_output=full_output,
        minpack=method == "lm",
    )


# ---------------------------------------------------------------------------------------
# Checking the call and reading the data


#: scipy's leastsq keywords (its curve_fit passes them on with method="lm"), and what
#: to pass to least_squares instead.
_MINPACK_ONLY = {
    "epsfcn": "pass diff_step=sqrt(epsfcn) (the relative step of finite differences)",
    "diag": "pass x_scale=1/diag (MINPACK's diag multiplies the parameters)",
    "factor": "there is none (the first trust region is MINPACK's, with factor 10); leave it out",
    "col_deriv": "return the Jacobian from jac with one row per data point",
}


def _check_call(
    f: Callable[..., Any],
    method: str | None,
    nan_policy: str | None,
    absolute_sigma: bool,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Check the options scipy has and least_squares does not; map ``maxfev``."""
    if not callable(f):
        raise TypeError(f"f must be callable, got {f!r}")
    if method not in METHODS:
        raise ValueError(f"Unknown method={method!r}; valid choices are {METHODS}.")
    if nan_policy == "propagate":
        raise ValueError(
            "`nan_policy='propagate'` is not supported by this function (as in scipy): NaN "
            "data would make every residual NaN; pass nan_policy='omit' to drop those points"
        )
    if nan_policy not in (None, "raise", "omit"):
        raise ValueError(f"nan_policy must be one of {{None, 'raise', 'omit'}}, got {nan_policy!r}")
    if not isinstance(absolute_sigma, bool):
        raise TypeError(f"absolute_sigma must be True or False, got {absolute_sigma!r}")
    for name in ("args", "kwargs"):
        if name in kwargs:
            raise ValueError(
                f"'{name}' is not a supported keyword argument of curve_fit (as in scipy): f "
                f"is called as f(xdata, *params), got {name}={kwargs[name]!r}; bind extra "
                "arguments with functools.partial or a lambda"
            )
    for name, instead in _MINPACK_ONLY.items():
        if name in kwargs:
            raise TypeError(
                f"curve_fit got {name}={kwargs[name]!r}, a keyword of scipy's leastsq "
                f"(method='lm'), which least_squares does not take: {instead}"
            )
    if "maxfev" in kwargs:
        kwargs.setdefault("max_nfev", kwargs.pop("maxfev"))
    if "bounds" in kwargs or "method" in kwargs:  # pragma: no cover - named parameters
        raise AssertionError("bounds and method are parameters of curve_fit")
    return kwargs


def _method(method: str | None, lb: Tensor, ub: Tensor, kwargs: dict[str, Any]) -> str:
    """Scipy's choice for ``method=None``: "lm" unless bounds (or a robust loss) need "trf"."""
    bounded = bool((torch.isfinite(lb) | torch.isfinite(ub)).any())
    if method == "lm" and bounded:
        raise ValueError(
            "Method 'lm' only works for unconstrained problems (as in scipy): use 'trf' or "
            "'dogbox' with bounds, or drop bounds"
        )
    if method is not None:
        return method
    robust = kwargs.get("loss", "linear") != "linear"
    return "trf" if bounded or robust else "lm"


def _parameter_count(f: Callable[..., Any], p0: Any) -> int:
    """How many parameters: ``p0``'s size, else read from ``f``'s signature."""
    if p0 is None:
        return _count_params(f)
    return _initial_parameters(f, p0, None, None).numel()


def _count_params(f: Callable[..., Any]) -> int:
    """Parameters of ``f(x, p1, p2, ...)``, for ``p0=None`` (scipy's rule)."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            "p0 is None and the number of parameters of f cannot be read from its "
            "signature; pass p0"
        ) from exc
    args = [
        p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(args) < 2:
        raise ValueError(
            f"p0 is None and f{sig} takes no parameters after x; pass p0 or write f(x, p1, p2, ...)"
        )
    return len(args) - 1


def _initial_parameters(
    f: Callable[..., Any], p0: Any, lb: Tensor | None, ub: Tensor | None
) -> Tensor:
    """``p0`` as a non-empty 1-D float64 tensor; for ``None`` a feasible point (scipy's).

    Without bounds the default is all ones; with bounds each parameter starts at the
    middle of a two-sided bound, one above a lower bound, one below an upper bound.
    """
    if p0 is None:
        p = torch.ones(_count_params(f), dtype=torch.float64)
        if lb is not None and ub is not None:
            lo, hi = torch.isfinite(lb), torch.isfinite(ub)
            p = torch.where(lo & hi, 0.5 * (lb + ub), p)
            p = torch.where(lo & ~hi, lb + 1, p)
            p = torch.where(~lo & hi, ub - 1, p)
        return p
    p = as_float64(p0, "p0")
    if p.ndim == 0:
        p = p.reshape(1)
    if p.ndim != 1 or p.numel() == 0:
        raise ValueError(f"p0 must be a non-empty 1-D sequence, got shape {tuple(p.shape)}")
    return p


def _data(
    xdata: Any, ydata: Any, sigma: Any, *, check_finite: bool | None, nan_policy: str | None
) -> tuple[Tensor, Any, Any]:
    """``(y, x, sigma)``: ``ydata`` flat float64; ``xdata`` float64 when numeric.

    ``check_finite`` defaults to ``True``, or ``False`` when a ``nan_policy`` is given
    (scipy's rule); ``nan_policy="omit"`` drops the points where ``xdata`` (along its
    last axis) or ``ydata`` is NaN, and the matching entries of ``sigma``.
    """
    y = as_float64(ydata, "ydata").reshape(-1)
    if y.numel() == 0:
        raise ValueError("ydata must not be empty")
    finite_check = check_finite if check_finite is not None else nan_policy is None
    if finite_check and not bool(torch.isfinite(y).all()):
        raise ValueError(
            "ydata contains NaN or inf (check_finite=True): clean the data, or pass "
            "nan_policy='omit' to drop NaN points"
        )
    x: Any = xdata
    if isinstance(xdata, (Tensor, np.ndarray, list, tuple, int, float)):
        try:
            x = as_float64(xdata, "xdata")
        except TypeError:
            x = xdata
        if isinstance(x, Tensor) and finite_check and not bool(torch.isfinite(x).all()):
            raise ValueError(
                "xdata contains NaN or inf (check_finite=True): clean the data, or pass "
                "nan_policy='omit' to drop NaN points"
            )
    if nan_policy is None:
        return y, x, sigma
    x_nan = torch.zeros_like(y, dtype=torch.bool)
    if isinstance(x, Tensor) and x.ndim >= 1 and x.shape[-1] == y.numel():
        x_nan = torch.isnan(x).reshape(-1, y.numel()).any(0)
    nan = x_nan | torch.isnan(y)
    if nan_policy == "raise":
        if bool(nan.any()):
            raise ValueError(
                f"The input contains nan values ({int(nan.sum())} points, nan_policy='raise'): "
                "clean the data, or pass nan_policy='omit' to drop them"
            )
        return y, x, sigma
    keep = ~nan
    if isinstance(x, Tensor) and x.ndim >= 1 and x.shape[-1] == y.numel():
        x = x[..., keep]
    if sigma is not None:
        s = as_float64(sigma, "sigma")
        if s.shape == (y.numel(),):
            sigma = s[keep]
        elif s.shape == (y.numel(), y.numel()):
            sigma = s[keep][:, keep]
    return y[keep], x, sigma


def _weighting(sigma: Any, m: int) -> Weight:
    """``r ↦ W r``: identity, ``r / sigma`` for a scalar or ``m`` deviations, ``L⁻¹ r``."""
    if sigma is None:
        return _unweighted
    s = as_float64(sigma, "sigma")
    if s.numel() == 1 or s.shape == (m,):
        s = s.reshape(-1)
        if not bool((torch.isfinite(s) & (s > 0)).all()):
            raise ValueError("sigma must be finite and > 0 everywhere")
        inv = 1.0 / s

        def diagonal(r: Tensor) -> Tensor:
            return r * inv.to(r.dtype)

        return diagonal
    if s.shape == (m, m):
        L, info = torch.linalg.cholesky_ex(s)
        if int(info) != 0:
            raise ValueError(
                "sigma, given as an (m, m) covariance matrix, must be symmetric positive definite"
            )

        def whiten(r: Tensor) -> Tensor:
            return torch.linalg.solve_triangular(L.to(r.dtype), r.reshape(-1, 1), upper=False)[:, 0]

        return whiten
    raise ValueError(
        f"sigma must be a scalar or have shape ({m},) or ({m}, {m}) to match ydata, got "
        f"{tuple(s.shape)}"
    )


def _unweighted(r: Tensor) -> Tensor:
    return r


# ---------------------------------------------------------------------------------------
# The residuals least_squares minimises


def _torch_friendly(f: Callable[..., Any], x: Any, p: Tensor) -> bool:
    """Whether ``f`` accepts tensors and can be differentiated by torch.func.

    A function written with NumPy either fails on tensors, returns an array, or makes
    NumPy warn about tensors; any of these sends it down the finite-difference path.
    One call of ``f`` decides (a forward-mode derivative, which also runs the values).
    """

    def values(q: Tensor) -> tuple[Tensor, Tensor]:
        out = f(x, *q.unbind(0))
        if not isinstance(out, Tensor):
            raise TypeError("not a tensor")
        return out, out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.func.jacfwd(values, has_aux=True)(p)
        except Exception:
            return False
    # NumPy ufuncs applied to tensors return tensors but warn about ``__array_wrap__``.
    return not any("__array" in str(w.message) for w in caught)


def _torch_residuals(f: Callable[..., Any], x: Any, y: Tensor, weight: Weight) -> Any:
    """``q ↦ W (f(x, *q) - y)`` on tensors, differentiable by torch.func."""
    m = y.numel()

    def check(pred: Any) -> Tensor:
        t = pred if isinstance(pred, Tensor) else as_float64(pred, "f(xdata, *p)")
        t = t.reshape(-1).to(torch.complex128 if t.is_complex() else torch.float64)
        if t.numel() != m and m != 1:
            raise ValueError(
                f"f(xdata, *p) returned {t.numel()} values but ydata has {m}; they must match"
            )
        return t

    def residuals(q: Tensor) -> Tensor:
        return weight(check(f(x, *q.unbind(0))) - y)

    return residuals


def _numpy_residuals(f: Callable[..., Any], x: Any, y: Tensor, weight: Weight) -> Any:
    """``q ↦ W (f(x, *q) - y)`` on NumPy arrays (``x`` passed as an array when numeric)."""
    m = y.numel()
    x_np = x.numpy() if isinstance(x, Tensor) else x
    y_np = y.numpy()

    def residuals(q: Any) -> Any:
        raw = np.asarray(f(x_np, *q))
        # A complex q is jac="cs" probing f at x + ih: keep the imaginary part.
        pred = raw.reshape(-1).astype(np.complex128 if np.iscomplexobj(raw) else np.float64)
        if pred.size != m and m != 1:
            raise ValueError(
                f"f(xdata, *p) returned {pred.size} values but ydata has {m}; they must match"
            )
        return weight(torch.from_numpy(pred - y_np)).numpy()

    return residuals


def _numpy_jacobian(
    jac: Callable[..., Any], x: Any, weight: Weight, *, shape: tuple[int, int]
) -> Callable[[Any], Any]:
    """``q ↦ W·jac(x, *q)``: the user's Jacobian of ``f``, weighted like the residuals."""
    x_np = x.numpy() if isinstance(x, Tensor) else x
    weighted = _weighted_jacobian(jac, weight, shape)

    def call(q: Any) -> Any:
        return weighted(jac(x_np, *q)).numpy()

    return call


def _torch_jacobian(
    jac: Callable[..., Any], x: Any, weight: Weight, *, shape: tuple[int, int]
) -> Callable[[Tensor], Tensor]:
    """``q ↦ W·jac(x, *q)`` for a torch ``f``: ``jac`` gets tensors, as ``f`` does."""
    weighted = _weighted_jacobian(jac, weight, shape)

    def call(q: Tensor) -> Tensor:
        return weighted(jac(x, *q.unbind(0)))

    return call


def _weighted_jacobian(
    jac: Callable[..., Any], weight: Weight, shape: tuple[int, int]
) -> Callable[[Any], Tensor]:
    m, n = shape

    def weighted(raw: Any) -> Tensor:
        J = as_float64(raw, "jac(xdata, *p)")
        if J.ndim != 2 or J.shape[1] != n or (J.shape[0] != m and m != 1):
            raise ValueError(f"jac(xdata, *p) must return shape ({m}, {n}), got {tuple(J.shape)}")
        return torch.stack([weight(J[:, j]) for j in range(n)], dim=1)

    return weighted


#: least_squares' status -> (MINPACK's ``ier``, its meaning), which scipy's curve_fit
#: returns with method="lm".
_MINPACK_IER = {
    1: (4, "gtol: every column of the Jacobian is within gtol of orthogonal to the residuals"),
    2: (
        1,
        "ftol: the actual and predicted relative reductions of the sum of squares are at most ftol",
    ),
    3: (2, "xtol: the relative change between the last two iterates is at most xtol"),
    4: (3, "ftol and xtol: both the reduction and the step tests hold"),
}


def _outputs(
    res: Any, *, absolute_sigma: bool, tensors: bool, full_output: bool, minpack: bool = False
) -> tuple[Any, ...]:
    """The return values of scipy's ``curve_fit``; a failed fit raises ``RuntimeError`` as there.

    With ``minpack`` (method "lm") ``ier`` and ``mesg`` are MINPACK's, as scipy's
    ``leastsq`` reports them (``ier`` 1: ftol, 2: xtol, 3: both, 4: gtol); otherwise
    least_squares' ``status`` and ``message``.
    """
    if not res.success:
        raise RuntimeError(f"Optimal parameters not found: {res.message}")
    popt = as_float64(res.x, "popt")
    pcov = as_float64(covariance(res, absolute_sigma=absolute_sigma), "pcov")
    out_popt = popt if tensors else popt.numpy()
    out_pcov = pcov if tensors else pcov.numpy()
    if not full_output:
        return out_popt, out_pcov
    fjac, ipvt, qtf = pivoted_qr(
        as_float64(res.jac, "jac").numpy(), as_float64(res.fun, "fun").numpy()
    )
    infodict = {
        "nfev": res.nfev,
        "njev": res.njev,
        "fvec": res.fun,
        "fjac": fjac,
        "ipvt": ipvt,
        "qtf": qtf,
        "result": res,
    }
    if minpack and res.status in _MINPACK_IER:
        ier, mesg = _MINPACK_IER[res.status]
        return out_popt, out_pcov, infodict, mesg, ier
    return out_popt, out_pcov, infodict, res.message, res.status
