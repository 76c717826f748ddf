"""The training loop: :func:`fit` drives any optimizer, with validation and early stopping.

:func:`fit` talks to an optimizer through a :class:`TrainingStep` (one method, ``step``,
takes a batch and returns a :class:`StepResult`); :class:`LMStep` and :class:`TorchStep`
adapt Levenberg-Marquardt and ``torch.optim`` optimizers, and new families plug in by
writing one.
"""

from .callbacks import Callback, CSVLogger, LoggerCallback, TensorBoardLogger
from .fit import fit
from .history import EpochRecord, History, StepRecord
from .protocol import StepResult, TrainingStep
from .steps import LMStep, TorchStep, as_training_step

__all__ = [
    "CSVLogger",
    "Callback",
    "EpochRecord",
    "History",
    "LMStep",
    "LoggerCallback",
    "StepRecord",
    "StepResult",
    "TensorBoardLogger",
    "TorchStep",
    "TrainingStep",
    "as_training_step",
    "fit",
]
