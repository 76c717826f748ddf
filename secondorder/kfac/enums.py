"""kfac-pytorch's enums, which :class:`~secondorder.kfac.KFAC` takes as they are.

``compute_method``, ``assignment_strategy`` and ``grad_worker_fraction`` accept a member
(``ComputeMethod.EIGEN``, ``DistributedStrategy.COMM_OPT``; kfac-pytorch's own ``kfac.enums``
members too) or its name in any case, with ``-`` or ``_`` (``"EIGEN"``, ``"Inverse"``,
``"comm_opt"``, ``"COMM-OPT"``).  :func:`parse` reads one; :func:`choice` gives the
lower-case name that :class:`~secondorder.kfac.KFACConfig` stores.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = [
    "AllreduceMethod",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "choice",
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
    if isinstance(value, Enum) and type(value).__name__ == enum.__name__:
        # kfac-pytorch's own member (kfac.enums is another module): read by name
        value = value.name
    if isinstance(value, str):
        key = value.strip().upper().replace("-", "_")
        if key in enum.__members__:
            return enum[key]
    names = ", ".join(repr(m.lower()) for m in enum.__members__)
    raise ValueError(
        f"Invalid {name}={value!r}: must be one of {names} (any case, '-' or '_') or a "
        f"member of {enum.__name__} such as {enum.__name__}.{next(iter(enum.__members__))}."
    )


def choice(name: str, enum: type[E], value: object) -> str:
    """The lower-case name of :func:`parse`'s member, e.g. ``"eigen"``, ``"comm_opt"``."""
    return parse(name, enum, value).name.lower()
