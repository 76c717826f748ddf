"""Levenberg-Marquardt: damped Gauss-Newton steps with explicit Jacobians.

:class:`LevenbergMarquardt` solves ``(JᵀJ + λD)δ = -Jᵀr`` (or its dual form) each step.
Its parts, one module each: :mod:`~secondorder.lm.residuals` (losses as residuals),
:mod:`~secondorder.lm.jacobian` (how J's rows are computed), :mod:`~secondorder.lm.linalg`
(the normal-equation record and one module per solver, factor once, solve many; the
same solvers over NumPy or cuPyNumeric; CG whose products the reducer sums),
:mod:`~secondorder.lm.damping` (rules for λ and the matrix D),
:mod:`~secondorder.lm.precision` (the Gram's dtype), :mod:`~secondorder.lm.planner`
(memory), :mod:`~secondorder.lm.engine` (the attempts of one iteration),
:mod:`~secondorder.lm.model` (the model as a function of one flat vector),
:mod:`~secondorder.lm.problem` (one batch's problem: linearise, evaluate trials),
:mod:`~secondorder.lm.choices` (each batch's strategy, solver, form and slice size),
:mod:`~secondorder.lm.batch` (checks of a step's batch) and
:mod:`~secondorder.lm.checkpoint` (``state_dict`` in torch.optim's schema).
"""

from ..distributed.reducer import RankFailedError
from . import damping, jacobian, linalg, planner, residuals
from .config import LMConfig
from .optimizer import LevenbergMarquardt
from .planner import MemoryPlan, PlanError
from .records import LMInternals, SmallBatchWarning, StepInfo
from .residuals import ModelResidual

__all__ = [
    "LMConfig",
    "LMInternals",
    "LevenbergMarquardt",
    "MemoryPlan",
    "ModelResidual",
    "PlanError",
    "RankFailedError",
    "SmallBatchWarning",
    "StepInfo",
    "damping",
    "jacobian",
    "linalg",
    "planner",
    "residuals",
]
