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


def _bounds(
    above: float | None, at_least: float | None, below: float | None, at_most: float | None
) -> str:
    """`` > 0``, `` <= 1``, `` in [0, 1)``: the allowed range, as the messages say it."""
    low = "(" if above is not None else "[" if at_least is not None else None
    high = ")" if below is not None else "]" if at_most is not None else None
    lo = above if above is not None else at_least
    hi = below if below is not None else at_most
    if low is not None and high is not None:
        return f" in {low}{lo:g}, {hi:g}{high}"
    if low is not None:
        return f" {'>' if low == '(' else '>='} {lo:g}"
    if high is not None:
        return f" {'<' if high == ')' else '<='} {hi:g}"
    return ""


def check_number(
    name: str,
    value: object,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    type_error: bool = True,
    also: str = "",
) -> float:
    """A finite real number in the range the bounds give; returns it as a float.

    ``above``/``at_least`` bound it from below (strictly or not), ``below``/``at_most``
    from above (at most one of each pair).  Every failure has one message,
    ``Invalid {name}={value!r}: must be a finite number{range}{also}.``; a value that
    is not a real number (a string, a bool) raises it as :class:`TypeError` unless
    ``type_error=False``.  ``also`` names what else is accepted (", or a callable").
    """
    message = (
        f"Invalid {name}={value!r}: must be a finite number"
        f"{_bounds(above, at_least, below, at_most)}{also}."
    )
    if not _is_real(value):
        raise (TypeError if type_error else ValueError)(message)
    x = float(value)  # type: ignore[arg-type]
    ok = math.isfinite(x)
    ok = ok and (above is None or x > above) and (at_least is None or x >= at_least)
    ok = ok and (below is None or x < below) and (at_most is None or x <= at_most)
    if not ok:
        raise ValueError(message)
    return x


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
