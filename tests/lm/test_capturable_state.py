"""What the capturable step keeps between calls (:mod:`secondorder.lm.graphs`).

Its stop flag across checks and checkpoints, an interrupt in a check step's host read,
and what a captured graph is kept for.  Reference: the default step on the same model
and data, in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import secondorder as so

F64 = torch.float64
ATOL = 1e-12


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)


def _sinc(points: int = 64) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1.0, 1.0, points, dtype=F64).unsqueeze(1)
    return x, torch.sinc(3.0 * x)


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _InterruptAtRead(TorchFunctionMode):
    """Ctrl-C while the host waits in a host read (``Tensor.tolist``)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "tolist":
            raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def test_an_interrupt_in_the_check_read_leaves_the_step_done() -> None:
    x, y = _sinc()
    a_model, b_model = _mlp(), _mlp()
    a = so.LevenbergMarquardt(a_model, damping=1.0)
    b = so.LevenbergMarquardt(b_model, damping=1.0, capturable=True, candidates=10, check_every=2)
    a.step(x, y), b.step(x, y)
    a.step(x, y)
    with pytest.raises(KeyboardInterrupt), _InterruptAtRead():
        b.step(x, y)  # the second step: a check step
    # All of the step or none of it: here all (the model was written before the read).
    torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)
    sa, sb = a.state_dict()["state"][0], b.state_dict()["state"][0]
    assert sb["steps"] == sa["steps"] == 2
    assert sb["damping"] == pytest.approx(sa["damping"], rel=1e-12)
    # The run goes on as the default step's.
    for _ in range(3):
        ia, ib = a.step(x, y), b.step(x, y)
        assert bool(ib.accepted) == ia.accepted
    torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)


def test_a_stop_flag_survives_an_interrupted_check() -> None:
    # Exact data for the model: the step stops at gtol; the check that would
    # report it is interrupted, so the next check does.
    x, y = _sinc()
    model = _mlp()
    opt = so.LevenbergMarquardt(model, capturable=True, check_every=1)
    opt.step(x, y)  # the first step of a batch shape reads its choices on the host
    with torch.no_grad():
        exact = model(x)
    with pytest.raises(KeyboardInterrupt), _InterruptAtRead():
        opt.step(x, exact)
    assert opt.state_dict()["state"][0]["steps"] == 2
    info = opt.step(x, exact)
    assert info.terminated and info.reason.startswith("gtol")


def test_a_loaded_checkpoint_drops_the_pending_stop() -> None:
    x, y = _sinc()
    model = _mlp()
    with torch.no_grad():
        exact = model(x)
    opt = so.LevenbergMarquardt(model, capturable=True, check_every=2)
    assert not opt.step(x, exact).terminated  # gtol: decided, not read yet
    # A checkpoint of another run, one step in; the reference resumes it too.
    donor_model = _mlp(seed=1)
    donor = so.LevenbergMarquardt(donor_model)
    donor.step(x, y)
    state = copy.deepcopy(donor.state_dict())
    twin = copy.deepcopy(donor_model)
    reference = so.LevenbergMarquardt(twin)
    reference.load_state_dict(state)
    with torch.no_grad():
        for p, q in zip(model.parameters(), donor_model.parameters(), strict=True):
            p.copy_(q)
    opt.load_state_dict(state)
    expected, got = reference.step(x, y), opt.step(x, y)  # step 2: a check step
    assert not expected.terminated
    assert got.terminated == expected.terminated
    torch.testing.assert_close(_flat(model), _flat(twin), atol=ATOL, rtol=0.0)


def test_a_graph_is_kept_per_training_mode() -> None:
    # A BatchNorm model in eval() runs other operations than in train(): a step
    # captured in one mode must not be replayed in the other.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)).to(F64)
    x, y = _sinc(32)
    opt = so.LevenbergMarquardt(model, capturable=True)
    steps = opt._device
    assert steps is not None
    setup, _, _ = opt._setup(x, y, None)
    train_key = steps.key(setup, 1.0)
    model.eval()
    eval_key = steps.key(setup, 1.0)
    model.train()
    assert train_key != eval_key and steps.key(setup, 1.0) == train_key
