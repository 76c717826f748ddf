"""secondorder: second-order optimizers for PyTorch.

The flagship is :class:`LevenbergMarquardt`, which trains models by solving the damped
normal equations with an explicit Jacobian, and :func:`least_squares`, its functional
counterpart for fitting the parameters of a model function.
"""

from . import damping, jacobian, linalg, planner, residuals
from .config import LMConfig
from .curve_fit import (
    FitReport,
    correlation,
    covariance,
    curve_fit,
    fit_report,
    standard_errors,
)
from .fit import Callback, CSVLogger, History, TensorBoardLogger, fit
from .least_squares import OptimizeResult, least_squares
from .lm import LevenbergMarquardt, StepInfo
from .planner import MemoryPlan, PlanError
from .residuals import ModelResidual

__all__ = [
    "CSVLogger",
    "Callback",
    "FitReport",
    "History",
    "LMConfig",
    "LevenbergMarquardt",
    "MemoryPlan",
    "ModelResidual",
    "OptimizeResult",
    "PlanError",
    "StepInfo",
    "TensorBoardLogger",
    "correlation",
    "covariance",
    "curve_fit",
    "damping",
    "fit",
    "fit_report",
    "jacobian",
    "least_squares",
    "linalg",
    "planner",
    "residuals",
    "standard_errors",
]

__version__ = "0.1.0"
