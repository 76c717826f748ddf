"""The capturable step (``capturable=True``): no host read, and the default step's answers.

References: the default step (float64, CPU), which the capturable step must reproduce
where their rules coincide; a counter of host reads
(:mod:`secondorder.testing.syncs`); one process on the concatenated batch for the
distributed run (real gloo ranks).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.testing import run_ranks
from secondorder.testing.syncs import SyncCounter

F64 = torch.float64
#: Parameters of the two modes after the same steps, float64 on the CPU.
ATOL = 1e-12


def _mlp(sizes: list[int], seed: int = 0, dtype: torch.dtype = F64) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(dtype)


def _sinc(points: int, dtype: torch.dtype = F64) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1.0, 1.0, points, dtype=F64).unsqueeze(1)
    return x.to(dtype), torch.sinc(3.0 * x).to(dtype)


def _classes() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(24, 6, generator=gen, dtype=F64), torch.randint(0, 4, (24,), generator=gen)


# name -> (model sizes, data, residual function, options)
CASES: dict[str, tuple[list[int], tuple[Tensor, Tensor], Any, dict[str, Any]]] = {
    "sinc-nielsen": ([1, 8, 1], _sinc(64), so.residuals.mse, {}),
    "sinc-multiplicative": (
        [1, 8, 1],
        _sinc(64),
        so.residuals.mse,
        {"damping_rule": "multiplicative"},
    ),
    "sinc-identity": ([1, 8, 1], _sinc(64), so.residuals.mse, {"damping_matrix": "identity"}),
    "sinc-more": ([1, 8, 1], _sinc(64), so.residuals.mse, {"damping_matrix": "more"}),
    "sinc-lr": ([1, 8, 1], _sinc(64), so.residuals.mse, {"lr": 0.5}),
    "sinc-dual": ([1, 8, 1], _sinc(12), so.residuals.mse, {"form": "dual"}),
    "classes-cross-entropy": ([6, 8, 4], _classes(), so.residuals.cross_entropy, {}),
}


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _pair(case: str, **capturable: Any) -> tuple[Any, Any, nn.Module, nn.Module]:
    sizes, _, residual, options = CASES[case]
    a_model, b_model = _mlp(sizes), _mlp(sizes)
    a = so.LevenbergMarquardt(a_model, residual, **options)
    b = so.LevenbergMarquardt(b_model, residual, capturable=True, **capturable, **options)
    return a, b, a_model, b_model


@pytest.mark.parametrize("case", list(CASES))
def test_batched_attempts_take_the_default_steps(case: str) -> None:
    # candidates = max_attempts: each call tries what the default step would try.
    a, b, a_model, b_model = _pair(case, candidates=10)
    x, y = CASES[case][1]
    for _ in range(20):
        ia, ib = a.step(x, y), b.step(x, y)
        assert bool(ib.accepted) == ia.accepted and int(ib.attempts) == ia.attempts
        assert int(ib.status) == ia.status
        torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)
        assert float(ib.damping) == pytest.approx(ia.damping, rel=1e-12)
        assert float(ib.loss) == pytest.approx(ia.loss, rel=1e-12)


@pytest.mark.parametrize("case", ["sinc-nielsen", "sinc-multiplicative", "sinc-more", "sinc-dual"])
def test_one_attempt_per_step_follows_the_default_attempts(case: str) -> None:
    # One attempt per call: the default step's k-th attempt is the k-th call.
    a, b, a_model, b_model = _pair(case)
    x, y = CASES[case][1]
    attempts = sum(a.step(x, y).attempts for _ in range(20))
    accepted = 0
    for _ in range(attempts):
        accepted += bool(b.step(x, y).accepted)
    assert accepted == 20
    torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)
    assert b.damping == pytest.approx(a.damping, rel=1e-12)


def _count(fn: Callable[[], Any], counter: SyncCounter) -> tuple[Any, list[str]]:
    counter.sites = []
    with counter:
        out = fn()
    return out, counter.sites


@pytest.mark.parametrize("form", ["primal", "dual"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("candidates", [1, 3])
def test_a_steady_state_step_reads_nothing_on_the_host(
    form: str, dtype: torch.dtype, candidates: int
) -> None:
    model = _mlp([1, 16, 1], dtype=dtype)
    x, y = _sinc(256 if form == "primal" else 24, dtype)
    opt = so.LevenbergMarquardt(
        model, form=form, capturable=True, candidates=candidates, check_every=4, damping=1.0
    )
    counter = SyncCounter()
    for _ in range(2):  # the first step of a signature checks and caches its choices
        opt.step(x, y)
    accepted = 0
    for step in range(3, 11):
        info, sites = _count(lambda: opt.step(x, y), counter)
        # Only every check_every-th step reads, once: whether a step decided to stop.
        assert len(sites) == (1 if step % 4 == 0 else 0), sites
        assert isinstance(info.loss, Tensor) and info.form == form
        accepted += bool(info.accepted)
    assert accepted > 0


def test_never_checking_reads_nothing() -> None:
    model = _mlp([1, 16, 1])
    x, y = _sinc(128)
    opt = so.LevenbergMarquardt(model, capturable=True, check_every=0)
    opt.step(x, y)
    counter = SyncCounter()
    for _ in range(12):
        info, sites = _count(lambda: opt.step(x, y), counter)
        assert sites == [] and info.terminated is False


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"solver": "cg"}, r"Invalid solver='cg' with capturable=True: CG's iteration count"),
        ({"solver": "eigh"}, r"Invalid solver='eigh' with capturable=True: torch.linalg.eigh"),
        ({"solver": "qr"}, r"Invalid solver='qr' with capturable=True"),
        ({"geodesic": True}, r"Invalid geodesic=True with capturable=True"),
        (
            {"linalg_backend": "numpy", "solver": "cholesky"},
            r"Invalid linalg_backend='numpy' with capturable=True",
        ),
        (
            {"linalg_backend": "bogus"},
            r"Unknown linalg_backend='bogus'; valid choices are \('torch', 'numpy'",
        ),
        (
            {"cg_preconditioner": "kfac"},
            r"Invalid cg_preconditioner='kfac' with capturable=True: .* factors by Cholesky; "
            r"leave cg_preconditioner at 'jacobi'",
        ),
        (
            {"cg_preconditioner": "kfac", "solver": "cholesky"},
            r"Invalid cg_preconditioner='kfac' with capturable=True",
        ),
        ({"check_every": -1}, r"Invalid check_every=-1: must be an integer >= 0"),
        ({"candidates": 0}, r"Invalid candidates=0: must be an integer >= 1"),
        ({"capturable": 1}, r"Invalid capturable=1: must be True or False"),
    ],
)
def test_settings_that_cannot_be_captured_are_refused(options: dict[str, Any], match: str) -> None:
    options = {"capturable": True, **options}
    with pytest.raises((ValueError, TypeError), match=match):
        so.LevenbergMarquardt(_mlp([1, 4, 1]), **options)


def test_candidates_need_the_capturable_step() -> None:
    with pytest.raises(ValueError, match=r"Invalid candidates=3 with capturable=False"):
        so.LevenbergMarquardt(_mlp([1, 4, 1]), candidates=3)


def test_the_step_on_the_cpu_runs_eagerly_and_says_why() -> None:
    model = _mlp([1, 8, 1])
    x, y = _sinc(64)
    info = so.LevenbergMarquardt(model, capturable=True).step(x, y)
    assert info.graph == "eager: not a CUDA device (cpu)"
    assert info.loss.dtype == F64 and info.loss.ndim == 0  # type: ignore[union-attr]


def test_terminated_is_read_on_check_steps() -> None:
    # A linear model on exact data: Gauss-Newton converges and ftol/xtol fire.
    torch.manual_seed(0)
    model = nn.Linear(2, 1).double()
    x = torch.randn(20, 2, dtype=F64)
    y = x @ torch.tensor([[1.5], [-0.5]], dtype=F64) + 0.25
    default = so.LevenbergMarquardt(copy.deepcopy(model), damping=1e-9)
    first = next(k for k in range(1, 30) if default.step(x, y).terminated)
    opt = so.LevenbergMarquardt(model, damping=1e-9, capturable=True, check_every=3)
    seen = []
    for k in range(1, 30):
        info = opt.step(x, y)
        if info.terminated:
            seen.append(k)
            break
        if k % 3:
            assert info.reason.startswith("decided on the device")
    # Read on the first check step at or after the step that decided to stop.
    assert seen == [-(-first // 3) * 3]
    assert info.reason.startswith(("ftol", "xtol", "gtol"))


@pytest.mark.parametrize("source", ["default", "capturable"])
def test_checkpoints_move_between_the_modes(source: str) -> None:
    x, y = CASES["sinc-more"][1]
    options = {"damping_matrix": "more"}
    modes = {"default": {}, "capturable": {"capturable": True, "candidates": 10}}
    target = "capturable" if source == "default" else "default"
    model = _mlp([1, 8, 1])
    opt = so.LevenbergMarquardt(model, **modes[source], **options)
    for _ in range(4):
        opt.step(x, y)
    twin = copy.deepcopy(model)
    resumed = so.LevenbergMarquardt(twin, **modes[target], **options)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.damping == opt.damping
    for _ in range(4):
        a, b = opt.step(x, y), resumed.step(x, y)
        assert bool(a.accepted) == bool(b.accepted)
        torch.testing.assert_close(_flat(twin), _flat(model), atol=ATOL, rtol=0.0)


# -- reliability, in both modes ------------------------------------------------------------

MODES = {"default": {}, "capturable": {"capturable": True, "candidates": 10}}


class _Faulty:
    """MSE residuals whose ``trial``-th trial evaluation of a step holds NaN or raises."""

    def __init__(self) -> None:
        self.arm(0, "")

    def arm(self, trial: int, kind: str) -> None:
        self.trial, self.kind, self.calls, self.linearised = trial, kind, 0, False

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        r = outputs - targets
        if torch.is_grad_enabled():
            self.linearised = True
            return r
        if not self.linearised:
            return r
        self.calls += 1
        if self.calls == self.trial and self.kind == "nan":
            return r * math.nan
        if self.calls == self.trial and self.kind == "raise":
            raise RuntimeError("fault in a trial evaluation")
        return r


@pytest.mark.parametrize("mode", list(MODES))
def test_a_failed_step_changes_nothing(mode: str) -> None:
    x, y = _sinc(64)
    model, res = _mlp([1, 8, 1]), _Faulty()
    opt = so.LevenbergMarquardt(model, res, **MODES[mode])
    for _ in range(3):
        opt.step(x, y)
    before, state, damping = _flat(model).clone(), copy.deepcopy(opt.state_dict()), opt.damping
    res.arm(1, "raise")
    with pytest.raises(RuntimeError, match="fault in a trial evaluation"):
        opt.step(x, y)
    assert torch.equal(_flat(model), before) and opt.damping == damping
    assert opt.state_dict()["state"] == state["state"]
    # The next step is the step of a fresh optimizer loaded from that state.
    res.arm(0, "")
    twin = _mlp([1, 8, 1])
    with torch.no_grad():
        for p, q in zip(twin.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    fresh = so.LevenbergMarquardt(twin, _Faulty(), **MODES[mode])
    fresh.load_state_dict(state)
    a, b = opt.step(x, y), fresh.step(x, y)
    assert torch.equal(_flat(model), _flat(twin)) and opt.damping == fresh.damping
    assert bool(a.accepted) == bool(b.accepted)


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_at_a_trial_point_is_a_rejection(mode: str) -> None:
    x, y = _sinc(64)
    model, res = _mlp([1, 8, 1]), _Faulty()
    opt = so.LevenbergMarquardt(model, res, **MODES[mode])
    for _ in range(3):
        opt.step(x, y)
    state, twin = copy.deepcopy(opt.state_dict()), copy.deepcopy(model)
    res.arm(1, "nan")
    a = opt.step(x, y)
    # The NaN cost one attempt (λ doubled by Nielsen's rule) and nothing else: the
    # step is the one taken from 2λ.
    state["state"][0]["damping"] *= 2
    fresh = so.LevenbergMarquardt(twin, **MODES[mode])
    fresh.load_state_dict(state)
    b = fresh.step(x, y)
    assert bool(a.accepted) and int(a.attempts) == int(b.attempts) + 1
    assert float(a.damping) == float(b.damping) and float(a.loss) == float(b.loss)
    assert torch.equal(_flat(model), _flat(twin))


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_in_the_data_is_refused_and_damping_raised(mode: str) -> None:
    x, y = _sinc(64)
    bad = y.clone()
    bad[5] = math.nan
    model = _mlp([1, 8, 1])
    opt = so.LevenbergMarquardt(model, **MODES[mode])
    before, lam0 = _flat(model).clone(), opt.damping
    info = opt.step(x, bad)
    assert not bool(info.accepted) and int(info.attempts) == 1
    assert opt.damping == 2 * lam0
    assert torch.equal(_flat(model), before)
    assert bool(opt.step(x, y).accepted)


def test_batchnorm_statistics_move_only_with_an_accepted_step() -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(1, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)
        ).double()

    x, y = _sinc(48)
    a_model, b_model = model(), model()
    a = so.LevenbergMarquardt(a_model)
    b = so.LevenbergMarquardt(b_model, capturable=True, candidates=10)
    for _ in range(6):
        ia, ib = a.step(x, y), b.step(x, y)
        assert bool(ib.accepted) == ia.accepted
        for s, t in zip(a_model.buffers(), b_model.buffers(), strict=True):
            torch.testing.assert_close(t, s, atol=ATOL, rtol=0.0)
        torch.testing.assert_close(_flat(b_model), _flat(a_model), atol=ATOL, rtol=0.0)


# -- several processes ---------------------------------------------------------------------

_N = 61


def _shard(rank: int, world: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(_N, 1, generator=g, dtype=F64) * 2 - 1
    y = torch.sin(2 * x)
    return torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]


def _train_capturable(rank: int, world: int) -> list[Tensor]:
    model = _mlp([1, 5, 1], seed=rank)
    opt = so.LevenbergMarquardt(model, capturable=True, candidates=10, form="primal")
    x, y = _shard(rank, world)
    out = []
    for _ in range(6):
        info = opt.step(x, y)
        assert info.graph.startswith("eager: ")
        out.append(_flat(model).clone())
    return out


@pytest.mark.distributed
def test_several_processes_equal_one_process_in_the_capturable_step() -> None:
    results = run_ranks(_train_capturable, 2, timeout_s=30.0, deadline_s=90.0)
    ranks = [results[r].unwrap() for r in range(2)]
    x, y = _shard(0, 1)
    model = _mlp([1, 5, 1], seed=0)
    opt = so.LevenbergMarquardt(model, capturable=True, candidates=10, form="primal")
    for k in range(6):
        opt.step(x, y)
        # Ranks agree bit for bit; one process agrees to the rounding of the sums.
        assert torch.equal(ranks[0][k], ranks[1][k])
        torch.testing.assert_close(ranks[0][k], _flat(model), rtol=1e-9, atol=1e-12)
