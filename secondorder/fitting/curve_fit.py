r"""Curve fitting with scipy's interface: ``ydata ≈ f(xdata, *params)``.

:func:`curve_fit` has the same call and return values as
:func:`scipy.optimize.curve_fit`, so porting a fit is a change of import.  It runs on
:func:`~secondorder.fitting.least_squares` with residuals ``W (f(xdata, *p) - ydata)``,
``W = diag(1/sigma)`` or ``L⁻¹`` for a covariance ``sigma = L Lᵀ``: a model function
written with torch operations is differentiated exactly, one written with NumPy gets
finite differences.  The covariance of the result is explained in :mod:`.report`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .arrays import as_float64
from .bounds import parse_bounds
from .curve_model import (
    count_params,
    data,
    jacobian_from_arrays,
    jacobian_on_arrays,
    jacobian_on_tensors,
    residuals_on_arrays,
    residuals_on_tensors,
    runs_on_arrays,
    same_on_arrays,
    torch_friendly,
    weighting,
)
from .least_squares import least_squares
from .report import covariance, pivoted_qr

__all__ = ["curve_fit"]

METHODS = (None, "lm", "trf", "dogbox")


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
            as in scipy; otherwise least_squares' ``status``.  Types are scipy's:
            ``nfev`` an int, ``mesg`` a str, ``ier`` an int, the arrays float64
            (``ipvt`` int32) NumPy arrays, or tensors where ``popt`` is one.
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
    y, x, sigma = data(xdata, ydata, sigma, check_finite=check_finite, nan_policy=nan_policy)
    if method == "lm" and y.numel() != 1 and p.numel() > y.numel():
        raise TypeError(
            f"The number of func parameters={p.numel()} must not exceed the number of data "
            f"points={y.numel()} with method='lm' (as in scipy): pass fewer parameters or "
            "more data, or method='trf'"
        )
    weight = weighting(sigma, y.numel())
    # NumPy data keep NumPy's meanings: a model that runs on tensors is differentiated by
    # torch only where it gives the same values there (and a callable jac gets arrays).
    numpy_data = not isinstance(xdata, Tensor)
    use_torch = torch_friendly(f, x, p) and (not numpy_data or same_on_arrays(f, x, p))
    residuals: Callable[[Any], Any]
    ls_jac: str | Callable[..., Any] = "auto"
    x_start: Any
    if use_torch:
        residuals, x_start = residuals_on_tensors(f, x, y, weight), p
        if callable(jac):
            shape = (y.numel(), p.numel())
            if numpy_data and runs_on_arrays(jac, x, p):
                ls_jac = jacobian_from_arrays(jac, x, weight, shape=shape)
            else:
                ls_jac = jacobian_on_tensors(jac, x, weight, shape=shape)
        elif jac is not None:
            ls_jac = jac
    else:
        residuals, x_start = residuals_on_arrays(f, x, y, weight), p.numpy()
        if callable(jac):
            ls_jac = jacobian_on_arrays(jac, x, weight, shape=(y.numel(), p.numel()))
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
        return count_params(f)
    return _initial_parameters(f, p0, None, None).numel()


def _initial_parameters(
    f: Callable[..., Any], p0: Any, lb: Tensor | None, ub: Tensor | None
) -> Tensor:
    """``p0`` as a non-empty 1-D float64 tensor; for ``None`` a feasible point (scipy's).

    Without bounds the default is all ones; with bounds each parameter starts at the
    middle of a two-sided bound, one above a lower bound, one below an upper bound.
    """
    if p0 is None:
        p = torch.ones(count_params(f), dtype=torch.float64)
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

    def kind(t: Tensor) -> Any:
        """Tensors for a tensor ``p0``, else NumPy arrays, as for ``popt`` and ``pcov``."""
        return t if tensors else t.numpy()

    if not full_output:
        return kind(popt), kind(pcov)
    fvec = as_float64(res.fun, "fun").reshape(-1)
    fjac, ipvt, qtf = pivoted_qr(as_float64(res.jac, "jac").numpy(), fvec.numpy())
    # scipy's types: arrays (here tensors for a tensor p0), Python ints and a str.
    infodict = {
        "nfev": int(res.nfev),
        "njev": None if res.njev is None else int(res.njev),
        "fvec": kind(fvec),
        "fjac": kind(torch.from_numpy(fjac)),
        "ipvt": kind(torch.from_numpy(ipvt)),
        "qtf": kind(torch.from_numpy(qtf)),
        "result": res,
    }
    if minpack and res.status in _MINPACK_IER:
        ier, mesg = _MINPACK_IER[res.status]
        return kind(popt), kind(pcov), infodict, mesg, ier
    return kind(popt), kind(pcov), infodict, str(res.message), int(res.status)
