"""secondorder: second-order optimizers for PyTorch.

The flagship is :class:`LevenbergMarquardt`, which trains models by solving the damped
normal equations with an explicit Jacobian, and :func:`least_squares`, its functional
counterpart for fitting the parameters of a model function.
"""

from . import damping, jacobian, linalg, residuals
from .config import LMConfig
from .least_squares import OptimizeResult, least_squares
from .lm import LevenbergMarquardt, StepInfo
from .residuals import ModelResidual

__all__ = [
    "LMConfig",
    "LevenbergMarquardt",
    "ModelResidual",
    "OptimizeResult",
    "StepInfo",
    "damping",
    "jacobian",
    "least_squares",
    "linalg",
    "residuals",
]

__version__ = "0.1.0"
