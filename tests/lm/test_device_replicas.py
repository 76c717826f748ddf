"""Device replicas follow the model: what a step sees on each device is the model as it is now.

With ``devices=[...]`` the optimizer evaluates slices on copies of the model; before
each step the copies take the model's parameters, buffers, train/eval modes and its
plain attributes (a scale, a temperature, a flag set by the training loop).  The
reference is the same optimizer on one device, whose only copy is the model itself.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.distributed.devices import replicate_module, sync_replica

F64 = torch.float64


class Scaled(nn.Module):
    """``k · tanh(Wx + b) · v``: ``k`` and ``mode`` are plain Python attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(1, 4)
        self.out = nn.Linear(4, 1)
        self.k = 1.0
        self.mode = "tanh"
        self.offset = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x)) if self.mode == "tanh" else torch.sin(self.hidden(x))
        return self.k * self.out(h) + self.offset


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(24, 1, generator=g, dtype=F64) * 2 - 1
    return x, torch.sin(3 * x)


def _run(devices: list[str] | None, change: dict[str, object]) -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    model = Scaled().double()
    x, y = _data()
    opt = so.LevenbergMarquardt(model, devices=devices)
    losses = [opt.step(x, y).loss_before]
    for name, value in change.items():
        setattr(model, name, value)
    losses.append(opt.step(x, y).loss_before)
    with torch.no_grad():
        losses.append(float(((model(x) - y) ** 2).mean()))
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "change",
    [
        {"k": 3.0},
        {"mode": "sin"},
        {"offset": torch.tensor(0.5, dtype=F64)},
        {"k": 2.0, "mode": "sin"},
    ],
    ids=["float", "str", "tensor", "two"],
)
def test_attributes_changed_between_steps_reach_every_replica(change: dict[str, object]) -> None:
    # Before: the second replica kept k = 1.0 (or the old mode): loss_before mixed the
    # old model's residuals on one device with the new one's on the other, silently.
    losses, params = _run(["cpu", "cpu"], change)
    ref_losses, ref_params = _run(None, change)
    # Two devices add the Gram in another order than one: equal to rounding.
    assert losses[1] == pytest.approx(ref_losses[1], rel=1e-9)
    assert losses[2] == pytest.approx(ref_losses[2], rel=1e-9)
    torch.testing.assert_close(params, ref_params, rtol=1e-8, atol=1e-10)


def test_sync_copies_values_not_references_and_leaves_torch_internals() -> None:
    model = Scaled().double()
    (_, replica) = replicate_module(model, [torch.device("cpu")] * 2)
    assert replica is not model
    model.offset = torch.tensor(2.0, dtype=F64)
    model.k = 4.0
    model.extra = (1, "a")  # an attribute added after the copy was made
    sync_replica(model, replica)
    assert replica.k == 4.0 and replica.extra == (1, "a")
    assert torch.equal(replica.offset, model.offset) and replica.offset is not model.offset
    # The replica's own parameters and modules stay its own.
    assert all(a is not b for a, b in zip(model.parameters(), replica.parameters(), strict=True))
    assert replica.hidden is not model.hidden
    # An unchanged tensor attribute is not copied again (the copy made last time stays).
    kept = replica.offset
    sync_replica(model, replica)
    assert replica.offset is kept
