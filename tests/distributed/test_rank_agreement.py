"""Ranks that meet different input signatures, and a rank whose step raises.

Two gloo ranks, one launch, several scenarios:

* ``signature``: at the second step rank 1's inputs have a new signature (an index
  tensor of another dtype) while rank 0's are known.  ``jacobian="auto"`` used to run
  its timed probe (a collective) on rank 1 only and both ranks hung; now every rank
  decides together.  The parameters must equal one process's on the concatenated
  batch.
* ``linearize`` / ``trial``: rank 1's model raises on a bad batch while linearising,
  or at a trial point; the loop on each rank catches the error and goes on.  Every
  rank must raise (rank 0 a :class:`RankFailedError`), and the next steps must equal
  one process that met the same error on the concatenated batch.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.distributed import LocalReducer
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
N = 16
DT = torch.float64
WEIGHTS = torch.linspace(0.5, 2.0, 6, dtype=DT)


class Net(nn.Module):
    """A Tanh MLP on ``(x, index)`` that raises on a bad batch when told to."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).to(DT)
        self.fail_on: str | None = None  # "linearize" (grad on) or "trial" (grad off)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        x, index = inputs
        # The batch probe (two samples) passes; linearising runs with grad, trials without.
        failing = self.fail_on is not None and x.shape[0] > 2
        if failing and (self.fail_on == "linearize") == torch.is_grad_enabled():
            raise ValueError("bad batch")
        out: Tensor = self.body(x) * (1 + 0 * index[:, None].to(x))
        return out


def six(outputs: Tensor, targets: Tensor) -> Tensor:
    # Six residuals per sample and 13 parameters: "auto" times both per-sample modes.
    return (outputs - targets) * WEIGHTS


def batch(step: int, index_dtype: torch.dtype = torch.int64) -> tuple[Any, Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.rand(N, 1, generator=g, dtype=DT) * 4 - 2
    return (x, torch.arange(N).to(index_dtype)), torch.sin(2 * x)


def shard(tree: Any, rank: int) -> Any:
    half = N // WORLD
    if isinstance(tree, tuple):
        return tuple(shard(t, rank) for t in tree)
    return tree[rank * half : (rank + 1) * half]


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def run(
    scenario: str, rank: int | None, reducer: Any = None
) -> list[tuple[Tensor, str | None, str]]:
    """Three steps; rank None is the single process on the concatenated batch."""
    model = Net()
    # "auto" times the per-sample modes: the signature scenario is about that choice; the
    # failure scenarios fix the Jacobian, since forward mode linearises without grad and
    # would move the failure from linearising to the trial point under some timings.
    jacobian = "auto" if scenario == "signature" else "reverse"
    opt = so.LevenbergMarquardt(model, six, reducer=reducer, jacobian=jacobian)
    out = []
    for step in range(3):
        dtype = torch.int32 if scenario == "signature" and step == 1 and rank == 1 else None
        inputs, targets = batch(step, dtype or torch.int64)
        if rank is not None:
            inputs, targets = shard(inputs, rank), shard(targets, rank)
        failing = scenario != "signature" and step == 1 and rank in (1, None)
        model.fail_on = scenario if failing else None
        try:
            info = opt.step(inputs, targets)
            what = info.jacobian
        except Exception as exc:
            what = f"{type(exc).__name__}: {exc}"
        out.append((flat(model), what, f"{opt.damping!r}"))
    return out


SCENARIOS = ("signature", "linearize", "trial")


def job(rank: int, world: int) -> dict[str, Any]:
    return {s: run(s, rank) for s in SCENARIOS}


@pytest.fixture(scope="module")
def ranks() -> dict[int, Any]:
    results = run_ranks(job, WORLD, timeout_s=60.0, deadline_s=240.0)
    return {r: res.unwrap() for r, res in results.items()}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks_agree_and_equal_one_process(ranks: dict[int, Any], scenario: str) -> None:
    single = run(scenario, None, LocalReducer())
    for step in range(3):
        (p0, w0, d0), (p1, w1, d1) = ranks[0][scenario][step], ranks[1][scenario][step]
        assert torch.equal(p0, p1) and d0 == d1
        assert math.isclose(float(d0), float(single[step][2]), rel_tol=1e-9)
        torch.testing.assert_close(p0, single[step][0], rtol=1e-9, atol=1e-12)
        if scenario != "signature" and step == 1:
            assert w1 == "ValueError: bad batch"
            assert single[step][1] == "ValueError: bad batch"
            assert w0.startswith("RankFailedError: 1 of 2 ranks raised while")
            assert d0 == ranks[0][scenario][0][2]  # a failed step leaves λ alone
        else:
            assert w0 == w1 and not w0.startswith(("ValueError", "Rank"))


def test_the_other_ranks_error_says_what_happened(ranks: dict[int, Any]) -> None:
    message = ranks[0]["linearize"][1][1]
    with pytest.raises(
        so.lm.problem.RankFailedError, match=r"1 of 2 ranks raised while linearising"
    ):
        raise so.lm.problem.RankFailedError(message.split(": ", 1)[1])
    assert "process group stays usable" in message
    assert "while evaluating a trial point" in ranks[0]["trial"][1][1]
