"""Host synchronisations per LM step, counted on CPU.

Every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``, ``nonzero``, boolean-mask indexing, ...) stalls a GPU until its queue
drains.  A :class:`~torch.overrides.TorchFunctionMode` sees each such call, on CPU
too, so the count is tested here without a GPU.  The algorithm needs, per step, one
read of the loss and gtol measure (shared with the finiteness check) and, per
attempt, one before the trial evaluation (did the solve succeed?) and one after it
(accept or reject?).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.testing.syncs import SyncCounter


def _sinc(points: int = 256) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.linspace(-1, 1, points).unsqueeze(1)
    return model, x, torch.sinc(10 * x)


#: One counter for every count: a new mode object per step would change the model
#: state a kept forward pass depends on (ForwardCarry), and the carried steps must be
#: counted too.
_COUNTER = SyncCounter()


def _count(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    _COUNTER.sites = []
    with _COUNTER:
        out = fn()
    return out, _COUNTER.sites


def test_counter_sees_each_kind_of_sync() -> None:
    t = torch.tensor([0.5, 2.0])
    actions: list[Callable[[], object]] = [
        lambda: float(t[0]),
        lambda: int(t[1]),
        lambda: bool(t[0] > 0),
        lambda: t.sum().item(),
        lambda: t.tolist(),
        lambda: torch.nonzero(t),
        lambda: t[t > 1],
        lambda: f"{t[0]:.3f}",
    ]
    for action in actions:
        _, sites = _count(action)
        assert len(sites) == 1, sites
    # ... and tensor work that stays on the device is not counted.
    _, sites = _count(lambda: torch.where(t > 1, t, 0.0).sum() * 2)
    assert sites == []


@pytest.mark.parametrize("form", ["primal", "dual"])
@pytest.mark.parametrize("gram_dtype", [torch.float64, torch.float32, "auto"])
def test_lm_step_syncs_only_for_its_decisions(gram_dtype: torch.dtype | str, form: str) -> None:
    # Under "auto" the dual form reads its precision measure with the loss: no extra read.
    model, x, y = _sinc(256 if form == "primal" else 24)
    opt = so.LevenbergMarquardt(model, gram_dtype=gram_dtype, form=form, damping=1.0)
    opt.step(x, y)  # the first step on a new input signature checks and caches choices
    dtypes = set()
    for _ in range(3):
        info, sites = _count(lambda: opt.step(x, y))
        assert info.accepted, info.reason
        assert info.form == form
        assert len(sites) == 1 + 2 * info.attempts, sites
        dtypes.add(info.gram_dtype)
    if gram_dtype == "auto":
        assert "float32" in dtypes, dtypes


def test_classifier_dual_step_syncs_only_for_its_decisions() -> None:
    # The classifier defaults (D = I, dual form): J Jᵀ comes from the layers'
    # factors, and D = I is known from the damping matrix, not read from the device.
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy, form="dual")
    batches = [(torch.randn(64, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen))]
    batches += [
        (torch.randn(64, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen))
        for _ in range(3)
    ]
    opt.step(*batches[0])
    for x, y in batches[1:]:
        info, sites = _count(lambda x=x, y=y: opt.step(x, y))
        assert info.form == "dual"
        assert len(sites) == 1 + 2 * info.attempts, sites


def test_rejected_attempts_each_cost_two_syncs() -> None:
    model, x, y = _sinc()
    opt = so.LevenbergMarquardt(model, damping=1e-9, damping_rule="multiplicative")
    opt.step(x, y)
    attempts = []
    for _ in range(6):
        info, sites = _count(lambda: opt.step(x, y))
        assert len(sites) == 1 + 2 * info.attempts, sites
        attempts.append(info.attempts)
    # Steps from a tiny λ overshoot: some steps needed more than one attempt.
    assert max(attempts) > 1, attempts


def test_a_deliberate_sync_in_the_step_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y = _sinc()
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    info, base = _count(lambda: opt.step(x, y))
    assert len(base) == 1 + 2 * info.attempts
    # Each step builds its own problem: patch the class the next step's problem is built from.
    problem = opt.internals().problem
    assert problem is not None
    loss_sum = type(problem).loss_sum

    def eager_loss_sum(self: Any, z: Tensor) -> Tensor:
        total = loss_sum(self, z)
        if not float(total) >= 0.0:  # a needless host read in every trial evaluation
            raise AssertionError("negative sum of squares")
        return total

    monkeypatch.setattr(type(problem), "loss_sum", eager_loss_sum)
    info, sites = _count(lambda: opt.step(x, y))
    assert len(sites) == 1 + 3 * info.attempts, sites
