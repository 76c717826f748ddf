"""Fitting the parameters of a model function: scipy's ``least_squares`` and ``curve_fit``.

Both run the Levenberg-Marquardt engine of :mod:`secondorder.lm` on a flat parameter
vector; :func:`fit_report` summarises a result with standard errors and correlations.

Modules: :mod:`.least_squares` (the driver: check, build, run, report) over
:mod:`.functions` (the user's fun and jac as tensors), :mod:`.differences` (finite
differences), :mod:`.losses` (robust ρ), :mod:`.bounds` (the change of variables),
:mod:`.problem` (what the engine solves) and :mod:`.result`; :mod:`.curve_fit` on top
of it (with :mod:`.curve_model`: f and the data as residuals); :mod:`.report` for
covariances and fit reports; :mod:`.batch` runs many small fits at once.
"""

from .batch import curve_fit_batch, least_squares_batch
from .curve_fit import curve_fit
from .least_squares import least_squares
from .report import (
    FitReport,
    UndeterminedWarning,
    correlation,
    covariance,
    fit_report,
    standard_errors,
)
from .result import OptimizeResult

__all__ = [
    "FitReport",
    "OptimizeResult",
    "UndeterminedWarning",
    "correlation",
    "covariance",
    "curve_fit",
    "curve_fit_batch",
    "fit_report",
    "least_squares",
    "least_squares_batch",
    "standard_errors",
]
