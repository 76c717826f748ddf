"""Fitting the parameters of a model function: scipy's ``least_squares`` and ``curve_fit``.

Both run the Levenberg-Marquardt engine of :mod:`secondorder.lm` on a flat parameter
vector; :func:`fit_report` summarises a ``curve_fit`` result with standard errors and
correlations.
"""

from .curve_fit import (
    FitReport,
    correlation,
    covariance,
    curve_fit,
    fit_report,
    standard_errors,
)
from .least_squares import OptimizeResult, least_squares

__all__ = [
    "FitReport",
    "OptimizeResult",
    "correlation",
    "covariance",
    "curve_fit",
    "fit_report",
    "least_squares",
    "standard_errors",
]
