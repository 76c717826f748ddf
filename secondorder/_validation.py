"""One set of argument checks and the messages users see, shared by every family.

Each check names the argument, shows the value and says what is allowed, and raises
before anything changes.  A value of the wrong type (a string where a number belongs)
raises :class:`TypeError` where the caller asks for it, :class:`ValueError` otherwise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection

__all__ = ["check_choice", "check_integer", "check_number", "check_open_unit"]


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(
    name: str,
    value: object,
    *,
    above: float | None = None,
    at_least: float | None = None,
    type_error: bool = True,
) -> None:
    """A finite real number, ``> above`` or ``>= at_least`` (at most one of them).

    ``type_error``: a non-number raises ``TypeError("{name} must be a number, ...")``;
    otherwise it raises the same :class:`ValueError` as an out-of-range number.
    """
    bound = (
        f" > {above:g}"
        if above is not None
        else f" >= {at_least:g}"
        if at_least is not None
        else ""
    )
    message = f"Invalid {name}={value!r}: must be a finite number{bound}."
    if not _is_real(value):
        if type_error:
            raise TypeError(f"{name} must be a number, got {value!r}")
        raise ValueError(message)
    x = float(value)  # type: ignore[arg-type]
    if not math.isfinite(x) or (above is not None and not x > above):
        raise ValueError(message)
    if at_least is not None and not x >= at_least:
        raise ValueError(message)


def check_open_unit(name: str, value: object, *, allow_none: bool = False) -> None:
    """A number strictly between 0 and 1 (or ``None`` where ``allow_none``)."""
    if value is None and allow_none:
        return
    what = "None or a number" if allow_none else "a number"
    message = f"Invalid {name}={value!r}: must be {what} in (0, 1)."
    if not _is_real(value):
        raise TypeError(message)
    if not 0.0 < float(value) < 1.0:  # type: ignore[arg-type]
        raise ValueError(message)


def check_integer(name: str, value: object, *, minimum: int = 1, allow_none: bool = False) -> None:
    """An integer (not a bool) ``>= minimum``, or ``None`` where ``allow_none``."""
    if value is None and allow_none:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        more = " or None" if allow_none else ""
        raise ValueError(f"Invalid {name}={value!r}: must be an integer >= {minimum}{more}.")


def check_choice(name: str, value: object, choices: Collection[object], extra: str = "") -> None:
    """One of ``choices``; ``extra`` adds to the list (", or a callable")."""
    if value not in choices:
        raise ValueError(f"Unknown {name}={value!r}; valid choices are {tuple(choices)}{extra}.")
