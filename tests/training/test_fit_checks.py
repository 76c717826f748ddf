"""fit's checks on what it is given: metric shapes, NaN validation values, multi-input batches."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import secondorder as so
from secondorder.training import fit
from secondorder.training.data import batch_size, batches, is_single_batch
from secondorder.training.validation import accuracy


def classifier(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(60, 4, dtype=torch.float64)
    labels = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return model, x, labels


def test_accuracy_of_column_labels_equals_that_of_flat_labels():
    model, x, labels = classifier()
    with torch.no_grad():
        logits = model(x)
    # The reference: the fraction of argmax predictions equal to the labels, by hand.
    right = sum(int(logits[i].argmax()) == int(labels[i]) for i in range(len(labels)))
    assert accuracy(logits, labels) == (float(right), 60)
    assert accuracy(logits, labels[:, None]) == (float(right), 60)
    # One logit per sample against (N,) or (N, 1) 0/1 labels.
    one = logits[:, :1]
    binary = (labels > 0).long()
    right1 = sum(int(float(one[i, 0]) > 0) == int(binary[i]) for i in range(60))
    assert accuracy(one, binary) == (float(right1), 60)
    assert accuracy(one[:, 0], binary[:, None]) == (float(right1), 60)


def test_fit_accuracy_with_column_targets_is_a_fraction():
    model, x, labels = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = fit(
        opt, (x, labels), model=model, loss_fn=F.cross_entropy, epochs=1, progress=False,
        validation=(x, labels[:, None]), metric="accuracy",
    )  # fmt: skip
    with torch.no_grad():
        expected = float((model(x).argmax(1) == labels).double().mean())
    assert history.validation[-1] == pytest.approx(expected)
    assert 0.0 <= history.validation[-1] <= 1.0


def test_accuracy_with_labels_of_another_shape_raises():
    logits = torch.randn(6, 3)
    with pytest.raises(
        ValueError,
        match=r"metric='accuracy' needs one label per prediction: outputs of shape \(6, 3\) "
        r"give predictions of shape \(6,\), but the targets have shape \(6, 2\)",
    ):
        accuracy(logits, torch.zeros(6, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets have shape \(3,\)"):
        accuracy(torch.randn(6, 1), torch.zeros(3))


def run_with_validation(values, **kwargs):
    model = nn.Linear(2, 1).double()
    x = torch.randn(8, 2, dtype=torch.float64)
    it = iter(values)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return fit(
        opt, (x, x[:, :1]), model=model, loss_fn=F.mse_loss, epochs=len(values),
        progress=False, validation=lambda: next(it), **kwargs,
    )  # fmt: skip


def test_nan_validation_is_never_the_best_epoch():
    nan = math.nan
    history = run_with_validation([nan, 3.0, 2.0, nan, 2.5, 1.0])
    assert history.best_validation == 1.0 and history.best_epoch == 6
    # A NaN epoch is an epoch without improvement: patience counts it.
    stopped = run_with_validation([2.0, nan, nan, 1.0], patience=2)
    assert len(stopped.epochs) == 3 and stopped.best_epoch == 1
    assert "(best 2 at epoch 1)" in stopped.stop_reason
    maximised = run_with_validation([nan, 0.5, 0.25], mode="max")
    assert maximised.best_validation == 0.5 and maximised.best_epoch == 2


def test_all_nan_validation_stops_with_a_clear_reason():
    history = run_with_validation([math.nan, math.nan, math.nan], patience=2)
    assert history.best_validation is None and history.best_epoch is None
    assert history.stop_reason == (
        "early stopping: validation <lambda> did not improve for 2 epochs "
        "(no epoch had a validation value that is not NaN)"
    )


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 1).double()
        self.b = nn.Linear(2, 1).double()

    def forward(self, inputs):
        x1, x2 = inputs
        return self.a(x1) + self.b(x2)


def two_input_data(seed=0, n=24):
    torch.manual_seed(seed)
    x1 = torch.randn(n, 3, dtype=torch.float64)
    x2 = torch.randn(n, 2, dtype=torch.float64)
    y = torch.sin(x1[:, :1]) + x2[:, 1:] ** 2
    return x1, x2, y


def test_a_tuple_of_inputs_is_one_batch():
    x1, x2, y = two_input_data()
    assert is_single_batch(((x1, x2), y)) and is_single_batch([[x1, x2], None])
    assert batch_size((x1, x2), None) == 24 and batch_size((x1, x2), y) == 24
    # Two (inputs, targets) batches stay two batches.
    assert not is_single_batch([(x1, y), (x1, y)])
    assert list(batches(((x1, x2), y), "data")()) == [((x1, x2), y)]


@pytest.mark.parametrize("container", [tuple, list])
def test_fit_on_a_multi_input_batch_equals_the_hand_written_loop(container):
    x1, x2, y = two_input_data()
    torch.manual_seed(1)
    model = TwoInputs()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    data = container([container([x1, x2]), y])
    history = fit(opt, data, model=model, loss_fn=F.mse_loss, epochs=3, progress=False,
                  validation=data)  # fmt: skip
    for _ in range(3):
        ref_opt.zero_grad()
        loss = F.mse_loss(reference((x1, x2)), y)
        loss.backward()
        ref_opt.step()
    assert len(history.steps) == 3  # one step per epoch: the pair is one batch
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    with torch.no_grad():
        expected = float(F.mse_loss(reference((x1, x2)), y))
    assert history.validation[-1] == pytest.approx(expected, rel=1e-12)


def test_levenberg_marquardt_fits_a_multi_input_batch():
    x1, x2, y = two_input_data()
    torch.manual_seed(2)
    model = TwoInputs()
    history = fit(so.LevenbergMarquardt(model), ((x1, x2), y), epochs=2, progress=False)
    assert len(history.steps) == 2
    with torch.no_grad():
        final = float(((model((x1, x2)) - y) ** 2).mean())
    # The model is linear in its parameters: LM reaches the least-squares solution.
    design = torch.cat([x1, x2, torch.ones(24, 1, dtype=torch.float64)], 1)
    coef = torch.linalg.lstsq(design, y).solution
    best = float(((design @ coef - y) ** 2).mean())
    assert final == pytest.approx(best, rel=1e-8)
