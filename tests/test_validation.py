"""The shared argument checks: what they accept, and the messages users see."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

from secondorder._validation import check_choice, check_integer, check_number, check_open_unit


def test_numbers_in_range_pass() -> None:
    check_number("lr", 0.5, above=0)
    check_number("lr", np.float32(0.5), above=0)  # NumPy scalars are numbers
    check_number("damping", 0, at_least=0)
    check_open_unit("tol", 0.5)
    check_open_unit("tol", None, allow_none=True)
    check_integer("epochs", 3)
    check_integer("available", 0, minimum=0)
    check_integer("slice_size", None, allow_none=True)
    check_integer("slice_size", np.int64(4))
    check_choice("form", "dual", ("primal", "dual"))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: check_number("lr", 0.0, above=0),
            ValueError,
            r"^Invalid lr=0\.0: must be a finite number > 0\.$",
        ),
        (
            lambda: check_number("lr", math.inf, above=0),
            ValueError,
            r"Invalid lr=inf: must be a finite",
        ),
        (
            lambda: check_number("damping", -1, at_least=0),
            ValueError,
            r"^Invalid damping=-1: must be a finite number >= 0\.$",
        ),
        (
            lambda: check_number("lr", "1", above=0),
            TypeError,
            r"^Invalid lr='1': must be a finite number > 0\.$",
        ),
        (
            lambda: check_number("lr", True, above=0),
            TypeError,
            r"^Invalid lr=True: must be a finite number > 0\.$",
        ),
        (
            lambda: check_number("beta", 1.0, at_least=0, below=1),
            ValueError,
            r"^Invalid beta=1\.0: must be a finite number in \[0, 1\)\.$",
        ),
        (
            lambda: check_number("eps", 2.0, at_most=1),
            ValueError,
            r"^Invalid eps=2\.0: must be a finite number <= 1\.$",
        ),
        (
            lambda: check_number("damping", "big", above=0, also=", or a callable of the step"),
            TypeError,
            r"^Invalid damping='big': must be a finite number > 0, or a callable of the step\.$",
        ),
        (
            lambda: check_number("ftol", "x", at_least=0, type_error=False),
            ValueError,
            r"^Invalid ftol='x': must be a finite number >= 0\.$",
        ),
        (
            lambda: check_number("damping_up", 1.0, above=1, type_error=False),
            ValueError,
            r"^Invalid damping_up=1\.0: must be a finite number > 1\.$",
        ),
        (
            lambda: check_open_unit("tol", 1.0),
            ValueError,
            r"^Invalid tol=1\.0: must be a number in \(0, 1\)\.$",
        ),
        (
            lambda: check_open_unit("tol", "a", allow_none=True),
            TypeError,
            r"^Invalid tol='a': must be None or a number in \(0, 1\)\.$",
        ),
        (
            lambda: check_integer("epochs", 0),
            ValueError,
            r"^Invalid epochs=0: must be an integer >= 1\.$",
        ),
        (
            lambda: check_integer("epochs", 2.0),
            ValueError,
            r"^Invalid epochs=2\.0: must be an integer >= 1\.$",
        ),
        (
            lambda: check_integer("epochs", False),
            ValueError,
            r"^Invalid epochs=False: must be an integer >= 1\.$",
        ),
        (
            lambda: check_integer("patience", -1, allow_none=True),
            ValueError,
            r"^Invalid patience=-1: must be an integer >= 1 or None\.$",
        ),
        (
            lambda: check_integer("available", -1, minimum=0),
            ValueError,
            r"^Invalid available=-1: must be an integer >= 0\.$",
        ),
        (
            lambda: check_choice("form", "x", ("primal", "dual")),
            ValueError,
            r"^Unknown form='x'; valid choices are \('primal', 'dual'\)\.$",
        ),
        (
            lambda: check_choice("jac", "x", ("fwd",), extra=" or a callable"),
            ValueError,
            r"^Unknown jac='x'; valid choices are \('fwd',\) or a callable\.$",
        ),
    ],
)
def test_bad_values_raise_naming_argument_value_and_range(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call()


def _families() -> list[tuple[str, Any]]:
    from torch import nn

    import secondorder as so

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2))

    return [
        ("LevenbergMarquardt", lambda lr: so.LevenbergMarquardt(model(), lr=lr)),
        ("KFAC", lambda lr: so.KFAC(model(), lr=lr)),
        ("KFACOptimizer", lambda lr: so.KFACOptimizer(model(), lr=lr)),
        ("Shampoo", lambda lr: so.Shampoo(model().parameters(), lr=lr)),
    ]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "0.1"])
def test_a_bad_lr_gets_one_message_shape_from_every_family(bad: object) -> None:
    for family, build in _families():
        with pytest.raises((TypeError, ValueError)) as raised:
            build(bad)
        message = str(raised.value)
        assert re.match(rf"Invalid lr={re.escape(repr(bad))}: must be a finite number", message), (
            family,
            message,
        )
