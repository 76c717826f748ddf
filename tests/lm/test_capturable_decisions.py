"""The capturable step's decisions at the edges: attempt limits, refused points, dtypes.

Reference: the default step on the same model and data (float64 on the CPU unless a
test is about float32), which the capturable step must equal where their rules
coincide (:mod:`secondorder.lm.capturable`).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import secondorder as so

F64 = torch.float64
#: Parameters of the two modes after the same steps, float64 on the CPU.
ATOL = 1e-12


def _mlp(hidden: int = 8, dtype: torch.dtype = F64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)


def _sinc(points: int = 64, dtype: torch.dtype = F64) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1.0, 1.0, points, dtype=F64).unsqueeze(1)
    return x.to(dtype), torch.sinc(3.0 * x).to(dtype)


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _pair(capturable: dict[str, Any], **options: Any) -> tuple[Any, Any, nn.Module, nn.Module]:
    a_model, b_model = _mlp(), _mlp()
    a = so.LevenbergMarquardt(a_model, **options)
    b = so.LevenbergMarquardt(b_model, capturable=True, **capturable, **options)
    return a, b, a_model, b_model


# -- the attempt limit ---------------------------------------------------------------------


@pytest.mark.parametrize(("max_attempts", "candidates"), [(1, 1), (1, 4), (2, 5), (3, 3)])
def test_max_attempts_bounds_the_candidates_tried(max_attempts: int, candidates: int) -> None:
    # λ far too small: the first steps exhaust their attempts and stop, as the default
    # step does after max_attempts rejections, however many candidates there are.
    a, b, a_model, b_model = _pair(
        {"candidates": candidates, "check_every": 1}, max_attempts=max_attempts, damping=1e-6
    )
    x, y = _sinc()
    exhausted = 0
    for _ in range(10):
        ia, ib = a.step(x, y), b.step(x, y)
        assert bool(ib.accepted) == ia.accepted and int(ib.attempts) == ia.attempts
        assert ib.terminated == ia.terminated and int(ib.status) == ia.status
        assert float(ib.damping) == pytest.approx(ia.damping, rel=1e-12)
        torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)
        exhausted += ia.terminated and "exhausted" in ia.reason
    assert exhausted > 0  # the case under test happened


# -- Moré's running scale ------------------------------------------------------------------


@pytest.mark.parametrize("candidates", [1, 10])
def test_a_refused_batch_leaves_the_more_scale_alone(candidates: int) -> None:
    # max_attempts = candidates: each call of the two modes tries the same attempts.
    a, b, a_model, b_model = _pair(
        {"candidates": candidates}, damping_matrix="more", max_attempts=candidates
    )
    x, y = _sinc()
    bad = x.clone()
    bad[5] = math.nan
    for batch in [x, bad, x, x, x]:
        ia, ib = a.step(batch, y), b.step(batch, y)
        assert bool(ib.accepted) == ia.accepted
        torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)
    sa, sb = a.state_dict()["state"][0], b.state_dict()["state"][0]
    torch.testing.assert_close(sb["scale"], sa["scale"], atol=0.0, rtol=1e-12)
    # The capturable optimizer's checkpoint loads (a NaN scale is refused).
    fresh = so.LevenbergMarquardt(_mlp(), damping_matrix="more", max_attempts=candidates)
    fresh.load_state_dict(b.state_dict())


def test_a_refused_first_batch_keeps_no_more_scale() -> None:
    # Nothing measured yet: the next batch's columns are the scale, as in the default step.
    a, b, a_model, b_model = _pair({"candidates": 4}, damping_matrix="more")
    x, y = _sinc()
    bad = x.clone()
    bad[0] = math.inf
    for inputs in [bad, x, x]:
        ia, ib = a.step(inputs, y), b.step(inputs, y)
        assert bool(ib.accepted) == ia.accepted
    torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)
    scale_a = a.state_dict()["state"][0]["scale"]
    torch.testing.assert_close(b.state_dict()["state"][0]["scale"], scale_a, atol=0.0, rtol=1e-12)


def test_a_batch_stopped_by_gtol_leaves_the_more_scale_alone() -> None:
    # A batch the model fits exactly (zero residuals) stops at gtol: no scale update.
    a, b, a_model, b_model = _pair({"candidates": 4}, damping_matrix="more")
    x, y = _sinc()
    far = 3.0 * x + 4.0  # other inputs: larger columns of J than the sinc batch's
    a.step(x, y), b.step(x, y)
    with torch.no_grad():
        exact = a_model(far)
    ia, ib = a.step(far, exact), b.step(far, exact)
    assert ia.status == 1 and int(ib.status) == 1
    sa, sb = a.state_dict()["state"][0], b.state_dict()["state"][0]
    torch.testing.assert_close(sb["scale"], sa["scale"], atol=0.0, rtol=1e-12)
    for _ in range(3):
        a.step(x, y), b.step(x, y)
    torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)


# -- the dual matrix's dtype ---------------------------------------------------------------


@pytest.mark.parametrize("gram_dtype", [torch.float64, "auto", torch.float32])
def test_the_dual_matrix_is_formed_in_the_steps_precision(gram_dtype: Any) -> None:
    # A float32 model in the dual form.  Without λ read on the host, "auto" forms the
    # matrix in float64 (and says so): the default step asked for float64 is the reference.
    x, y = _sinc(64)
    x, y = x[::5][:12].float(), y[::5][:12].float()
    reference = torch.float64 if gram_dtype == "auto" else gram_dtype
    a_model, b_model = _mlp(32, torch.float32), _mlp(32, torch.float32)
    a = so.LevenbergMarquardt(a_model, form="dual", damping=1e-4, gram_dtype=reference)
    b = so.LevenbergMarquardt(
        b_model, form="dual", damping=1e-4, gram_dtype=gram_dtype, capturable=True, candidates=10
    )
    for _ in range(6):
        ia, ib = a.step(x, y), b.step(x, y)
        assert ib.gram_dtype == ia.gram_dtype == str(reference).replace("torch.", "")
        assert int(ib.attempts) == ia.attempts
        torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=1e-6, rtol=0.0)
        assert float(ib.damping) == pytest.approx(ia.damping, rel=1e-6)


# -- the gain ratio reported ---------------------------------------------------------------


class _NanAt:
    """MSE residuals whose ``trial``-th evaluation at a trial point is NaN."""

    def __init__(self, trial: int) -> None:
        self.trial, self.calls, self.linearised = trial, 0, False

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        r = outputs - targets
        if torch.is_grad_enabled():  # the linearisation (and its probes)
            self.linearised = True
            return r
        if not self.linearised:  # the batch's validation
            return r
        self.calls += 1
        return r * math.nan if self.calls == self.trial else r


@pytest.mark.parametrize(("attempts", "trial"), [(1, 1), (2, 2), (3, 3), (3, 2)])
def test_the_gain_ratio_is_the_last_evaluated_attempts(attempts: int, trial: int) -> None:
    # λ far too small: every attempt of the first step is rejected, one of them at a
    # non-finite trial point; both modes report the last ρ they could evaluate.
    x, y = _sinc()
    a_model, b_model = _mlp(), _mlp()
    options: dict[str, Any] = {"damping": 1e-6, "max_attempts": attempts}
    a = so.LevenbergMarquardt(a_model, _NanAt(trial), **options)
    b = so.LevenbergMarquardt(
        b_model, _NanAt(trial), capturable=True, candidates=attempts, **options
    )
    ia, ib = a.step(x, y), b.step(x, y)
    assert not ia.accepted and not bool(ib.accepted) and ia.attempts == int(ib.attempts)
    assert math.isfinite(ia.gain_ratio)
    assert float(ib.gain_ratio) == pytest.approx(ia.gain_ratio, rel=1e-12, abs=0.0)
