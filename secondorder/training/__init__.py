"""The training loop: :func:`fit` with progress, logging, validation and early stopping."""

from .fit import Callback, CSVLogger, EpochRecord, History, StepRecord, TensorBoardLogger, fit

__all__ = [
    "CSVLogger",
    "Callback",
    "EpochRecord",
    "History",
    "StepRecord",
    "TensorBoardLogger",
    "fit",
]
