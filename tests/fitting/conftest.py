"""Markers scipy's own test files use, registered so ``--strict-markers`` accepts them.

tests/fitting/test_scipy_suite.py runs scipy's ``test_least_squares.py`` and
``test_minpack.py`` against secondorder; their tests carry scipy's markers.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    for name in ("fail_slow", "parallel_threads_limit", "thread_unsafe", "xslow"):
        config.addinivalue_line("markers", f"{name}: a marker of scipy's test suite")
