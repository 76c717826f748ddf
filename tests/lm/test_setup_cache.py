"""The setup of a step keeps two answers across steps, and neither may be stale.

``residual_fn``'s probe (:class:`secondorder.lm.batch.ProbeCache`, per batch signature)
and the memory plan (per batch shape, followed while the free memory stays in the
range where the planner decides the same).  The references: the same optimizer with
both caches emptied before every step (the path without them), a fresh optimizer
(the same errors, the same plan), and :func:`~secondorder.lm.planner.plan_memory`
itself (the range over which a plan holds).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import secondorder as so
import secondorder.lm.choices.plans as plans_module
from secondorder.lm.choices import PLAN_RECHECK_STEPS
from secondorder.lm.planner import MemoryPlan, available_range, plan_memory
from tests.lm.unchanged import assert_unchanged, state_of

F64 = torch.float64


def mlp(inputs: int = 2, outputs: int = 3, hidden: int = 8, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(inputs, hidden)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(hidden))
    layers += [nn.Tanh(), nn.Linear(hidden, outputs)]
    return nn.Sequential(*layers).double()


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 4),
    )


def batch(size: int, seed: int, inputs: int = 2, outputs: int = 3) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, inputs, generator=g, dtype=F64)
    y = torch.tanh(x @ torch.randn(inputs, outputs, generator=g, dtype=F64))
    return x, y


def image_batch(size: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 1, 8, 8, generator=g), torch.randint(0, 4, (size,), generator=g)


def whole_model(model: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> Tensor:
    """A residual that needs the model itself: the batch's errors and one coupled row."""
    r = (model(x) - y).reshape(-1)
    return torch.cat([r, r.mean().reshape(1)])


def uncached(opt: so.LevenbergMarquardt) -> None:
    """Empty both caches: the next step takes the path without them."""
    opt._probes.clear()
    opt._choices.memory.kept.clear()


CASES: dict[str, tuple[Callable[[], nn.Module], Any, dict[str, Any], Callable[..., Any]]] = {
    "primal": (mlp, so.residuals.mse, {}, batch),
    "dual": (mlp, so.residuals.mse, {"form": "dual"}, batch),
    "sliced-forward": (mlp, so.residuals.mse, {"slice_size": 5, "jacobian": "forward"}, batch),
    "cnn-gram-auto": (small_cnn, so.residuals.cross_entropy, {"gram_dtype": "auto"}, image_batch),
    "cnn-dual": (small_cnn, so.residuals.cross_entropy, {"form": "dual"}, image_batch),
    "batchnorm": (lambda: mlp(batchnorm=True), so.residuals.mse, {}, batch),
    "model-residual": (mlp, so.residuals.ModelResidual(whole_model), {}, batch),
    "cnn-cross-entropy": (
        small_cnn,
        so.residuals.cross_entropy,
        {"gram_dtype": torch.float32},
        image_batch,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_with_the_caches_equal_steps_without_them_bitwise(case):
    make, residual, options, data = CASES[case]
    # Two shapes, as in an epoch whose last batch is shorter, in two rounds.
    batches = [data(16, 1), data(16, 2), data(7, 3), data(16, 4)] * 2
    model, reference = make(), make()
    opt = so.LevenbergMarquardt(model, residual, **options)
    ref = so.LevenbergMarquardt(reference, residual, **options)
    for x, y in batches:
        uncached(ref)
        a, b = opt.step(x, y), ref.step(x, y)
        assert (a.loss, a.damping, a.attempts, a.accepted, a.gain_ratio) == (
            b.loss,
            b.damping,
            b.attempts,
            b.accepted,
            b.gain_ratio,
        )
        assert (a.jacobian, a.solver, a.form, a.gram_dtype) == (
            b.jacobian,
            b.solver,
            b.form,
            b.gram_dtype,
        )
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q)
        assert opt.memory_plan is not None and ref.memory_plan is not None
        assert _decisions(opt.memory_plan) == _decisions(ref.memory_plan)
    # Two signatures: every step after the first of each was served by the caches.
    assert opt._probes.hits == len(batches) - 2
    assert ref._probes.hits == 0
    assert len(opt._choices.memory.kept) == 2


def _decisions(plan: MemoryPlan) -> MemoryPlan:
    """A plan without the free memory it records (read at a different moment)."""
    return replace(plan, available_bytes=None, available_source="")


# -- a batch of another kind meets the checks, not a stale verdict ------------------------------


def _bad_batches() -> dict[str, tuple[Callable[[Tensor, Tensor], tuple[Any, Any]], str]]:
    return {
        "float32 inputs": (
            lambda x, y: (x.float(), y),
            r"inputs dtype torch\.float32 does not match the model's parameter dtype",
        ),
        "more features": (lambda x, y: (torch.cat([x, x], 1), y), r"shapes cannot be multiplied"),
        "fewer outputs": (
            lambda x, y: (x, y[:, :2]),
            r"mse: targets of shape \(2, 2\) do not match the model outputs of shape \(2, 3\)",
        ),
        "no targets": (lambda x, y: (x, None), r"mse: targets is None; pass the targets"),
        "targets on meta": (
            lambda x, y: (x, y.to("meta")),
            r"targets are on meta but the model is on cpu",
        ),
        "numpy inputs": (lambda x, y: (x.numpy(), y), r"inputs must be torch tensors"),
        "batch sizes differ": (
            lambda x, y: (x, y[:-1]),
            r"inputs and targets batch sizes differ: inputs has 16, targets has 15",
        ),
        "inputs in a tuple": (
            lambda x, y: ((x, x), y),
            r"linear\(\): argument 'input' \(position 1\) must be Tensor, not tuple",
        ),
        "integer inputs": (
            lambda x, y: (x.long(), y),
            r"mat1 and mat2 must have the same dtype, but got Long and Double",
        ),
    }


@pytest.mark.parametrize("kind", sorted(_bad_batches()))
def test_a_batch_of_another_kind_raises_what_a_fresh_optimizer_raises(kind):
    change, match = _bad_batches()[kind]
    x, y = batch(16, 1)
    model, reference = mlp(), mlp()
    opt = so.LevenbergMarquardt(model, jacobian="reverse")
    ref = so.LevenbergMarquardt(reference, jacobian="reverse")
    for _ in range(2):
        opt.step(x, y)
        ref.step(x, y)
    assert opt._probes.hits == 1
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    bad_x, bad_y = change(x, y)
    with pytest.raises(Exception, match=match) as cached:
        opt.step(bad_x, bad_y)
    with pytest.raises(Exception, match=match) as fresh:
        so.LevenbergMarquardt(mlp(), jacobian="reverse").step(bad_x, bad_y)
    assert (type(cached.value), str(cached.value)) == (type(fresh.value), str(fresh.value))
    assert_unchanged(model, before, opt, state)
    # And the next good batch is the step of an optimizer that never saw the bad one.
    a, b = opt.step(x, y), ref.step(x, y)
    assert (a.loss, a.damping) == (b.loss, b.damping)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


# -- a residual_fn that changes its output for batches of one shape -----------------------------


class Switching:
    """``outputs - targets``, or, after :attr:`mode` is set, something else of the same batch."""

    def __init__(self) -> None:
        self.mode = "same"

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        r = outputs - targets
        if self.mode == "double":
            return torch.cat([r, r], dim=1)
        if self.mode == "float32":
            return r.float()
        return r


def _switching_model_residual(res: Switching) -> so.residuals.ModelResidual:
    return so.residuals.ModelResidual(lambda model, x, y: res(model(x), y))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"jacobian": "reverse"}, "96 residuals for 16 samples, but 48"),
        ({"jacobian": "forward", "slice_size": 5}, "30 residuals for 5 samples, but 15"),
        ({"jacobian": "batch_reverse", "form": "dual"}, "96 residuals for 16 samples, but 48"),
        ({"jacobian": "auto"}, "96 residuals for 16 samples, but 48"),
        ({"coupled": True}, "96 residuals for 16 samples, but 48"),
    ],
)
def test_a_residual_count_that_changes_between_steps_is_refused(options, message):
    options = dict(options)
    x, y = batch(16, 1)
    model, reference = mlp(), mlp()
    res, ref_res = Switching(), Switching()
    if options.pop("coupled", False):
        opt = so.LevenbergMarquardt(model, _switching_model_residual(res), **options)
        ref = so.LevenbergMarquardt(reference, _switching_model_residual(ref_res), **options)
    else:
        opt = so.LevenbergMarquardt(model, res, **options)
        ref = so.LevenbergMarquardt(reference, ref_res, **options)
    for _ in range(2):
        opt.step(x, y)
        ref.step(x, y)
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    res.mode = "double"
    with pytest.raises(ValueError, match=f"residual_fn returned {message} for an earlier batch"):
        opt.step(x, y)
    assert_unchanged(model, before, opt, state)
    res.mode = "float32"
    with pytest.raises(
        TypeError,
        match=r"residual_fn returned residuals of dtype torch\.float32 but the model's "
        r"parameters are torch\.float64",
    ):
        opt.step(x, y)
    assert_unchanged(model, before, opt, state)
    res.mode = "same"
    a, b = opt.step(x, y), ref.step(x, y)
    assert (a.loss, a.damping) == (b.loss, b.damping)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_wrong_first_dimension_is_refused_for_each_new_shape():
    """The probe still runs on the first batch of every signature."""
    x, y = batch(16, 1)
    transpose = []

    def residual(outputs: Tensor, targets: Tensor) -> Tensor:
        r = outputs - targets
        return r.T if transpose else r

    opt = so.LevenbergMarquardt(mlp(), residual)
    opt.step(x, y)
    opt.step(x, y)
    transpose.append(True)
    with pytest.raises(
        ValueError, match=r"first dimension is the batch \(2 for this probe\), got shape \(3, 2\)"
    ):
        opt.step(*batch(7, 2))
    assert opt._probes.hits == 1


# -- the model ----------------------------------------------------------------------------------


def test_a_model_changed_behind_the_optimizer_is_still_refused():
    x, y = batch(16, 1)
    model = mlp()
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    opt.step(x, y)
    original = model[0].weight
    model[0].weight = nn.Parameter(original.detach().clone())
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' was replaced"):
        opt.step(x, y)
    model[0].weight = original
    opt.step(x, y)
    assert opt._probes.hits == 2


def test_a_new_module_or_mode_is_probed_again():
    """Modules (by identity) and their training flags are part of the signature."""
    x, y = batch(16, 1)
    model = mlp()
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    opt.step(x, y)
    assert opt._probes.hits == 1
    model.eval()
    opt.step(x, y)
    assert opt._probes.hits == 1
    model.train()
    opt.step(x, y)
    assert opt._probes.hits == 2
    # A parameter-free module appended that changes the output's shape: probed again,
    # and refused as a fresh optimizer refuses it.
    model.append(nn.Flatten(0))
    match = r"targets of shape \(2, 3\) do not match the model outputs of shape \(6,\)"
    with pytest.raises(ValueError, match=match) as cached:
        opt.step(x, y)
    with pytest.raises(ValueError, match=match) as fresh:
        so.LevenbergMarquardt(copy.deepcopy(model)).step(x, y)
    assert (type(cached.value), str(cached.value)) == (type(fresh.value), str(fresh.value))
    assert opt._probes.hits == 2


def test_unhashable_leaves_are_probed_every_time():
    """A non-tensor leaf that cannot be a key (here a list-valued dict entry) gives none."""

    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

        def forward(self, batch: dict[str, Any]) -> Tensor:
            out: Tensor = self.body(batch["x"]) * batch["scale"]
            return out

    x, y = batch(16, 1)
    opt = so.LevenbergMarquardt(Keyed(), jacobian="batch_reverse")
    scale = np.float64(2.0)  # an __array__ leaf: refused every time
    for _ in range(2):
        with pytest.raises(TypeError, match="inputs must be torch tensors"):
            opt.step({"x": x, "scale": scale}, y)
    opt.step({"x": x, "scale": 2.0}, y)
    opt.step({"x": x, "scale": 2.0}, y)
    assert opt._probes.hits == 1
    opt.step({"x": x, "scale": 3.0}, y)  # another value of the flag: another key
    assert opt._probes.hits == 1


# -- the memory plan ----------------------------------------------------------------------------


def test_the_plan_follows_the_batch_shape_and_equals_a_fresh_plan():
    model = mlp()
    limit = 100_000  # slices a batch of 64 (to 30 samples), not one of 9 or 33
    opt = so.LevenbergMarquardt(model, memory_limit=limit, form="primal")
    slices = {}
    for size in (64, 9, 64, 9, 33):
        x, y = batch(size, size)
        opt.step(x, y)
        fresh = so.LevenbergMarquardt(mlp(), memory_limit=limit, form="primal").plan(x, y)
        assert opt.memory_plan == fresh
        assert opt.memory_plan is not None and opt.memory_plan.samples == size
        slices[size] = opt.memory_plan.slice_size
    assert slices == {64: 30, 9: 9, 33: 33}
    assert len(opt._choices.memory.kept) == 3
    # plan() on a kept shape returns the kept plan.
    x, y = batch(64, 0)
    other = so.LevenbergMarquardt(mlp(), memory_limit=limit, form="primal")
    assert opt.plan(x, y) == other.plan(x, y)


PLAN_ARGS: dict[str, Any] = {
    "samples": 4096,
    "rows": 4096 * 20,
    "dtype": torch.float32,
    "gram_dtype": torch.float64,
    "jacobian": "reverse",
    "memory_budget": 1 << 30,
}


@pytest.mark.parametrize(
    ("parameters", "samples", "available", "solver", "slice_size"),
    [
        (500, 4096, 12_000_000, "cholesky", 83),
        (500, 4096, 30_000_000, "cholesky", 233),
        (500, 4096, 10**12, "cholesky", 4096),
        (5000, 256, 500_000_000, "cg", 256),  # the Gram does not fit: CG
    ],
)
def test_available_range_is_exactly_where_the_plan_stays_the_same(
    parameters, samples, available, solver, slice_size
):
    args = {**PLAN_ARGS, "parameters": parameters, "samples": samples, "rows": samples * 20}
    peaks: list[int] = []
    plan = plan_memory(**args, available=available, peaks=peaks)
    assert plan.fits and (plan.solver, plan.slice_size) == (solver, slice_size)
    low, high = available_range(peaks, available)
    assert 0 < low <= available and (high is None or available < high)

    def same(a: int) -> bool:
        other = plan_memory(**args, available=a)
        return replace(other, available_bytes=available) == plan

    assert same(low) and same(available) and not same(low - 1)
    if high is not None:
        assert same(high - 1) and not same(high)


class FakeMemory:
    """``available_memory`` with a settable answer that counts its calls."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.reads = 0

    def __call__(self, device: torch.device) -> tuple[int | None, str]:
        self.reads += 1
        return self.free, "the test's free memory"


def test_free_memory_is_read_again_on_schedule_and_a_drop_replans(monkeypatch):
    fake = FakeMemory(10**12)
    monkeypatch.setattr(plans_module, "available_memory", fake)
    x, y = batch(64, 1)
    opt = so.LevenbergMarquardt(mlp(), form="primal", jacobian="forward")
    opt.step(x, y)
    assert fake.reads == 1
    kept = next(iter(opt._choices.memory.kept.values()))
    assert kept.high is None and kept.low <= kept.plan.available_bytes // 2
    for _ in range(PLAN_RECHECK_STEPS - 1):
        opt.step(x, y)
    assert fake.reads == 1  # a wide margin: followed without reading
    opt.step(x, y)
    assert fake.reads == 2  # the PLAN_RECHECK_STEPS-th use reads again
    # Free memory drops below the kept plan's need: noticed at the next reading.
    fresh = so.LevenbergMarquardt(mlp(), form="primal", jacobian="forward")
    fake.free = kept.low  # 90% usable: the whole batch no longer fits
    for _ in range(PLAN_RECHECK_STEPS - 1):
        opt.step(x, y)
    assert opt.memory_plan is not None and opt.memory_plan.slice_size == 64
    opt.step(x, y)
    plan = opt.memory_plan
    assert plan is not None and plan.slice_size < 64
    assert plan == fresh.plan(x, y)
    # Now the plan needs more than half of the free memory: read on every use.
    kept = next(iter(opt._choices.memory.kept.values()))
    assert kept.plan.available_bytes is not None
    assert kept.low > kept.plan.available_bytes // 2
    reads = fake.reads
    for _ in range(3):
        opt.step(x, y)
    assert fake.reads == reads + 3
    # More free memory than the range's top: the next reading plans the whole batch.
    fake.free = 10**12
    opt.step(x, y)
    assert opt.memory_plan is not None and opt.memory_plan.slice_size == 64


def test_a_failed_step_leaves_the_memory_plan_as_it_was():
    x, y = batch(16, 1)
    res = Switching()
    opt = so.LevenbergMarquardt(mlp(), res)
    opt.step(x, y)
    plan = opt.memory_plan
    res.mode = "double"
    with pytest.raises(ValueError, match="residual_fn returned 96 residuals"):
        opt.step(x, y)
    assert opt.memory_plan is plan
    res.mode = "same"
    opt.step(x, y)
    assert opt.memory_plan == plan


# -- several ranks ------------------------------------------------------------------------------


def rank_cached_steps(rank: int, world: int) -> dict[str, Any]:
    """Cached steps, a count change on rank 1 only, and shards of different shapes."""
    x, y = batch(32, 1)
    share = 16
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    model, res = mlp(), Switching()
    opt = so.LevenbergMarquardt(model, res)
    for _ in range(3):
        opt.step(xs, ys)
    out: dict[str, Any] = {"hits": opt._probes.hits}
    before, state = [p.detach().clone() for p in model.parameters()], state_of(opt)
    if rank == 1:
        res.mode = "double"
    try:
        opt.step(xs, ys)
        out["raised"] = ""
    except (ValueError, RuntimeError) as exc:
        out["raised"] = str(exc)
    assert_unchanged(model, before, opt, state)
    res.mode = "same"
    # Rank 1 drops its last sample: a new signature (a probe) there, a cached one on rank 0.
    last = xs.shape[0] - rank
    opt.step(xs[:last], ys[:last])
    out["hits_after"] = opt._probes.hits
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.distributed
def test_ranks_with_cached_probes_raise_together_and_equal_one_process():
    from secondorder.testing import run_ranks

    results = {r: v.unwrap() for r, v in run_ranks(rank_cached_steps, 2).items()}
    assert results[0]["hits"] == results[1]["hits"] == 2
    assert "residual_fn returned 96 residuals for 16 samples, but 48" in results[1]["raised"]
    assert "1 of 2 ranks raised while linearising" in results[0]["raised"]
    assert (results[0]["hits_after"], results[1]["hits_after"]) == (4, 3)
    # One process on the concatenated batch, up to the order of the sums.
    x, y = batch(32, 1)
    model = mlp()
    opt = so.LevenbergMarquardt(model)
    for _ in range(3):
        opt.step(x, y)
    opt.step(torch.cat([x[:16], x[16:31]]), torch.cat([y[:16], y[16:31]]))
    for r in (0, 1):
        for p, q in zip(results[r]["params"], model.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-12)
    for p, q in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(p, q)
