"""An interrupt in a later attempt of a later step leaves no trace .

Speed work carries state from one step to the next (a pooled Jacobian buffer, the
accepted trial's forward pass reused for the next linearisation).  Whatever is carried,
the promise of :meth:`LevenbergMarquardt.step` stands: if anything raises during a step,
the parameters, λ and the state dict are bitwise as before, and the next step is
bitwise the step of a fresh optimizer loaded from that state dict.  The reference is
that fresh optimizer on a copy of the model.

The interrupt is injected by a residual function: after a few clean steps, the first
trial point of a step gets non-finite residuals (the attempt is rejected and λ raised)
and the second trial point raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from unchanged import same_state

import secondorder as so
from secondorder.lm.checkpoint import entries

F32 = torch.float32


class Interrupting:
    """A residual function that, when armed, spoils trial points of the current step.

    Calls with autograd on are the linearisation; the no-grad calls after them are
    trial evaluations, ``slices`` calls per trial point.  ``plan`` maps a trial number
    (1-based) to ``"nan"`` or ``"interrupt"``.
    """

    def __init__(self, inner: Callable[[Tensor, Tensor], Tensor], slices: int) -> None:
        self.inner = inner
        self.slices = slices
        self.plan: dict[int, str] = {}
        self.arm({})

    def arm(self, plan: dict[int, str]) -> None:
        self.plan = dict(plan)
        self.linearised = False
        self.trial_calls = 0

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        r = self.inner(outputs, targets)
        if torch.is_grad_enabled():
            self.linearised = True
            return r
        if not self.linearised:  # the batch check before the step
            return r
        self.trial_calls += 1
        trial = (self.trial_calls - 1) // self.slices + 1
        kind = self.plan.get(trial)
        if kind == "nan":
            return r * math.nan
        if kind == "interrupt":
            raise KeyboardInterrupt(f"injected interrupt in trial {trial}")
        return r


def _sinc(points: int) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1.0, 1.0, points, dtype=F32).unsqueeze(1)
    return x, torch.sinc(10.0 * x)


def _classes() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(24, 16, generator=gen), torch.randint(0, 10, (24,), generator=gen)


def _mlp(sizes: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


# name -> (model sizes, data, residual, slices per batch, options)
CASES: dict[str, tuple[list[int], Any, Any, int, dict[str, Any]]] = {
    "primal-float32-full-batch": ([1, 16, 1], _sinc(400), so.residuals.mse, 1, {}),
    "primal-float32-sliced": ([1, 16, 1], _sinc(400), so.residuals.mse, 4, {"slice_size": 100}),
    "primal-float64-gram": (
        [1, 16, 1],
        _sinc(400),
        so.residuals.mse,
        1,
        {"gram_dtype": torch.float64},
    ),
    "dual-cross-entropy": ([16, 32, 10], _classes(), so.residuals.cross_entropy, 1, {}),
}


def _bitwise_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


#: The default step, and the capturable one trying every attempt in one pass.
MODES = {"default": {}, "capturable": {"capturable": True, "candidates": 10}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_interrupt_in_a_later_attempt_leaves_no_trace(case: str, mode: str) -> None:
    sizes, (x, y), inner, slices, options = CASES[case]
    options = {"jacobian": "reverse", **MODES[mode], **options}
    model = _mlp(sizes)
    res = Interrupting(inner, slices)
    opt = so.LevenbergMarquardt(model, res, **options)
    for _ in range(3):
        opt.step(x, y)

    before = copy.deepcopy(model)
    state = copy.deepcopy(opt.state_dict())
    damping = opt.damping
    res.arm({1: "nan", 2: "interrupt"})
    with pytest.raises(KeyboardInterrupt, match="injected interrupt in trial 2"):
        opt.step(x, y)
    assert res.trial_calls == slices + 1, "the interrupt must come in the second attempt"
    assert _bitwise_params(model, before)
    assert opt.damping == damping
    assert same_state(entries(opt.state_dict()), entries(state))

    # The next step equals a fresh optimizer's, loaded from the state before the failure.
    res.arm({})
    fresh_model = copy.deepcopy(before)
    fresh = so.LevenbergMarquardt(fresh_model, Interrupting(inner, slices), **options)
    fresh.load_state_dict(copy.deepcopy(state))
    info, ref = opt.step(x, y), fresh.step(x, y)
    assert info.accepted == ref.accepted and info.attempts == ref.attempts
    assert info.loss == ref.loss and info.damping == ref.damping
    assert _bitwise_params(model, fresh_model)
    assert same_state(entries(opt.state_dict()), entries(fresh.state_dict()))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["primal-float32-full-batch", "dual-cross-entropy"])
def test_a_rejected_step_leaves_the_next_step_unchanged(case: str, mode: str) -> None:
    """A step whose every attempt fails moves λ only: the step after it equals a fresh one's."""
    sizes, (x, y), inner, slices, options = CASES[case]
    capturable = {"capturable": True, "candidates": 2} if mode == "capturable" else {}
    options = {"jacobian": "reverse", "max_attempts": 2, **capturable, **options}
    model = _mlp(sizes)
    res = Interrupting(inner, slices)
    opt = so.LevenbergMarquardt(model, res, **options)
    for _ in range(2):
        opt.step(x, y)
    before = copy.deepcopy(model)
    res.arm({1: "nan", 2: "nan"})
    info = opt.step(x, y)
    assert not info.accepted and info.attempts == 2
    assert _bitwise_params(model, before)
    state = copy.deepcopy(opt.state_dict())
    res.arm({})
    fresh_model = copy.deepcopy(before)
    fresh = so.LevenbergMarquardt(fresh_model, Interrupting(inner, slices), **options)
    fresh.load_state_dict(state)
    info, ref = opt.step(x, y), fresh.step(x, y)
    assert info.loss == ref.loss and info.damping == ref.damping
    assert _bitwise_params(model, fresh_model)


class _TripwireBatchNorm(nn.Module):
    """Linear-BatchNorm-Tanh-Linear that, when armed, raises in its real forward.

    The optimizer evaluates the model functionally (parameters swapped in as plain
    tensors); the one call with the model's own ``nn.Parameter``s and no autograd is
    the forward that updates BatchNorm's running statistics after an accepted step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        real = isinstance(self.lin.weight, nn.Parameter) and not torch.is_grad_enabled()
        h = self.bn(self.lin(x))  # the running statistics move first, as in a real run
        if real and self.armed:
            raise KeyboardInterrupt("interrupt in the running-statistics forward")
        return self.out(torch.tanh(h))


def test_an_interrupt_in_the_batchnorm_statistics_forward_leaves_no_trace() -> None:
    """Parameters, running statistics and state as before; the next step as a fresh one's."""
    torch.manual_seed(0)
    model = _TripwireBatchNorm()
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    before, state = copy.deepcopy(model), copy.deepcopy(opt.state_dict())
    model.armed = True
    with pytest.raises(KeyboardInterrupt, match="running-statistics forward"):
        opt.step(x, y)
    for (name, a), b in zip(model.state_dict().items(), before.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert same_state(entries(opt.state_dict()), entries(state))

    model.armed = False
    fresh_model = copy.deepcopy(before)
    fresh = so.LevenbergMarquardt(fresh_model)
    fresh.load_state_dict(copy.deepcopy(state))
    info, ref = opt.step(x, y), fresh.step(x, y)
    assert info.accepted and info.loss == ref.loss
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
