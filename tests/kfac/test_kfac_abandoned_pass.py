"""A pass that is abandoned (an error mid-forward, an interrupted backward, a refused
step) does not poison later steps: they run, and equal a K-FAC that never saw it.

References: the same model and data on a K-FAC whose loop never failed, compared
bitwise; for an interrupted backward, per layer, the run whose statistics are those
the backward reached before the interrupt.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from secondorder.kfac import KFAC
from tests.kfac.faults import same, state_of

DT = torch.float64


class Fails(nn.Module):
    """Raises in its forward while ``armed`` (an out-of-memory batch, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise MemoryError("out of memory in the middle of the model")
        return torch.tanh(x)


def make() -> tuple[nn.Sequential, KFAC]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), Fails(), nn.Linear(6, 3)).to(DT)
    return net, KFAC(net, damping=0.1, kl_clip=1e-2, factor_decay=0.5, inv_dtype=DT)


def batch(i: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g, dtype=DT), torch.randn(8, 3, generator=g, dtype=DT)


def loss(net: nn.Module, i: int) -> Tensor:
    x, y = batch(i)
    return 0.5 * (net(x) - y).pow(2).sum(1).mean()


def train(net: nn.Module, k: KFAC, batches: list[int]) -> None:
    for i in batches:
        net.zero_grad()
        loss(net, i).backward()
        k.step()


def test_forward_that_raises_after_the_first_layer_is_forgotten() -> None:
    net, k = make()
    ref_net, ref = make()
    train(net, k, [0])
    net[1].armed = True
    with pytest.raises(MemoryError, match="out of memory"):
        loss(net, 1)  # the first Linear ran forward; the batch is skipped
    net[1].armed = False
    train(net, k, [2, 3])
    train(ref_net, ref, [0, 2, 3])
    assert same(state_of(k, net), state_of(ref, ref_net))


def test_interrupted_backward_keeps_each_layer_consistent() -> None:
    # The interrupt strikes after the last Linear's statistics entered, before the
    # first Linear's: the last layer has two batches (the interrupted one and the
    # next), the first one batch, and each layer's A and G describe the same samples.
    net, k = make()
    train(net, k, [0])
    net.zero_grad()
    x, y = batch(1)
    h = net[1](net[0](x))

    def interrupt(_: Tensor) -> None:
        raise KeyboardInterrupt("Ctrl-C in backward")

    h.register_hook(interrupt)
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C in backward"):
        (0.5 * (net[2](h) - y).pow(2).sum(1).mean()).backward()
    train(net, k, [2])

    both_net, both = make()  # batches 1 and 2 fully backpropagated before step 2
    train(both_net, both, [0])
    for i in (1, 2):
        both_net.zero_grad()
        loss(both_net, i).backward()
    both.step()
    one_net, one = make()  # batch 2 only
    train(one_net, one, [0, 2])
    for name, ref in (("2", both), ("0", one)):
        layer, want = k.layers[name], ref.layers[name]
        assert layer.A is not None and want.A is not None
        assert layer.G is not None and want.G is not None
        assert torch.equal(layer.A, want.A) and torch.equal(layer.G, want.G), name


def test_refused_step_then_fixed_loop_trains_like_a_clean_run() -> None:
    net, k = make()
    ref_net, ref = make()
    train(net, k, [0])
    net.eval()  # the mistake: a training step in eval mode
    net.zero_grad()
    loss(net, 1).backward()
    with pytest.raises(RuntimeError, match=r"layer '0' \(Linear\) has a gradient but is in eval"):
        k.step()
    net.train()  # fixed: the same batch again, in training mode
    train(net, k, [1, 2])
    train(ref_net, ref, [0, 1, 2])
    assert same(state_of(k, net), state_of(ref, ref_net))


def test_training_mode_metric_between_backward_and_step_is_left_out() -> None:
    net, k = make()
    ref_net, ref = make()
    for i in range(3):
        net.zero_grad()
        loss(net, i).backward()
        loss(net, 10 + i)  # a metric in training mode, never backpropagated
        k.step()
    train(ref_net, ref, [0, 1, 2])
    assert same(state_of(k, net), state_of(ref, ref_net))
