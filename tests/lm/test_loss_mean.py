"""Cross-entropy's reported loss is torch's mean: divided by the weight of the targets.

The reference is :func:`torch.nn.functional.cross_entropy` with ``reduction="mean"``
on the same batch, which divides by ``Σ w[yᵢ]`` over the targets that are not
``ignore_index``; a sliced batch, and ranks each holding a shard of it, report the
number one process reports on the concatenated batch.  Only the report changes: the
parameters are those of the same residuals with a plain mean, bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.loss_mean import LossMean
from secondorder.testing.syncs import SyncCounter
from secondorder.training import fit

F64 = torch.float64
WEIGHT = torch.tensor([0.2, 1.0, 3.0, 0.5], dtype=F64)
#: Σr² holds ``eps = 1e-12`` per residual that torch's loss does not: a few 1e-12.
EPS_SLACK = 1e-10
#: The defaults a cross-entropy adapter brings, named for a lambda that would not get them.
CLASSIFIER = {"damping_rule": "multiplicative", "damping_matrix": "identity"}


def batch(
    n: int = 48, seed: int = 0, ignored: int = 5, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """Four classes; the first ``ignored`` targets are ``ignore_index``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=F64)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0.5).long()
    y[:ignored] = ignore_index
    return x, y


def classifier(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def torch_loss(model: nn.Module, x: Tensor, y: Tensor, **options: Any) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y, **options))


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


RESIDUALS = {
    "weight": (lambda: nn.CrossEntropyLoss(weight=WEIGHT), {"weight": WEIGHT}),
    "weight-sum": (lambda: nn.CrossEntropyLoss(weight=WEIGHT, reduction="sum"), {"weight": WEIGHT}),
    "ignored": (lambda: nn.CrossEntropyLoss(), {}),
    "smoothing": (
        lambda: nn.CrossEntropyLoss(weight=WEIGHT, label_smoothing=0.1),
        {"weight": WEIGHT, "label_smoothing": 0.1},
    ),
    "partial": (
        lambda: functools.partial(so.residuals.cross_entropy, weight=WEIGHT, ignore_index=3),
        {"weight": WEIGHT, "ignore_index": 3},
    ),
}


@pytest.mark.parametrize("capturable", [False, True], ids=["default", "capturable"])
@pytest.mark.parametrize("case", list(RESIDUALS))
def test_reported_loss_is_torchs_cross_entropy(case: str, capturable: bool) -> None:
    make, options = RESIDUALS[case]
    model = classifier()
    x, y = batch(ignore_index=options.get("ignore_index", -100))
    opt = so.LevenbergMarquardt(model, make(), capturable=capturable)
    accepted = []
    for _ in range(4):
        before = torch_loss(model, x, y, **options)
        info = opt.step(x, y)
        after = torch_loss(model, x, y, **options)
        assert float(info.loss_before) == pytest.approx(before, rel=1e-12, abs=EPS_SLACK)
        assert float(info.loss) == pytest.approx(after, rel=1e-12, abs=EPS_SLACK)
        accepted.append(bool(info.accepted))
    assert any(accepted)


def test_the_old_report_was_the_mean_over_samples() -> None:
    """The defect this fixes: Σ w·CE / N is not torch's number on this batch."""
    model = classifier()
    x, y = batch()
    info = so.LevenbergMarquardt(model, nn.CrossEntropyLoss(weight=WEIGHT)).step(x, y)
    with torch.no_grad():
        per_sample = F.cross_entropy(model(x), y, weight=WEIGHT, reduction="none")
    assert abs(float(info.loss) - float(per_sample.mean())) > 0.02 * float(info.loss)
    assert float(info.loss) == pytest.approx(torch_loss(model, x, y, weight=WEIGHT), rel=1e-9)


@pytest.mark.parametrize("capturable", [False, True], ids=["default", "capturable"])
def test_only_the_report_changes_the_steps_are_bitwise_the_same(capturable: bool) -> None:
    """Against the same residuals in a lambda (reported as a plain mean over samples).

    The lambda does not get the classifier defaults (:mod:`~secondorder.lm.classifier_defaults`):
    both runs name them.
    """
    x, y = batch()
    runs = []
    for residual in (
        nn.CrossEntropyLoss(weight=WEIGHT),
        lambda out, t: so.residuals.cross_entropy(out, t, weight=WEIGHT),
    ):
        model = classifier()
        opt = so.LevenbergMarquardt(model, residual, capturable=capturable, **CLASSIFIER)
        infos = [opt.step(x, y) for _ in range(3)]
        runs.append((flat(model), infos))
    (weighted, infos), (plain, plain_infos) = runs
    assert torch.equal(weighted, plain)
    kept = y != -100
    ratio = len(y) / float(WEIGHT[y[kept]].sum())
    for a, b in zip(infos, plain_infos, strict=True):
        assert float(a.loss) == pytest.approx(float(b.loss) * ratio, rel=1e-12)


@pytest.mark.parametrize("capturable", [False, True], ids=["default", "capturable"])
def test_unweighted_cross_entropy_reports_and_steps_bitwise_as_before(capturable: bool) -> None:
    """No weights, nothing ignored: the denominator is the count, and nothing moves."""
    x, y = batch(ignored=0)
    runs = []
    for residual in (so.residuals.cross_entropy, lambda out, t: so.residuals.cross_entropy(out, t)):
        model = classifier()
        opt = so.LevenbergMarquardt(model, residual, capturable=capturable, **CLASSIFIER)
        infos = [opt.step(x, y) for _ in range(3)]
        runs.append((flat(model), [(float(i.loss), float(i.loss_before)) for i in infos]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


def test_probability_targets_keep_the_mean_over_samples_as_torch_does() -> None:
    model = classifier()
    x, _ = batch(ignored=0)
    soft = torch.softmax(torch.randn(len(x), 4, generator=torch.Generator().manual_seed(5)), 1)
    soft = soft.to(F64)
    info = so.LevenbergMarquardt(model, nn.CrossEntropyLoss(weight=WEIGHT)).step(x, soft)
    ref = torch_loss(model, x, soft, weight=WEIGHT)
    assert float(info.loss) == pytest.approx(ref, rel=1e-12, abs=EPS_SLACK)


def test_a_sliced_batch_reports_the_whole_batchs_mean() -> None:
    x, y = batch(n=60)
    reports = []
    for slice_size in (None, 7):
        model = classifier()
        opt = so.LevenbergMarquardt(model, nn.CrossEntropyLoss(weight=WEIGHT), form="primal")
        info = opt.step(x, y, slice_size=slice_size)
        reports.append((float(info.loss_before), float(info.loss), flat(model)))
    whole, sliced = reports
    assert sliced[0] == pytest.approx(whole[0], rel=1e-12)
    assert sliced[1] == pytest.approx(whole[1], rel=1e-9)
    ref_model = classifier()
    assert sliced[0] == pytest.approx(torch_loss(ref_model, x, y, weight=WEIGHT), rel=1e-12)


def test_every_target_ignored_reports_nan_as_torch_does() -> None:
    model = classifier()
    x, y = batch(n=6, ignored=6)
    assert math.isnan(torch_loss(model, x, y))
    info = so.LevenbergMarquardt(model, so.residuals.cross_entropy).step(x, y)
    assert math.isnan(info.loss) and math.isnan(info.loss_before)


@pytest.mark.parametrize(
    "residual",
    [
        nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=2),
        functools.partial(so.residuals.cross_entropy, weight=WEIGHT),
        so.residuals.from_torch_loss(nn.CrossEntropyLoss(ignore_index=1)),
        functools.partial(functools.partial(so.residuals.cross_entropy, ignore_index=0), eps=1e-9),
    ],
    ids=["module", "partial", "loss-residual", "nested-partial"],
)
def test_the_denominator_is_torchs_sum_over_its_mean(residual: Any) -> None:
    """``Σ``-reduced loss over the ``mean``-reduced one: what torch divides by."""
    model = classifier()
    mean = LossMean.of(residual if not isinstance(residual, nn.Module) else residual_of(residual))
    assert mean is not None
    x, y = batch(n=30, ignored=4, ignore_index=mean.ignore_index)
    y = torch.stack([y, y.flip(0)], dim=1)  # (N, 2): a spatial dimension as well
    logits = model(x).detach().unsqueeze(2).expand(-1, -1, 2)
    options = {"weight": mean.weight, "ignore_index": mean.ignore_index}
    expected = F.cross_entropy(logits, y, reduction="sum", **options) / F.cross_entropy(
        logits, y, **options
    )
    total = mean.total(y, y.numel(), torch.device("cpu"))
    assert total.dtype == F64 and total.ndim == 0
    assert float(total) == pytest.approx(float(expected), rel=1e-12)


def residual_of(loss: nn.Module) -> Any:
    return so.residuals.from_torch_loss(loss)


def test_other_residuals_keep_the_mean_over_their_residuals() -> None:
    for residual in (so.residuals.mse, so.residuals.binary_cross_entropy, lambda o, t: o - t):
        assert LossMean.of(residual) is None
    assert LossMean.of(nn.BCEWithLogitsLoss(weight=torch.ones(3))) is None


def test_a_weighted_step_reads_the_device_no_more_often() -> None:
    """The weight sum rides with the loss in the step's one read (float32: device path)."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    loss = nn.CrossEntropyLoss(weight=torch.rand(10, generator=gen) + 0.5)
    opt = so.LevenbergMarquardt(model, loss, form="dual")
    counter = SyncCounter()
    for step in range(4):
        x = torch.randn(64, 32, generator=gen)
        y = torch.randint(0, 10, (64,), generator=gen)
        counter.sites = []
        with counter:
            info = opt.step(x, y)
        if step:
            assert len(counter.sites) == 1 + 2 * info.attempts, counter.sites
        with torch.no_grad():
            assert info.loss == pytest.approx(float(loss(model(x), y)), rel=1e-5)


def test_fits_validation_loss_is_torchs_on_the_whole_validation_set() -> None:
    model = classifier()
    x, y = batch(n=40)
    xv, yv = batch(n=37, seed=4, ignored=3)
    opt = so.LevenbergMarquardt(model, nn.CrossEntropyLoss(weight=WEIGHT))
    # Batches of unequal weight: a mean of batch means would not be torch's number.
    loader = [(xv[:10], yv[:10]), (xv[10:], yv[10:])]
    history = fit(opt, (x, y), epochs=2, validation=loader, progress=False)
    ref = torch_loss(model, xv, yv, weight=WEIGHT)
    assert history.validation[-1] == pytest.approx(ref, rel=1e-12, abs=EPS_SLACK)
    assert history.steps[-1].loss == pytest.approx(float(opt.step(x, y).loss_before), rel=1e-12)


# -- ranks against one process on the concatenated batch --------------------------------------

#: Shards of unequal size and unequal weight: a mean of the ranks' means is not the batch's.
SHARDS = (slice(0, 14), slice(14, 50))


def rank_weighted_steps(rank: int, world: int) -> list[tuple[float, float, Tensor]]:
    """Three steps on this rank's shard of the batch, slice_size 5 on rank 1."""
    model = classifier()
    opt = so.LevenbergMarquardt(model, nn.CrossEntropyLoss(weight=WEIGHT), form="primal")
    x, y = batch(n=50)
    xs, ys = x[SHARDS[rank]], y[SHARDS[rank]]
    out = []
    for _ in range(3):
        info = opt.step(xs, ys, slice_size=5 if rank == 1 else None)
        out.append((float(info.loss_before), float(info.loss), flat(model)))
    return out


@pytest.mark.distributed
def test_ranks_report_the_concatenated_batchs_loss() -> None:
    from secondorder.testing import run_ranks

    results = {r: v.unwrap() for r, v in run_ranks(rank_weighted_steps, 2).items()}
    model = classifier()
    x, y = batch(n=50)
    opt = so.LevenbergMarquardt(model, nn.CrossEntropyLoss(weight=WEIGHT), form="primal")
    first = torch_loss(model, x, y, weight=WEIGHT)
    per_rank = [torch_loss(model, x[s], y[s], weight=WEIGHT) for s in SHARDS]
    assert abs(first - sum(per_rank) / 2) > 1e-3 * first  # averaging per rank would show
    for step in range(3):
        info = opt.step(x, y)
        ref = (float(info.loss_before), float(info.loss), flat(model))
        for rank in (0, 1):
            before, after, params = results[rank][step]
            assert before == pytest.approx(ref[0], rel=1e-9)
            assert after == pytest.approx(ref[1], rel=1e-9)
            torch.testing.assert_close(params, ref[2], rtol=1e-9, atol=1e-12)
        assert results[0][step][:2] == results[1][step][:2]
    assert results[0][0][0] == pytest.approx(first, rel=1e-9, abs=EPS_SLACK)
