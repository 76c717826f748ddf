"""Shared test configuration.

The tests mirror the package: ``tests/lm`` for :mod:`secondorder.lm`, ``tests/fitting``,
``tests/training``, ``tests/distributed``, ``tests/integrations``, ``tests/testing``, and
``tests/bench`` for the benchmark harness in ``benchmarks/``.  Tests that start gloo
ranks (through :func:`secondorder.testing.run_ranks`) carry the ``distributed`` marker,
which skips them where this torch build has no gloo backend.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist


def _gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: starts torch.distributed gloo ranks (skipped without gloo)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _gloo_available():
        return
    skip = pytest.mark.skip(reason="needs torch.distributed with the gloo backend")
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(skip)
