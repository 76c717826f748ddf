"""secondorder: second-order optimizers for PyTorch.

The flagship is :class:`LevenbergMarquardt`, which trains models by solving the damped
normal equations with an explicit Jacobian, and :func:`least_squares`, its functional
counterpart for fitting the parameters of a model function.
"""

from . import damping, jacobian, linalg, residuals
from .config import LMConfig
from .lm import LevenbergMarquardt, StepInfo
from .residuals import ModelResidual

__all__ = [
    "LMConfig",
    "LevenbergMarquardt",
    "ModelResidual",
    "StepInfo",
    "damping",
    "jacobian",
    "linalg",
    "residuals",
]

__version__ = "0.1.0"
