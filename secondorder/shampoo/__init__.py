"""Distributed Shampoo and its eigenvalue-corrected variant (SOAP) for PyTorch.

:class:`Shampoo` is a ``torch.optim.Optimizer`` with DistributedShampoo's hyperparameter
names and defaults.  The parts: :mod:`.blocking` (parameters to blocks),
:mod:`.root_inverse` (batched inverse roots), :mod:`.preconditioner` (the Kronecker
factors, root-inverse and eigenvalue-corrected), :mod:`.grafting` (the diagonal
methods whose step norm is borrowed), :mod:`.distributor` (block ownership and the
all-gather of directions) and :mod:`.config` (validated settings).
"""

from .config import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    CoupledNewtonConfig,
    EigenConfig,
    GraftingConfig,
    RMSpropGraftingConfig,
    RootInvConfig,
    SGDGraftingConfig,
)
from .distributor import assign_blocks
from .optimizer import Shampoo

__all__ = [
    "AdaGradGraftingConfig",
    "AdamGraftingConfig",
    "CoupledNewtonConfig",
    "EigenConfig",
    "GraftingConfig",
    "RMSpropGraftingConfig",
    "RootInvConfig",
    "SGDGraftingConfig",
    "Shampoo",
    "assign_blocks",
]
