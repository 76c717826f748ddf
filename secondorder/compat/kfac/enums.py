"""kfac-pytorch's enums, for ``kfac.enums.ComputeMethod.EIGEN`` and friends.

:func:`parse` reads any of kfac-pytorch's spellings of a choice: the member, its
name in any case (``"EIGEN"``, ``"eigen"``, ``"Inverse"``) and, for
:class:`DistributedStrategy`, the hyphenated form of the examples' ``--kfac-strategy``
(``"comm-opt"``).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = [
    "AllreduceMethod",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "parse",
]


class AllreduceMethod(Enum):
    """How factors are all-reduced; secondorder packs them into one call either way."""

    ALLREDUCE = 1
    ALLREDUCE_BUCKETED = 2


class AssignmentStrategy(Enum):
    """What the greedy work assignment balances: decomposition time (n³) or memory (n²)."""

    COMPUTE = 1
    MEMORY = 2


class ComputeMethod(Enum):
    """Eigendecompositions of A and G (exact damping of ``A ⊗ G``) or their damped inverses."""

    EIGEN = 1
    INVERSE = 2


class DistributedStrategy(Enum):
    """Shortcuts for ``grad_worker_fraction``: 1 (COMM_OPT), 0.5 (HYBRID_OPT), 1/world (MEM_OPT)."""

    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


E = TypeVar("E", bound=Enum)


def parse(name: str, enum: type[E], value: object) -> E:
    """``value`` as a member of ``enum``: a member, or a member's name in any case.

    Raises ``ValueError`` naming the argument ``name``, the value and the choices.
    """
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        key = value.strip().upper().replace("-", "_")
        if key in enum.__members__:
            return enum[key]
    choices = ", ".join(f"{enum.__name__}.{m}" for m in enum.__members__)
    raise ValueError(
        f"Invalid {name}={value!r}: must be one of {choices} or a member's name as a string "
        f"(any case, e.g. {next(iter(enum.__members__)).lower()!r})."
    )
