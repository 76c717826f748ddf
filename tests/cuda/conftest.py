"""The device the ``cuda`` tests run on, and how to check these tests without a GPU.

Every test here runs a computation on :func:`device` and compares it with a reference
on the CPU (float64 unless it says otherwise), a ``torch.linalg`` result or a
single-process run.  The device is ``cuda:0``, or the one
``SECONDORDER_TEST_CUDA_DEVICE`` names (``cuda:1``, ...).

``SECONDORDER_TEST_CUDA_DEVICE=cpu`` runs the same tests with the CPU in place of the
CUDA device, and lifts the skip that ``tests/conftest.py`` puts on the ``cuda`` marker
where CUDA is absent.  It exists to check the test code itself on a machine without
a GPU: the comparisons are then CPU against CPU (most agree bit for bit), and the
tests that only mean something on CUDA (sync debug mode, NCCL) skip::

    SECONDORDER_TEST_CUDA_DEVICE=cpu python -m pytest -q tests/cuda
"""

from __future__ import annotations

import os

import pytest
import torch

VARIABLE = "SECONDORDER_TEST_CUDA_DEVICE"


def configured_device() -> torch.device:
    """The device named by :data:`VARIABLE` (default ``cuda:0``), checked."""
    name = os.environ.get(VARIABLE, "cuda:0")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise pytest.UsageError(f"Invalid {VARIABLE}={name!r}: {exc}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise pytest.UsageError(
            f"Invalid {VARIABLE}={name!r}: name a CUDA device such as 'cuda:0', or 'cpu' to "
            "check these tests without a GPU"
        )
    index = 0 if dev.index is None else dev.index
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise pytest.UsageError(
            f"Invalid {VARIABLE}={name!r}: this process sees {count} CUDA device(s)"
        )
    return torch.device("cuda", index)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the computation under test runs: a CUDA device, or the CPU in CPU mode."""
    return configured_device()


@pytest.fixture(scope="session")
def cuda_only(device: torch.device) -> torch.device:
    """:func:`device`, for a test that means nothing on the CPU: skipped in CPU mode."""
    if device.type != "cuda":
        pytest.skip(f"needs a CUDA device ({VARIABLE}=cpu runs the other tests on the CPU)")
    return device
