"""The attempt loop of :mod:`secondorder.lm.engine`: λ's bounds on every way out.

Reference: the capturable step on the same model and data, which keeps λ within
``damping_max`` by construction (a clamp in its tensor form), and the bound itself.
"""

from __future__ import annotations

import torch
from torch import nn

import secondorder as so


def _linear() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(4, 1)


def test_damping_stays_within_its_maximum_when_ftol_or_xtol_stop_a_rejection() -> None:
    # Noisy linear data in float32: once the fit is at rounding level every attempt is
    # rejected and the ftol/xtol tests stop the iteration, λ raised each time.
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x @ torch.randn(4, 1) + 0.01 * torch.randn(256, 1)
    a_model, b_model = _linear(), _linear()
    a = so.LevenbergMarquardt(a_model, damping=1.0)
    b = so.LevenbergMarquardt(b_model, damping=1.0, capturable=True, candidates=10)
    stopped_rejected = 0
    for _ in range(20):
        ia, ib = a.step(x, y), b.step(x, y)
        assert ia.damping <= a.config.damping_max
        assert ia.damping == float(ib.damping) and ia.attempts == int(ib.attempts)
        assert torch.equal(a_model.weight, b_model.weight)
        stopped_rejected += (not ia.accepted) and ia.status in (2, 3, 4)
    assert stopped_rejected > 0  # the way out under test was taken
    assert a.damping == a.config.damping_max
    # Its checkpoint loads (a λ above damping_max is refused).
    so.LevenbergMarquardt(_linear(), damping=1.0).load_state_dict(a.state_dict())
