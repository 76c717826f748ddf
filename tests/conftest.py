"""Shared test configuration.

The tests mirror the package: ``tests/lm`` for :mod:`secondorder.lm`, ``tests/fitting``,
``tests/training``, ``tests/distributed``, ``tests/integrations``, ``tests/testing``,
``tests/bench`` for the benchmark harness in ``benchmarks/``, and ``tests/cuda`` for the
checks that need a GPU.  Tests that start gloo ranks (through
:func:`secondorder.testing.run_ranks`) carry the ``distributed`` marker, which skips
them where this torch build has no gloo backend.  Tests that compare a CUDA run with
its CPU reference carry the ``cuda`` marker, which skips them where
``torch.cuda.is_available()`` is False, unless ``SECONDORDER_TEST_CUDA_DEVICE=cpu``
asks for them to run on the CPU instead (see ``tests/cuda/conftest.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

#: The environment variable that names the device the ``cuda`` tests run on.
CUDA_DEVICE_VARIABLE = "SECONDORDER_TEST_CUDA_DEVICE"


def _gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def _cuda_tests_can_run() -> bool:
    """CUDA is there, or the ``cuda`` tests were asked to run on the CPU."""
    return torch.cuda.is_available() or os.environ.get(CUDA_DEVICE_VARIABLE) == "cpu"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: starts torch.distributed gloo ranks (skipped without gloo)"
    )
    config.addinivalue_line(
        "markers",
        "cuda: runs on a CUDA device; skipped where torch.cuda.is_available() is False "
        f"(unless {CUDA_DEVICE_VARIABLE}=cpu)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skips = []
    if not _gloo_available():
        skips.append(("distributed", "needs torch.distributed with the gloo backend"))
    if not _cuda_tests_can_run():
        skips.append(
            (
                "cuda",
                f"needs CUDA (torch.cuda.is_available() is False; {CUDA_DEVICE_VARIABLE}=cpu "
                "runs these tests on the CPU)",
            )
        )
    for marker, reason in skips:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
