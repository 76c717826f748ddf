"""fit checks its validation data before training: bad data fails before anything changes.

The reference for each refusal is the error the validation after the first epoch
raises (the optimizer's ``batch_loss`` on the same batch): fit's message carries it,
and the model and optimizer are exactly as they were.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import secondorder as so
from secondorder.training import Callback, fit
from secondorder.training.probe import PROBE_SAMPLES, check_validation
from secondorder.training.steps import as_training_step


def linear_problem(seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.3
    return nn.Linear(3, 1).double(), x, y


def snapshot(model: nn.Module, optimizer: Any) -> tuple[dict[str, Tensor], Any]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def assert_same(a: Any, b: Any) -> None:
    """Nested dicts, lists and tensors equal bit for bit."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert_same(u, v)
    else:
        assert a == b


class Began(Callback):
    def __init__(self) -> None:
        self.began = False

    def on_train_begin(self, optimizer: Any) -> None:
        self.began = True


def classifier(seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(40, 4, dtype=torch.float64)
    labels = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double(), x, labels


def lm_run() -> tuple[nn.Module, Any, dict[str, Any], Tensor, Tensor]:
    model, x, y = linear_problem()
    return model, so.LevenbergMarquardt(model), {}, x, y


def adam_run() -> tuple[nn.Module, Any, dict[str, Any], Tensor, Tensor]:
    model, x, labels = classifier()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, adam, {"model": model, "loss_fn": F.cross_entropy}, x, labels


FIRST = r"^Invalid validation=\(inputs Tensor of shape \(40, \d\), dtype torch\.float(64|32), "
CASES = {
    # LM with mse: the inputs' dtype, the targets' width, the targets' length.
    "lm-dtype": (lm_run, lambda x, y: (x.float(), y), RuntimeError, FIRST + ".*same dtype"),
    "lm-width": (lm_run, lambda x, y: (x, y.repeat(1, 2)), ValueError, FIRST + ".*do not match"),
    "lm-length": (lm_run, lambda x, y: (x, y[:30]), ValueError, FIRST + ".*do not match"),
    # Adam with F.cross_entropy: the inputs' dtype, one-hot floats of the wrong width, length.
    "adam-dtype": (adam_run, lambda x, y: (x.float(), y), RuntimeError, FIRST + ".*same dtype"),
    "adam-width": (
        adam_run,
        lambda x, y: (x, F.one_hot(y, 5).double()),
        RuntimeError,
        FIRST + ".*targets Tensor of shape \\(40, 5\\)",
    ),
    "adam-length": (adam_run, lambda x, y: (x, y[:30]), ValueError, FIRST + ".*batch_size"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_validation_fails_before_training_with_the_epochs_error(case: str) -> None:
    run, bad, error, match = CASES[case]
    model, optimizer, extra, x, y = run()
    validation = bad(x, y)
    before = snapshot(model, optimizer)
    # The reference: what validation after the first epoch raises on this batch.
    stepper = as_training_step(optimizer, **extra)
    model.eval()
    with pytest.raises(error) as reference:
        stepper.batch_loss(*validation)
    model.train()
    began = Began()
    with pytest.raises(error, match=match) as refused:
        fit(optimizer, (x, y), epochs=2, validation=validation, callbacks=[began], **extra)
    assert str(reference.value) in str(refused.value)
    assert str(refused.value).endswith(
        "Pass validation data shaped like the training data (fit checks it before training: "
        "nothing was trained)"
    )
    assert not began.began
    assert_same(snapshot(model, optimizer), before)
    assert model.training


def test_lm_messages_name_the_argument_the_value_and_the_fix() -> None:
    model, x, y = linear_problem()
    opt = so.LevenbergMarquardt(model)
    cases = [
        ((x, y[:, :0]), ValueError, r"targets of shape \(40, 0\) do not match"),
        ((x, torch.zeros(40, 2, dtype=x.dtype)), ValueError, r"shape \(40, 2\) do not match"),
        ((x, y[:30]), ValueError, r"targets of shape \(30, 1\) do not match the model outputs"),
    ]
    for validation, error, match in cases:
        with pytest.raises(error, match=r"^Invalid validation=\(inputs Tensor of shape.*" + match):
            fit(opt, (x, y), epochs=3, validation=validation, progress=False)


@pytest.mark.parametrize(
    "empty",
    [[], DataLoader(TensorDataset(torch.zeros(0, 3), torch.zeros(0, 1)), batch_size=4)],
    ids=["list", "loader"],
)
def test_empty_validation_fails_before_training(empty: Any) -> None:
    model, x, y = linear_problem()
    opt = so.LevenbergMarquardt(model)
    before = snapshot(model, opt)
    kind = "list of 0" if isinstance(empty, list) else "DataLoader of 0 batches"
    with pytest.raises(ValueError, match=rf"Invalid validation={kind}.*: it yields no batches"):
        fit(opt, (x, y), epochs=2, validation=empty, progress=False)
    assert_same(snapshot(model, opt), before)


def test_a_batch_that_cannot_be_split_fails_before_training() -> None:
    model, x, y = linear_problem()
    opt = so.LevenbergMarquardt(model)
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match=r"each batch of validation has 3 items"):
        fit(opt, (x, y), validation=[(x, y, y)], progress=False)
    assert_same(snapshot(model, opt), before)


class Counting(nn.Module):
    """A model that counts the samples it is called on, and may take full batches only."""

    def __init__(self, inner: nn.Module, only: int | None = None) -> None:
        super().__init__()
        self.inner, self.only, self.seen = inner, only, 0

    def forward(self, x: Tensor) -> Tensor:
        if self.only is not None and x.shape[0] != self.only:
            raise RuntimeError(f"this model takes batches of {self.only}, got {x.shape[0]}")
        self.seen += x.shape[0]
        out: Tensor = self.inner(x)
        return out


class SeenAtStart(Callback):
    def __init__(self, model: Counting) -> None:
        self.model, self.seen = model, -1

    def on_train_begin(self, optimizer: Any) -> None:
        self.seen = self.model.seen


def test_the_check_scores_two_samples_of_the_first_batch_only() -> None:
    inner, x, y = linear_problem()
    model = Counting(inner)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    start = SeenAtStart(model)
    fit(adam, (x, y), validation=loader, callbacks=[start], model=model, loss_fn=F.mse_loss,
        progress=False)  # fmt: skip
    assert start.seen == PROBE_SAMPLES == 2
    # After it: one training step (40 samples) and one validation pass (40 samples).
    assert model.seen == 2 + 40 + 40


def test_a_model_of_full_batches_only_is_not_refused_by_the_probe() -> None:
    inner, x, y = linear_problem()
    model = Counting(inner, only=40)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = SeenAtStart(model)
    history = fit(adam, (x, y), epochs=2, validation=(x, y), callbacks=[start], model=model,
                  loss_fn=F.mse_loss, progress=False)  # fmt: skip
    # The two samples were refused, so the whole first batch confirmed the data.
    assert start.seen == 40
    with torch.no_grad():
        assert history.validation[-1] == pytest.approx(float(F.mse_loss(model(x), y)), rel=1e-12)


def test_a_coupled_model_residual_is_checked_on_its_whole_first_batch() -> None:
    inner, x, y = linear_problem()
    model = Counting(inner)

    def coupled(f: Any, inputs: Tensor, targets: Tensor) -> Tensor:
        r = f(inputs) - targets
        return torch.cat([r.reshape(-1), (r.sum() / 10).reshape(1)])

    opt = so.LevenbergMarquardt(model, so.residuals.ModelResidual(coupled))
    start = SeenAtStart(model)
    fit(opt, (x, y), validation=(x[:20], y[:20]), callbacks=[start], progress=False)
    assert start.seen == 20


def test_the_check_changes_no_training_trajectory() -> None:
    """The LM parameters after fit with validation equal those without, bit for bit."""
    runs = []
    for validation in (None, (torch.randn(15, 3, dtype=torch.float64), None)):
        model, x, y = linear_problem(seed=3)
        opt = so.LevenbergMarquardt(model)
        if validation is not None:
            validation = (validation[0], validation[0].sum(1, keepdim=True))
        fit(opt, (x, y), epochs=3, validation=validation, progress=False, stop_on_terminated=False)
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])


class Noisy(Dataset[tuple[Tensor, Tensor]]):
    """A dataset whose items draw from Python's and NumPy's generators (augmentation)."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        jitter = random.random() + float(np.random.rand())
        return self.x[i] + 0 * jitter, self.y[i]


def test_the_check_puts_back_every_random_generator_it_draws_from() -> None:
    model, x, y = linear_problem()
    opt = so.LevenbergMarquardt(model)
    own = torch.Generator().manual_seed(7)
    loader = DataLoader(Noisy(x, y), batch_size=8, shuffle=True, generator=own)
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    states = (torch.get_rng_state(), own.get_state(), random.getstate(), np.random.get_state())
    stepper = as_training_step(opt)
    check_validation(stepper, loader, "loss", stepper.batch_loss)
    after = (torch.get_rng_state(), own.get_state(), random.getstate(), np.random.get_state())
    assert torch.equal(states[0], after[0]) and torch.equal(states[1], after[1])
    assert states[2] == after[2]
    assert all(np.array_equal(a, b) for a, b in zip(states[3], after[3], strict=True))
    # The reference: the same draw without putting them back moves them.
    next(iter(loader))
    assert not torch.equal(own.get_state(), after[1])


def test_metric_errors_are_raised_before_training_too() -> None:
    model, x, labels = classifier()
    opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy)
    before = snapshot(model, opt)
    # accuracy's own refusal: (40, 2) labels for (40,) predictions.
    with pytest.raises(ValueError, match=r"^Invalid validation=.*metric='accuracy'.*one label"):
        fit(opt, (x, labels), validation=(x, labels[:, None].repeat(1, 2)), metric="accuracy")

    def broken(outputs: Tensor, targets: Tensor) -> float:
        return {"f1": 1.0}["recall"]

    # Any other exception is re-raised as a ValueError with fit's message, chained.
    match = r"metric='broken' cannot be computed on it: 'recall'"
    with pytest.raises(ValueError, match=match) as e:
        fit(opt, (x, labels), validation=(x, labels), metric=broken, progress=False)
    assert isinstance(e.value.__cause__, KeyError)
    assert_same(snapshot(model, opt), before)
