"""What the configuration dataclasses share: abstract bases and their checks."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Abstract", "check_bool", "check_in", "check_int"]


class Abstract:
    """A base that cannot be built itself; its concrete subclasses are dataclasses."""

    def __init__(self) -> None:
        subclasses = sorted(c.__name__ for c in _concrete(type(self)))
        raise TypeError(
            f"{type(self).__name__} is abstract; build one of its subclasses: "
            f"{', '.join(subclasses) or 'none'}."
        )


def _concrete(cls: type) -> list[type]:
    out: list[type] = []
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        if "__init__" in vars(sub) and vars(sub)["__init__"] is not Abstract.__init__:
            out.append(sub)
        out.extend(_concrete(sub))
    return out


def check_in(
    name: str,
    value: Any,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise naming ``name`` unless ``value`` is a number in the given interval."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"Invalid {name}={value!r}: must be in {left}{low}, {high}{right}.")


def check_int(name: str, value: Any, low: int) -> None:
    """Raise naming ``name`` unless ``value`` is an integer ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}={value!r}: must be an integer >= {low}.")


def check_bool(name: str, value: Any) -> None:
    """Raise naming ``name`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}={value!r}: must be True or False.")
