"""DistributedShampoo's ``distributed_shampoo.preconditioner`` package path."""

from . import matrix_functions_types

__all__ = ["matrix_functions_types"]
