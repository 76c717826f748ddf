"""A layer called with its input as a keyword (``lin(input=x)``) is preconditioned as usual.

A forward hook sees keyword arguments only when registered ``with_kwargs``; K-FAC's
hook read ``inputs[0]`` and raised ``IndexError: tuple index out of range`` from inside
the model's forward.  The reference is the same model calling its layers positionally:
factors, decompositions and preconditioned gradients bitwise equal, for Embedding,
Conv1d and Linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from secondorder.kfac import KFAC
from tests.kfac.faults import same, state_of

DT = torch.float64


class Net(nn.Module):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.emb = nn.Embedding(7, 4, dtype=DT)
        self.conv = nn.Conv1d(4, 5, 3, padding=1, dtype=DT)
        self.lin = nn.Linear(5, 2, dtype=DT)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.keyword:
            h = self.conv(input=self.emb(input=idx).mT)
            return self.lin(input=torch.tanh(h).mT)
        h = self.conv(self.emb(idx).mT)
        return self.lin(torch.tanh(h).mT)


def run(keyword: bool) -> dict[str, object]:
    torch.manual_seed(0)
    net = Net(keyword)
    kfac = KFAC(net, damping=0.1, inv_dtype=DT)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        idx = torch.randint(0, 7, (4, 6), generator=g)
        net.zero_grad()
        net(idx).pow(2).mean().backward()
        kfac.step()
    return state_of(kfac, net)


def test_keyword_input_equals_positional_input() -> None:
    assert same(run(keyword=True), run(keyword=False))
