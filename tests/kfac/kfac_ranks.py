"""The set-up the K-FAC rank tests share: network, data, shards, step, launch, comparison.

``test_kfac_distributed`` (DDP and plain models) and ``test_kfac_fsdp`` (FSDP2) train
the same kind of small network, every K-FAC layer kind (an embedding, a 1-D
convolution, two linear layers), with K-FAC and SGD on each rank's share of one global
batch, and compare with one process on the concatenated batch.  Each test keeps its
own network sizes, seeds and activations; what they share lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from secondorder.testing import run_ranks

__all__ = [
    "ATOL",
    "DT",
    "RTOL",
    "SETTINGS",
    "STEPS",
    "N",
    "Net",
    "assert_ranks_match",
    "batch",
    "launcher",
    "loss",
    "momentum_sgd",
    "shard",
]

DT = torch.float64
N = 8  # global batch
STEPS = 3
TOKENS = 5  # per sample

#: K-FAC's settings in both tests (a scenario adds or overrides some).
SETTINGS: dict[str, Any] = {
    "damping": 0.05,
    "kl_clip": 1e-2,
    "lr": 0.1,
    "inv_update_steps": 2,
    "inv_dtype": DT,
}

#: Against one process: reduction order ~1e-16, amplified by the damped solve (see
#: test_kfac_distributed's docstring).  Across ranks: bitwise.
RTOL, ATOL = 1e-10, 1e-12


class Net(nn.Module):
    """Embedding, Conv1d over the tokens, then two linear layers; ``act`` between them.

    ``seed`` seeds the initialisation; the layers are built in this order.
    """

    def __init__(
        self,
        *,
        seed: int,
        vocab: int,
        conv: dict[str, Any],
        hidden: int,
        out: int,
        act: Callable[[Tensor], Tensor],
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, 4)
        self.conv = nn.Conv1d(4, 6, 3, **conv)
        self.fc1 = nn.Linear(6 * TOKENS, hidden)
        self.fc2 = nn.Linear(hidden, out)
        self.act = act

    def forward(self, idx: Tensor) -> Tensor:
        h = self.act(self.conv(self.emb(idx).transpose(1, 2))).flatten(1)
        out: Tensor = self.fc2(self.act(self.fc1(h)))
        return out


def batch(seed: int, vocab: int, out: int) -> tuple[Tensor, Tensor]:
    """The global batch: ``N`` samples of token indices and float64 regression targets."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, vocab, (N, TOKENS), generator=g),
        torch.randn(N, out, generator=g, dtype=DT),
    )


def shard(x: Tensor, y: Tensor, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """This rank's rows of the global batch (equal shares; one process takes it all)."""
    b = N // world
    return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]


def loss(out: Tensor, y: Tensor) -> Tensor:
    """Half the squared error, summed over outputs, averaged over this rank's samples."""
    return 0.5 * ((out - y) ** 2).sum(1).mean()


def momentum_sgd(model: nn.Module) -> torch.optim.SGD:
    """The optimizer K-FAC preconditions for in both tests."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def launcher(
    job: Callable[..., Any], *, deadline_s: float, timeout_s: float
) -> Callable[..., tuple[int, dict[int, Any]]]:
    """A module-scoped fixture: ``(world, results by rank)`` of ``job`` on 2, then 4 ranks."""

    @pytest.fixture(scope="module", params=[2, 4])
    def launched(request: pytest.FixtureRequest) -> tuple[int, dict[int, Any]]:
        world = request.param
        results = run_ranks(job, world, deadline_s=deadline_s, timeout_s=timeout_s)
        return world, {r: res.unwrap() for r, res in results.items()}

    return launched


def assert_ranks_match(by_rank: list[Tensor], ref: Tensor, what: str) -> None:
    """Rank 0 equals one process to ``RTOL``/``ATOL``; every other rank equals rank 0 bitwise."""
    got = by_rank[0]
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    for r, other in enumerate(by_rank[1:], start=1):
        assert torch.equal(other, got), f"{what} rank {r}"
