r"""Curve fitting with scipy's interface, parameter uncertainties and printable fit reports.

:func:`curve_fit` fits ``ydata ≈ f(xdata, *params)`` with the same call and return
values as :func:`scipy.optimize.curve_fit`, so porting a fit is a change of import.
It runs on :func:`secondorder.least_squares`: a model function written with torch
operations is differentiated exactly, one written with NumPy gets finite differences.

The uncertainty of the fitted parameters comes from the linearisation at the
solution.  Near the minimum the residuals are ``r(p) ≈ r(p̂) + J (p - p̂)``, and if the
(weighted) data have independent errors of variance ``s²`` the estimate ``p̂`` has the
covariance

.. math:: \operatorname{cov}(\hat p) = s^2 (J^\top J)^{-1}.

When ``sigma`` holds the true standard deviations of the data (``absolute_sigma=True``)
the weighted residuals have unit variance and ``s² = 1``.  Otherwise ``sigma`` is only
relative (or absent) and ``s²`` is estimated from the scatter about the fit, the
reduced chi-square ``s² = Σ r² / (m - n) = 2·cost / (m - n)`` with ``m`` residuals and
``n`` parameters.  That is the scaling scipy's ``curve_fit`` and lmfit use, so
:func:`covariance` agrees with both.

:func:`covariance`, :func:`standard_errors` and :func:`correlation` work on any
:class:`~secondorder.least_squares.OptimizeResult`; :func:`fit_report` gathers them
into a :class:`FitReport` whose ``str`` is a table of parameters ± errors, the strong
correlations, the cost, the evaluations and the termination message.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .least_squares import OptimizeResult, least_squares

__all__ = [
    "FitReport",
    "correlation",
    "covariance",
    "curve_fit",
    "fit_report",
    "standard_errors",
]

_METHODS = (None, "lm", "trf", "dogbox")


# ---------------------------------------------------------------------------------------
# Uncertainties from a least-squares result


def _as_tensor(a: Any, name: str) -> Tensor:
    if isinstance(a, Tensor):
        return a.detach().to(torch.float64)
    try:
        return torch.as_tensor(np.asarray(a, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of numbers, got {a!r}") from exc


def _like(t: Tensor, template: Any) -> Any:
    """``t`` as a tensor when ``template`` is one, else as a NumPy array."""
    return t if isinstance(template, Tensor) else t.numpy()


def _unscaled_covariance(J: Tensor) -> Tensor:
    """``(JᵀJ)⁻¹`` through the SVD of J, dropping directions J cannot see.

    Singular values below ``eps·max(m, n)·s_max`` are treated as zero (a
    pseudo-inverse), so a parameter the data do not determine gets no spurious,
    astronomically large covariance from round-off; this is also scipy's rule.
    """
    _, s, Vh = torch.linalg.svd(J, full_matrices=False)
    if s.numel() == 0 or float(s[0]) == 0.0:
        return torch.zeros(J.shape[1], J.shape[1], dtype=J.dtype)
    keep = s > torch.finfo(J.dtype).eps * max(J.shape) * s[0]
    s, Vh = s[keep], Vh[keep]
    return (Vh.T / s**2) @ Vh


def covariance(res: OptimizeResult, absolute_sigma: bool = False) -> Any:
    """Covariance of the fitted parameters from the Jacobian at the solution.

    Computes ``s²·(JᵀJ)⁻¹`` with ``J = res.jac`` (pseudo-inverted where J is rank
    deficient).  With ``absolute_sigma=False`` the residual variance is estimated from
    the fit, ``s² = 2·res.cost / (m - n)`` for ``m`` residuals and ``n`` parameters,
    which is right when the residuals' scale is unknown (unweighted data, or weights
    known only up to a factor).  With ``absolute_sigma=True``, ``s² = 1``: the residuals
    are already divided by the data's true standard deviations.

    With ``m ≤ n`` and ``absolute_sigma=False`` there are no degrees of freedom left to
    estimate ``s²``; the result is filled with ``inf`` and a ``RuntimeWarning`` says so,
    as scipy's ``curve_fit`` does.  With a robust ``loss`` the cost is the robust cost
    and ``J`` the plain Jacobian, so the result is an approximation.

    Args:
        res: the result of :func:`~secondorder.least_squares` (or anything with
            ``jac``, ``cost`` and ``x``).
        absolute_sigma: whether the residuals are in units of the data's standard
            deviation.

    Returns:
        An ``(n, n)`` float64 tensor, or a NumPy array when ``res.x`` is one.
    """
    if not all(hasattr(res, a) for a in ("jac", "cost", "x")):
        raise TypeError(
            f"res must be an OptimizeResult (with jac, cost and x), got {type(res).__name__}"
        )
    if not isinstance(absolute_sigma, bool):
        raise TypeError(f"absolute_sigma must be True or False, got {absolute_sigma!r}")
    J = _as_tensor(res.jac, "res.jac")
    if J.ndim != 2:
        raise ValueError(f"res.jac must be a 2-D Jacobian, got shape {tuple(J.shape)}")
    m, n = J.shape
    cov = _unscaled_covariance(J)
    if not absolute_sigma:
        if m > n:
            cov = cov * (2.0 * float(res.cost) / (m - n))
        else:
            warnings.warn(
                f"Covariance of the parameters could not be estimated: {m} residuals "
                f"leave no degrees of freedom for {n} parameters (absolute_sigma=False)",
                RuntimeWarning,
                stacklevel=2,
            )
            cov = torch.full_like(cov, math.inf)
    if bool(torch.isnan(cov).any()):
        cov = torch.full_like(cov, math.inf)
    return _like(cov, res.x)


def standard_errors(cov: Any) -> Any:
    """One-standard-error uncertainties ``sqrt(diag(cov))`` of the parameters."""
    c = _as_tensor(cov, "cov")
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"cov must be a square matrix, got shape {tuple(c.shape)}")
    return _like(torch.sqrt(torch.clamp(c.diagonal(), min=0.0)), cov)


def correlation(cov: Any) -> Any:
    """Correlation matrix ``cov_ij / (σ_i σ_j)``; entries of a zero-variance parameter are 0.

    Correlations near ±1 mean two parameters trade off against each other: the data
    constrain a combination of them much better than either alone.
    """
    c = _as_tensor(cov, "cov")
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"cov must be a square matrix, got shape {tuple(c.shape)}")
    se = torch.sqrt(torch.clamp(c.diagonal(), min=0.0))
    denom = torch.outer(se, se)
    ok = (denom > 0) & torch.isfinite(denom)
    corr = torch.where(ok, c / torch.where(ok, denom, torch.ones_like(denom)), 0.0)
    corr.diagonal().copy_(torch.where(se > 0, 1.0, 0.0))
    return _like(corr, cov)


# ---------------------------------------------------------------------------------------
# Fit reports


@dataclass(frozen=True)
class FitReport:
    """Parameters with their uncertainties and a summary of how the fit ended.

    ``str(report)`` prints it; the fields are there for programs.

    Attributes:
        names: parameter names.
        values: fitted values (float64 NumPy array).
        stderr: one-standard-error uncertainties.
        covariance, correlation: ``(n, n)`` matrices.
        cost: ``½ Σ r²`` (the robust cost with a robust loss).
        chisqr: ``Σ r² = 2·cost``, the chi-square when residuals are weighted by the
            data's standard deviations.
        redchi: ``chisqr / (m - n)`` (``nan`` without degrees of freedom).
        ndata, nvarys: residuals ``m`` and parameters ``n``.
        nfev, njev: residual and Jacobian evaluations.
        status, message, success: how the solver ended, in scipy's terms.
        absolute_sigma: which residual variance scaled the covariance.
        min_correlation: correlations at or below this magnitude are not printed.
    """

    names: tuple[str, ...]
    values: np.ndarray
    stderr: np.ndarray
    covariance: np.ndarray
    correlation: np.ndarray
    cost: float
    chisqr: float
    redchi: float
    ndata: int
    nvarys: int
    nfev: int
    njev: int
    status: int
    message: str
    success: bool
    absolute_sigma: bool = False
    min_correlation: float = 0.1

    @property
    def params(self) -> dict[str, float]:
        """Fitted values by name."""
        return {k: float(v) for k, v in zip(self.names, self.values, strict=True)}

    @property
    def errors(self) -> dict[str, float]:
        """Standard errors by name."""
        return {k: float(v) for k, v in zip(self.names, self.stderr, strict=True)}

    def correlations(self) -> list[tuple[str, str, float]]:
        """Pairs with ``|correlation| > min_correlation``, strongest first."""
        pairs = [
            (self.names[i], self.names[j], float(self.correlation[i, j]))
            for i in range(self.nvarys)
            for j in range(i + 1, self.nvarys)
            if abs(self.correlation[i, j]) > self.min_correlation
        ]
        return sorted(pairs, key=lambda p: -abs(p[2]))

    def __str__(self) -> str:
        dof = self.ndata - self.nvarys
        lines = [
            "[[Fit statistics]]",
            f"    status             = {self.status} ({self.message})",
            f"    success            = {self.success}",
            f"    function evals     = {self.nfev}",
            f"    Jacobian evals     = {self.njev}",
            f"    data points        = {self.ndata}",
            f"    variables          = {self.nvarys}",
            f"    degrees of freedom = {dof}",
            f"    cost (½ Σ r²)      = {self.cost:.6g}",
            f"    chi-square (Σ r²)  = {self.chisqr:.6g}",
            f"    reduced chi-square = {self.redchi:.6g}",
            "[[Variables]]",
        ]
        width = max(len(n) for n in self.names)
        for name, value, err in zip(self.names, self.values, self.stderr, strict=True):
            if math.isfinite(err):
                rel = f" ({100 * abs(err / value):.2f}%)" if value != 0 else ""
                lines.append(f"    {name:<{width}} = {value: .8g} ± {err:.4g}{rel}")
            else:
                lines.append(f"    {name:<{width}} = {value: .8g} ± (not determined)")
        sigma = "absolute sigma" if self.absolute_sigma else "scaled by the reduced chi-square"
        lines.append(f"    (one standard error, {sigma})")
        pairs = self.correlations()
        if pairs:
            lines.append(f"[[Correlations]] (|C| > {self.min_correlation:g})")
            pw = max(len(f"C({a}, {b})") for a, b, _ in pairs)
            for a, b, c in pairs:
                lines.append(f"    {f'C({a}, {b})':<{pw}} = {c:+.4f}")
        return "\n".join(lines)


def fit_report(
    res: OptimizeResult,
    names: Sequence[str] | None = None,
    *,
    absolute_sigma: bool = False,
    min_correlation: float = 0.1,
) -> FitReport:
    """A printable report of a least-squares fit: parameters ± errors, correlations, cost.

    Example::

        res = so.least_squares(residuals, p0)
        print(so.fit_report(res, names=["amplitude", "rate"]))

    Args:
        res: the result of :func:`~secondorder.least_squares` (the ``"result"`` entry
            of :func:`curve_fit`'s ``infodict`` with ``full_output=True``).
        names: one name per parameter (default ``p0, p1, ...``).
        absolute_sigma: see :func:`covariance`.
        min_correlation: print correlations whose magnitude exceeds this (in [0, 1]).
    """
    x = _as_tensor(res.x, "res.x").reshape(-1)
    n = x.numel()
    if names is None:
        names = [f"p{i}" for i in range(n)]
    if isinstance(names, str) or not all(isinstance(k, str) for k in names):
        raise TypeError(f"names must be a sequence of strings, got {names!r}")
    if len(names) != n:
        raise ValueError(f"names has {len(names)} entries but the fit has {n} parameters")
    if len(set(names)) != len(names):
        raise ValueError(f"names must be unique, got {list(names)!r}")
    ok = isinstance(min_correlation, (int, float)) and not isinstance(min_correlation, bool)
    if not ok or not 0.0 <= min_correlation <= 1.0:
        raise ValueError(f"Invalid min_correlation={min_correlation!r}: must be in [0, 1].")
    with warnings.catch_warnings():
        # A report without degrees of freedom says so in its own table.
        warnings.simplefilter("ignore", RuntimeWarning)
        cov = _as_tensor(covariance(res, absolute_sigma=absolute_sigma), "cov")
    m = int(_as_tensor(res.fun, "res.fun").numel())
    chisqr = 2.0 * float(res.cost)
    return FitReport(
        names=tuple(names),
        values=x.numpy(),
        stderr=np.asarray(standard_errors(cov.numpy())),
        covariance=cov.numpy(),
        correlation=np.asarray(correlation(cov.numpy())),
        cost=float(res.cost),
        chisqr=chisqr,
        redchi=chisqr / (m - n) if m > n else math.nan,
        ndata=m,
        nvarys=n,
        nfev=int(res.nfev),
        njev=int(res.njev),
        status=int(res.status),
        message=str(res.message),
        success=bool(res.success),
        absolute_sigma=absolute_sigma,
        min_correlation=float(min_correlation),
    )


# ---------------------------------------------------------------------------------------
# curve_fit


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


def _torch_friendly(f: Callable[..., Any], x: Any, p: Tensor) -> bool:
    """Whether ``f`` accepts tensors and can be differentiated by torch.func.

    A function written with NumPy either fails on tensors, returns an array, or makes
    NumPy warn about tensors; any of these sends it down the finite-difference path.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = f(x, *p.unbind(0))
            if not isinstance(out, Tensor):
                return False
            torch.func.jacfwd(lambda q: f(x, *q.unbind(0)))(p)
        except Exception:
            return False
    # NumPy ufuncs applied to tensors return tensors but warn about ``__array_wrap__``.
    return not any("__array" in str(w.message) for w in caught)


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
    (:func:`~secondorder.least_squares`) and returns the optimal parameters and their
    covariance (see :func:`covariance` for its meaning)::

        def decay(t, a, k):
            return a * torch.exp(-k * t)   # or np.exp: NumPy works too

        popt, pcov = so.curve_fit(decay, t, y, p0=[1.0, 0.1])
        perr = np.sqrt(np.diag(pcov))

    A model written with torch operations is differentiated exactly (forward mode);
    one written with NumPy gets finite differences.  Bounds are honoured by a change of
    variables, so every ``method`` runs the same solver.

    Args:
        f: ``f(x, p1, ..., pn)`` returning predictions with ``ydata``'s size.
        xdata: the independent variable, passed to ``f`` as given (converted to a
            float64 tensor or array when it is numeric).
        ydata: the data, ``m`` values.
        p0: initial parameters (default all ones, their number read from ``f``'s
            signature).  A tensor ``p0`` makes ``popt`` and ``pcov`` tensors.
        sigma: ``m`` standard deviations of ``ydata`` (residuals are divided by
            them), or an ``(m, m)`` covariance matrix of ``ydata`` (residuals are
            whitened by its Cholesky factor).
        absolute_sigma: ``True`` when ``sigma`` is in the data's units, so ``pcov`` is
            ``(JᵀJ)⁻¹`` unscaled; ``False`` scales it by the reduced chi-square.
        check_finite: refuse NaN or inf in the data (default ``True``).
        bounds: ``(lb, ub)`` or a ``scipy.optimize.Bounds``.
        method: ``None``, ``"lm"``, ``"trf"`` or ``"dogbox"``; accepted for
            compatibility, all run secondorder's LM.
        jac: ``None`` (exact derivatives for a torch ``f``), ``"2-point"``,
            ``"3-point"``, or ``jac(x, p1, ..., pn) -> (m, n)`` of ``f`` itself.
        full_output: also return ``infodict`` (``nfev``, ``fvec``, ``result``: the
            full :class:`~secondorder.least_squares.OptimizeResult`, for
            :func:`fit_report`), ``mesg`` and ``ier``.
        nan_policy: ``None`` or ``"raise"`` (NaN in the data raises).
        **kwargs: passed to :func:`~secondorder.least_squares` (``ftol``, ``xtol``,
            ``gtol``, ``max_nfev``, ``loss``, ``f_scale``, ...); scipy's ``maxfev``
            is read as ``max_nfev``.

    Returns:
        ``(popt, pcov)``, or ``(popt, pcov, infodict, mesg, ier)`` with
        ``full_output=True``.

    Raises:
        RuntimeError: when the solver stops on its evaluation budget, as scipy's does.
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {f!r}")
    if method not in _METHODS:
        raise ValueError(f"Unknown method={method!r}; valid choices are {_METHODS}.")
    if nan_policy not in (None, "raise"):
        raise ValueError(
            f"Unsupported nan_policy={nan_policy!r}; valid choices are (None, 'raise')."
        )
    if not isinstance(absolute_sigma, bool):
        raise TypeError(f"absolute_sigma must be True or False, got {absolute_sigma!r}")
    if "maxfev" in kwargs:
        kwargs.setdefault("max_nfev", kwargs.pop("maxfev"))
    if "x_scale" in kwargs or "diff_step" in kwargs or "tr_solver" in kwargs:
        raise TypeError("x_scale, diff_step and tr_solver of scipy's trf are not supported")
    torch_out = isinstance(p0, Tensor)
    if p0 is None:
        p = torch.ones(_count_params(f), dtype=torch.float64)
    else:
        p = _as_tensor(p0, "p0")
        if p.ndim == 0:
            p = p.reshape(1)
        if p.ndim != 1 or p.numel() == 0:
            raise ValueError(f"p0 must be a non-empty 1-D sequence, got shape {tuple(p.shape)}")
    n = p.numel()

    y = _as_tensor(ydata, "ydata").reshape(-1)
    m = y.numel()
    if m == 0:
        raise ValueError("ydata must not be empty")
    finite_check = check_finite if check_finite is not None else True
    if (finite_check or nan_policy == "raise") and not bool(torch.isfinite(y).all()):
        raise ValueError("ydata contains NaN or inf (check_finite=True)")
    x: Any = xdata
    if isinstance(xdata, (Tensor, np.ndarray, list, tuple, int, float)):
        try:
            x = _as_tensor(xdata, "xdata")
        except TypeError:
            x = xdata
        if isinstance(x, Tensor) and finite_check and not bool(torch.isfinite(x).all()):
            raise ValueError("xdata contains NaN or inf (check_finite=True)")

    # The weighting: residuals are r = W (f - y) with W = diag(1/sigma) or L⁻¹.
    weight: Callable[[Tensor], Tensor]
    if sigma is None:

        def weight(r: Tensor) -> Tensor:
            return r

    else:
        s = _as_tensor(sigma, "sigma")
        if s.shape == (m,):
            if not bool((torch.isfinite(s) & (s > 0)).all()):
                raise ValueError("sigma must be finite and > 0 everywhere")
            inv = 1.0 / s

            def weight(r: Tensor) -> Tensor:
                return r * inv.to(r.dtype)

        elif s.shape == (m, m):
            L, info = torch.linalg.cholesky_ex(s)
            if int(info) != 0:
                raise ValueError(
                    "sigma, given as an (m, m) covariance matrix, must be symmetric "
                    "positive definite"
                )

            def weight(r: Tensor) -> Tensor:
                return torch.linalg.solve_triangular(L, r.reshape(-1, 1), upper=False)[:, 0]

        else:
            raise ValueError(
                f"sigma must have shape ({m},) or ({m}, {m}) to match ydata, got {tuple(s.shape)}"
            )

    use_torch = not callable(jac) and jac not in ("2-point", "3-point")
    use_torch = use_torch and _torch_friendly(f, x, p)
    x_np = x.numpy() if isinstance(x, Tensor) else x

    def check(pred: Any) -> Tensor:
        t = pred if isinstance(pred, Tensor) else _as_tensor(pred, "f(xdata, *p)")
        t = t.reshape(-1).to(torch.float64)
        if t.numel() != m:
            raise ValueError(
                f"f(xdata, *p) returned {t.numel()} values but ydata has {m}; they must match"
            )
        return t

    ls_jac: str | Callable[..., Any] = "auto"
    residuals: Callable[[Any], Any]
    if use_torch:

        def torch_residuals(q: Tensor) -> Tensor:
            return weight(check(f(x, *q.unbind(0))) - y)

        residuals = torch_residuals

        x_start: Any = p
    else:
        y_np = y.numpy()

        def numpy_residuals(q: Any) -> Any:
            pred = np.asarray(f(x_np, *q), dtype=np.float64).reshape(-1)
            if pred.size != m:
                raise ValueError(
                    f"f(xdata, *p) returned {pred.size} values but ydata has {m}; they must match"
                )
            return weight(torch.from_numpy(pred - y_np)).numpy()

        residuals = numpy_residuals

        x_start = p.numpy()
        if callable(jac):
            user_jac = jac

            def jac_fn(q: Any) -> Any:
                J = _as_tensor(user_jac(x_np, *q), "jac(xdata, *p)")
                if J.shape != (m, n):
                    raise ValueError(
                        f"jac(xdata, *p) must return shape ({m}, {n}), got {tuple(J.shape)}"
                    )
                cols = [weight(J[:, j]) for j in range(n)]
                return torch.stack(cols, dim=1).numpy()

            ls_jac = jac_fn
        elif jac is not None:
            ls_jac = jac
    res = least_squares(residuals, x_start, jac=ls_jac, bounds=bounds, **kwargs)
    if not res.success:
        raise RuntimeError(f"Optimal parameters not found: {res.message}")
    popt = _as_tensor(res.x, "popt")
    pcov = _as_tensor(covariance(res, absolute_sigma=absolute_sigma), "pcov")
    out_popt = popt if torch_out else popt.numpy()
    out_pcov = pcov if torch_out else pcov.numpy()
    if not full_output:
        return out_popt, out_pcov
    infodict = {"nfev": res.nfev, "fvec": res.fun, "result": res}
    return out_popt, out_pcov, infodict, res.message, res.status
