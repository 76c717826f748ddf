"""secondorder: second-order optimizers for PyTorch.

One package per family, sharing one distributed layer and one training loop:

* :mod:`secondorder.lm`: :class:`LevenbergMarquardt`, which trains models by solving the
  damped normal equations with an explicit Jacobian;
* :mod:`secondorder.fitting`: :func:`least_squares` and :func:`curve_fit`, its
  functional counterparts for fitting the parameters of a model function, and
  :func:`curve_fit_batch`/:func:`least_squares_batch` for many small fits at once;
* :mod:`secondorder.kfac`: :class:`KFAC`, a Kronecker-factored preconditioner with
  KAISA's distribution strategies, and :class:`KFACOptimizer` (K-FAC + SGD);
* :mod:`secondorder.shampoo`: :class:`Shampoo`, Distributed Shampoo and its
  eigenbasis variant SOAP, blocks shared among data-parallel ranks;
* :mod:`secondorder.training`: :func:`fit`, the training loop;
* :mod:`secondorder.distributed`: reducers over processes and devices, used by every
  family; :mod:`secondorder.testing`: the multi-process launcher their tests share.
"""

from . import distributed, fitting, kfac, lm, shampoo, training
from .fitting import (
    FitReport,
    OptimizeResult,
    UndeterminedWarning,
    correlation,
    covariance,
    curve_fit,
    curve_fit_batch,
    fit_report,
    least_squares,
    least_squares_batch,
    standard_errors,
)
from .kfac import KFAC, KFACOptimizer
from .lm import (
    LevenbergMarquardt,
    LMConfig,
    MemoryPlan,
    ModelResidual,
    PlanError,
    RankFailedError,
    SmallBatchWarning,
    StepInfo,
    damping,
    jacobian,
    linalg,
    planner,
    residuals,
)
from .shampoo import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    CoupledNewtonConfig,
    EigenConfig,
    RMSpropGraftingConfig,
    SGDGraftingConfig,
    Shampoo,
)
from .training import (
    Callback,
    CSVLogger,
    EpochRecord,
    History,
    LoggerCallback,
    StepRecord,
    StepResult,
    TensorBoardLogger,
    TrainingStep,
    fit,
)

__all__ = [
    "KFAC",
    "AdaGradGraftingConfig",
    "AdamGraftingConfig",
    "CSVLogger",
    "Callback",
    "CoupledNewtonConfig",
    "EigenConfig",
    "EpochRecord",
    "FitReport",
    "History",
    "KFACOptimizer",
    "LMConfig",
    "LevenbergMarquardt",
    "LoggerCallback",
    "MemoryPlan",
    "ModelResidual",
    "OptimizeResult",
    "PlanError",
    "RMSpropGraftingConfig",
    "RankFailedError",
    "SGDGraftingConfig",
    "Shampoo",
    "SmallBatchWarning",
    "StepInfo",
    "StepRecord",
    "StepResult",
    "TensorBoardLogger",
    "TrainingStep",
    "UndeterminedWarning",
    "correlation",
    "covariance",
    "curve_fit",
    "curve_fit_batch",
    "damping",
    "distributed",
    "fit",
    "fit_report",
    "fitting",
    "jacobian",
    "kfac",
    "least_squares",
    "least_squares_batch",
    "linalg",
    "lm",
    "planner",
    "residuals",
    "shampoo",
    "standard_errors",
    "training",
]

__version__ = "0.1.0"
