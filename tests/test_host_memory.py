"""glibc's allocator thresholds, raised once so a step's temporaries stay mapped.

Each case runs in a fresh interpreter (the thresholds are process state, and this
one has long since freed large blocks) and counts the page faults (``ru_minflt``)
of each of eleven full-batch LM steps on a sinc fit of 20,000 points, whose step
allocates and frees activations and gradients of 5 MB each.  With the thresholds
raised, about one run in six has one step that faults in a 5 MB block once (a
buffer of a new size); the other steps fault 0-3 times.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)

STEPS = textwrap.dedent(
    """
    import resource, sys
    import torch
    import secondorder.tuning
    from secondorder.lm import LevenbergMarquardt

    if sys.argv[1] == "raised":  # the user's opt-in
        secondorder.tuning.raise_allocator_thresholds()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x = torch.linspace(-1, 1, 20_000).unsqueeze(1)
    y = torch.sinc(10 * x)
    opt = LevenbergMarquardt(model)
    for _ in range(5):
        opt.step(x, y)
    faults = []
    for _ in range(11):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        opt.step(x, y)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(*faults)
    """
)


def faults_per_step(how: str) -> list[int]:
    """Each step's page faults, in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", STEPS, how], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return [int(v) for v in done.stdout.strip().splitlines()[-1].split()]


def test_the_optimizer_leaves_the_allocator_alone_unless_asked():
    """Building and stepping the optimizer changes no process-wide allocator setting.

    Left alone, each step faults in much of its 5 MB tensors again (measured: hundreds
    to thousands a step, varying with where the blocks land); once the user raises
    the thresholds (``secondorder.tuning``), ~0 faults a step.
    """
    untouched = faults_per_step("default")
    assert sum(untouched) / len(untouched) > 100, untouched
    raised = faults_per_step("raised")
    assert sum(f > 20 for f in raised) <= 1, raised


def test_the_thresholds_are_raised_once_per_process():
    """Once, whatever the default device (the block is a bare CPU storage)."""
    code = (
        "import torch; torch.set_default_device('meta'); "
        "from secondorder.tuning import raise_allocator_thresholds as r; print(r(), r())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
