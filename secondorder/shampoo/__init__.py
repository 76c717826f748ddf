"""Distributed Shampoo and its eigenvalue-corrected variant (SOAP) for PyTorch.

:class:`Shampoo` is a ``torch.optim.Optimizer`` with DistributedShampoo's hyperparameter
names and defaults.  The parts: :mod:`.blocking` (parameters to blocks),
:mod:`.root_inverse` (batched inverse roots), :mod:`.preconditioner` (the Kronecker
factors, root-inverse and eigenvalue-corrected), :mod:`.grafting` (the diagonal
methods whose step norm is borrowed), :mod:`.distributor` (block ownership and the
all-gather of directions, or each rank's own shards of ``fully_shard`` parameters)
and :mod:`.config` (validated settings).  DistributedShampoo's config names
(``AdamPreconditionerConfig``, ``FullyShardDistributedConfig``, ...) are taken too
(:mod:`.named_configs`).
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
from .named_configs import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedConfig,
    FSDPDistributedConfig,
    FullyShardDistributedConfig,
    HSDPDistributedConfig,
    HybridShardDistributedConfig,
    PreconditionerConfig,
    RMSpropPreconditionerConfig,
    SGDPreconditionerConfig,
    SingleDeviceDistributedConfig,
)
from .optimizer import Shampoo

__all__ = [
    "AdaGradGraftingConfig",
    "AdaGradPreconditionerConfig",
    "AdamGraftingConfig",
    "AdamPreconditionerConfig",
    "CoupledNewtonConfig",
    "DDPDistributedConfig",
    "DistributedConfig",
    "EigenConfig",
    "FSDPDistributedConfig",
    "FullyShardDistributedConfig",
    "GraftingConfig",
    "HSDPDistributedConfig",
    "HybridShardDistributedConfig",
    "PreconditionerConfig",
    "RMSpropGraftingConfig",
    "RMSpropPreconditionerConfig",
    "RootInvConfig",
    "SGDGraftingConfig",
    "SGDPreconditionerConfig",
    "Shampoo",
    "SingleDeviceDistributedConfig",
    "assign_blocks",
]
