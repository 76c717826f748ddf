r"""Parameter uncertainties from a least-squares result, and printable fit reports.

The uncertainty of the fitted parameters comes from the linearisation at the
solution.  Near the minimum the residuals are ``r(p) ≈ r(p̂) + J (p - p̂)``, and if the
(weighted) data have independent errors of variance ``s²`` the estimate ``p̂`` has the
covariance

.. math:: \operatorname{cov}(\hat p) = s^2 (J^\top J)^{-1}.

When the residuals are divided by the data's true standard deviations
(``absolute_sigma=True``) they have unit variance and ``s² = 1``.  Otherwise ``s²`` is
estimated from the scatter about the fit, the reduced chi-square
``s² = Σ r² / (m - n) = 2·cost / (m - n)`` with ``m`` residuals and ``n`` parameters:
the scaling scipy's ``curve_fit`` and lmfit use, so :func:`covariance` agrees with both.

:func:`covariance`, :func:`standard_errors` and :func:`correlation` work on any
:class:`~secondorder.fitting.OptimizeResult`; :func:`fit_report` gathers them into a
:class:`FitReport` whose ``str`` is a table of parameters ± errors, the strong
correlations, the cost, the evaluations and the termination message.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .arrays import as_float64, like
from .result import OptimizeResult

__all__ = [
    "FitReport",
    "UndeterminedWarning",
    "correlation",
    "covariance",
    "fit_report",
    "pivoted_qr",
    "standard_errors",
]


class UndeterminedWarning(RuntimeWarning):
    """Some parameters are not determined by the data (their variance is infinite).

    Raised as :class:`scipy.optimize.OptimizeWarning` when scipy is installed, as scipy's
    ``curve_fit`` does, and as this class otherwise.
    """


def _undetermined_category() -> type[Warning]:
    try:
        from scipy.optimize import OptimizeWarning
    except ImportError:  # scipy is optional
        return UndeterminedWarning
    return OptimizeWarning


def _unscaled_covariance(J: Tensor) -> tuple[Tensor, Tensor]:
    """``((JᵀJ)⁻¹, undetermined)`` through the SVD of J with its columns scaled to norm 1.

    The rank is decided on the scaled columns, so it does not depend on the units of
    the parameters: a saturation current of 1e-15 A beside an ideality factor of 1.5
    gives columns 10¹⁴ apart, which an unscaled SVD would call rank deficient though
    each parameter is well determined (MINPACK's pivoted QR is immune for the same
    reason).  Singular values of the scaled J below ``eps·max(m, n)·s_max`` count as
    zero (scipy's rule).  Moving the parameters along such a direction does not change
    the residuals, so the data say nothing about it: every parameter with a component
    along one (more than √eps of it) is *undetermined*, and its variance is infinite,
    not the 0 a pseudo-inverse would give (a parameter the model ignores is the
    simplest case).
    """
    n = J.shape[1]
    norms = torch.linalg.vector_norm(J, dim=0)
    scale = torch.where(norms > 0, norms, torch.ones_like(norms))
    _, s, Vh = torch.linalg.svd(J / scale, full_matrices=True)
    rank = 0
    if s.numel() > 0 and float(s[0]) > 0.0:
        rank = int((s > torch.finfo(J.dtype).eps * max(J.shape) * s[0]).sum())
    kept, null = Vh[:rank], Vh[rank:]
    cov = ((kept.T / s[:rank] ** 2) @ kept) / scale[:, None] / scale[None, :]
    undetermined = torch.linalg.vector_norm(null, dim=0) > math.sqrt(torch.finfo(J.dtype).eps)
    return cov.reshape(n, n), undetermined


def _check_result(res: Any) -> None:
    if res is None or not all(hasattr(res, a) for a in ("jac", "cost", "x", "fun")):
        raise TypeError(
            f"res must be the OptimizeResult of least_squares (with x, cost, fun and jac), got "
            f"{type(res).__name__}; from curve_fit pass full_output=True and use "
            "infodict['result']"
        )


def pivoted_qr(J: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MINPACK's ``(fjac, ipvt, qtf)`` of ``J``: the QR factorisation ``J P = Q R``.

    Householder reflections with column pivoting (Businger & Golub): each step moves
    the remaining column of largest norm to the front, as MINPACK's ``qrfac`` and
    LAPACK's ``geqp3`` do, and gives ``R``'s diagonal the sign opposite to the pivot's
    leading entry (both libraries' convention).  Returned as scipy's ``leastsq``
    returns them: ``fjac`` is ``(n, m)`` with ``R = triu(fjac.T[:n])`` (the part below
    the diagonal, where MINPACK keeps its reflectors, is zero here); ``ipvt`` holds the
    column order ``P``, 0-based as scipy 1.17 returns it (``J[:, ipvt] = Q R``; ties
    between equal norms may order differently); ``qtf`` is the first ``n`` entries of
    ``Qᵀf``.
    """
    A = np.array(J, dtype=np.float64, copy=True)
    b = np.array(f, dtype=np.float64, copy=True).reshape(-1)
    m, n = A.shape
    perm = np.arange(n)
    for k in range(min(m, n)):
        j = k + int(np.argmax(np.linalg.norm(A[k:, k:], axis=0)))
        A[:, [k, j]] = A[:, [j, k]]
        perm[[k, j]] = perm[[j, k]]
        x = A[k:, k]
        norm = float(np.linalg.norm(x))
        if norm == 0.0:
            continue
        alpha = -math.copysign(norm, x[0])
        v = x.copy()
        v[0] -= alpha
        v /= np.linalg.norm(v)
        A[k:, k:] -= 2.0 * np.outer(v, v @ A[k:, k:])
        b[k:] -= 2.0 * v * (v @ b[k:])
        A[k + 1 :, k] = 0.0
        A[k, k] = alpha
    fjac = np.zeros((n, m))
    fjac[:, : min(m, n)] = np.triu(A[: min(m, n)]).T
    return fjac, perm.astype(np.int32), b[:n].copy()


def covariance(res: OptimizeResult, absolute_sigma: bool = False) -> Any:
    """Covariance of the fitted parameters from the Jacobian at the solution.

    Computes ``s²·(JᵀJ)⁻¹`` with ``J = res.jac`` (pseudo-inverted where J is rank
    deficient).  With ``absolute_sigma=False`` the residual variance is estimated from
    the fit, ``s² = 2·res.cost / (m - n)`` for ``m`` residuals and ``n`` parameters,
    which is right when the residuals' scale is unknown (unweighted data, or weights
    known only up to a factor).  With ``absolute_sigma=True``, ``s² = 1``: the residuals
    are already divided by the data's true standard deviations.

    With ``m ≤ n`` and ``absolute_sigma=False`` there are no degrees of freedom left to
    estimate ``s²``; the result is filled with ``inf`` and scipy's ``OptimizeWarning``
    (this module's :class:`UndeterminedWarning` without scipy) says so, as scipy's
    ``curve_fit`` does.  With a robust ``loss`` the cost is the robust cost and
    ``res.jac`` the Jacobian scaled for it (scipy's), as in scipy's ``curve_fit``.

    Args:
        res: the result of :func:`~secondorder.fitting.least_squares` (or anything with
            ``jac``, ``cost`` and ``x``).
        absolute_sigma: whether the residuals are in units of the data's standard
            deviation.

    Returns:
        An ``(n, n)`` float64 tensor, or a NumPy array when ``res.x`` is one.
    """
    _check_result(res)
    if not isinstance(absolute_sigma, bool):
        raise TypeError(f"absolute_sigma must be True or False, got {absolute_sigma!r}")
    J = as_float64(res.jac, "res.jac")
    if J.ndim != 2:
        raise ValueError(f"res.jac must be a 2-D Jacobian, got shape {tuple(J.shape)}")
    m, n = J.shape
    cov, undetermined = _unscaled_covariance(J)
    if not absolute_sigma:
        if m > n:
            cov = cov * (2.0 * float(res.cost) / (m - n))
        else:
            warnings.warn(
                f"Covariance of the parameters could not be estimated: {m} residuals "
                f"leave no degrees of freedom for {n} parameters (absolute_sigma=False)",
                _undetermined_category(),
                stacklevel=2,
            )
            cov = torch.full_like(cov, math.inf)
    if bool(torch.isnan(cov).any()):
        cov = torch.full_like(cov, math.inf)
    if bool(undetermined.any()):
        which = torch.nonzero(undetermined).flatten().tolist()
        warnings.warn(
            f"Covariance of the parameters could not be estimated for parameters {which}: "
            "the residuals do not change along some combination of them (the Jacobian "
            "is rank deficient), so their variance is infinite; fix or remove them",
            _undetermined_category(),
            stacklevel=2,
        )
        cov = cov.clone()
        cov[undetermined, :] = math.inf
        cov[:, undetermined] = math.inf
    return like(cov, res.x)


def _square(cov: Any) -> Tensor:
    c = as_float64(cov, "cov")
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"cov must be a square matrix, got shape {tuple(c.shape)}")
    return c


def standard_errors(cov: Any) -> Any:
    """One-standard-error uncertainties ``sqrt(diag(cov))`` of the parameters."""
    c = _square(cov)
    return like(torch.sqrt(torch.clamp(c.diagonal(), min=0.0)), cov)


def correlation(cov: Any) -> Any:
    """Correlation matrix ``cov_ij / (σ_i σ_j)``; entries of a zero-variance parameter are 0.

    Correlations near ±1 mean two parameters trade off against each other: the data
    constrain a combination of them much better than either alone.
    """
    c = _square(cov)
    se = torch.sqrt(torch.clamp(c.diagonal(), min=0.0))
    denom = torch.outer(se, se)
    ok = (denom > 0) & torch.isfinite(denom)
    corr = torch.where(ok, c / torch.where(ok, denom, torch.ones_like(denom)), 0.0)
    corr.diagonal().copy_(torch.where(se > 0, 1.0, 0.0))
    return like(corr, cov)


# ---------------------------------------------------------------------------------------
# Fit reports


@dataclass(frozen=True)
class _ReportData:
    """The fields of a :class:`FitReport` (documented there) and the text they make."""

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

    def undetermined(self) -> list[tuple[str, str]]:
        """``(name, why)`` for each parameter whose uncertainty cannot be determined.

        As lmfit flags them: a variance that is infinite, NaN or zero, or a correlation
        of ±1 with another parameter (the data fix only a combination of the two).
        """
        out = []
        for i, (name, err) in enumerate(zip(self.names, self.stderr, strict=True)):
            if not math.isfinite(err):
                out.append((name, "infinite variance"))
            elif err == 0.0:
                out.append((name, "zero variance"))
            else:
                for j, other in enumerate(self.names):
                    c = float(self.correlation[i, j])
                    if j != i and abs(c) >= 1.0 - _UNIT_CORRELATION:
                        out.append((name, f"correlation {c:+.4f} with {other}"))
                        break
        return out

    def text(self) -> str:
        """The printed report."""
        lines = self._statistics() + self._variables() + self._correlation_table()
        return "\n".join(lines + self._warnings())

    def _warnings(self) -> list[str]:
        """The ``[[Warnings]]`` block, empty when every uncertainty is determined."""
        flagged = self.undetermined()
        if not flagged:
            return []
        lines = ["[[Warnings]]", "    uncertainties could not be determined for:"]
        lines += [f"    {name}: {why}" for name, why in flagged]
        return lines

    def _statistics(self) -> list[str]:
        """The ``[[Fit statistics]]`` block: how the solver ended and the chi-square."""
        return [
            "[[Fit statistics]]",
            f"    status             = {self.status} ({self.message})",
            f"    success            = {self.success}",
            f"    function evals     = {self.nfev}",
            f"    Jacobian evals     = {self.njev if self.njev >= 0 else 'not reported'}",
            f"    data points        = {self.ndata}",
            f"    variables          = {self.nvarys}",
            f"    degrees of freedom = {self.ndata - self.nvarys}",
            f"    cost (½ Σ r²)      = {self.cost:.6g}",
            f"    chi-square (Σ r²)  = {self.chisqr:.6g}",
            f"    reduced chi-square = {self.redchi:.6g}",
        ]

    def _variables(self) -> list[str]:
        """The ``[[Variables]]`` block: value ± error (relative error) per parameter."""
        lines = ["[[Variables]]"]
        width = max(len(n) for n in self.names)
        for name, value, err in zip(self.names, self.values, self.stderr, strict=True):
            if math.isfinite(err) and err > 0:
                rel = f" ({100 * abs(err / value):.2f}%)" if value != 0 else ""
                lines.append(f"    {name:<{width}} = {value: .8g} ± {err:.4g}{rel}")
            else:
                lines.append(f"    {name:<{width}} = {value: .8g} ± (not determined)")
        sigma = "absolute sigma" if self.absolute_sigma else "scaled by the reduced chi-square"
        lines.append(f"    (one standard error, {sigma})")
        return lines

    def _correlation_table(self) -> list[str]:
        """The ``[[Correlations]]`` block, empty when no pair exceeds ``min_correlation``."""
        pairs = self.correlations()
        if not pairs:
            return []
        lines = [f"[[Correlations]] (|C| > {self.min_correlation:g})"]
        pw = max(len(f"C({a}, {b})") for a, b, _ in pairs)
        for a, b, c in pairs:
            lines.append(f"    {f'C({a}, {b})':<{pw}} = {c:+.4f}")
        return lines


_UNIT_CORRELATION = 1e-8


class FitReport(str):
    """Parameters with their uncertainties and a summary of how the fit ended.

    A ``str`` (the printed report, as lmfit's ``fit_report`` returns), so it prints,
    concatenates and compares as text; its fields are attributes for programs:

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
        nfev, njev: residual and Jacobian evaluations (``njev`` -1 when not reported).
        status, message, success: how the solver ended, in scipy's terms.
        absolute_sigma: which residual variance scaled the covariance.
        min_correlation: correlations at or below this magnitude are not printed.
    """

    _data: _ReportData

    def __new__(cls, **fields: Any) -> FitReport:
        """Build the report from :class:`_ReportData`'s fields (keywords)."""
        data = _ReportData(**fields)
        obj = super().__new__(cls, data.text())
        object.__setattr__(obj, "_data", data)
        return obj

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_data"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"FitReport is read-only: cannot set {name}")

    def __repr__(self) -> str:
        return f"FitReport({str(self)!r})"

    def __str__(self) -> str:
        return str.__str__(self)


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
        res: the result of :func:`~secondorder.fitting.least_squares` (the ``"result"`` entry
            of :func:`curve_fit`'s ``infodict`` with ``full_output=True``).
        names: one name per parameter (default ``p0, p1, ...``).
        absolute_sigma: see :func:`covariance`.
        min_correlation: print correlations whose magnitude exceeds this (in [0, 1]).
    """
    _check_result(res)
    x = as_float64(res.x, "res.x").reshape(-1)
    n = x.numel()
    names = _check_names(names, n)
    ok = isinstance(min_correlation, (int, float)) and not isinstance(min_correlation, bool)
    if not ok or not 0.0 <= min_correlation <= 1.0:
        raise ValueError(f"Invalid min_correlation={min_correlation!r}: must be in [0, 1].")
    with warnings.catch_warnings():
        # A report without degrees of freedom, or with undetermined parameters, says so
        # in its own table.
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", _undetermined_category())
        cov = as_float64(covariance(res, absolute_sigma=absolute_sigma), "cov")
    m = int(as_float64(res.fun, "res.fun").numel())
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
        njev=-1 if res.njev is None else int(res.njev),
        status=int(res.status),
        message=str(res.message),
        success=bool(res.success),
        absolute_sigma=absolute_sigma,
        min_correlation=float(min_correlation),
    )


def _check_names(names: Sequence[str] | None, n: int) -> Sequence[str]:
    """``names`` (default ``p0, p1, ...``), checked to be ``n`` unique strings."""
    if names is None:
        names = [f"p{i}" for i in range(n)]
    if isinstance(names, str) or not all(isinstance(k, str) for k in names):
        raise TypeError(f"names must be a sequence of strings, got {names!r}")
    if len(names) != n:
        raise ValueError(f"names has {len(names)} entries but the fit has {n} parameters")
    if len(set(names)) != len(names):
        raise ValueError(f"names must be unique, got {list(names)!r}")
    return names
