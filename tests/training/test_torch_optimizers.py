"""fit drives torch.optim optimizers: bitwise the hand-written loop, with fit's extras."""

from __future__ import annotations

import copy
import csv
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import secondorder as so
from secondorder.training import (
    Callback,
    CSVLogger,
    StepRecord,
    StepResult,
    TorchStep,
    TrainingStep,
    as_training_step,
    fit,
)


def regression(seed=0, points=48):
    torch.manual_seed(seed)
    x = torch.randn(points, 3, dtype=torch.float64)
    y = torch.sin(x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64))
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    return model, x, y


def twin(model):
    """A second model with the same parameters, for the hand-written reference loop."""
    return copy.deepcopy(model)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    assert all(torch.equal(p, q) for p, q in zip(params(a), params(b), strict=True))


def hand_loop(model, optimizer, batches, epochs, loss_fn=F.mse_loss, precondition=None):
    """The loop users write by hand: zero_grad, forward, loss, backward, step."""
    losses = []
    for _ in range(epochs):
        for xb, yb in batches:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            if precondition is not None:
                precondition()
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses


def chunks(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ],
    ids=["sgd", "adamw"],
)
def test_sgd_and_adamw_equal_the_hand_written_loop_bitwise(make):
    model, x, y = regression()
    reference = twin(model)
    batches = chunks(x, y, 16)
    history = fit(make(model.parameters()), batches, epochs=4, model=model,
                  loss_fn=F.mse_loss, progress=False)  # fmt: skip
    losses = hand_loop(reference, make(reference.parameters()), batches, epochs=4)
    assert_bitwise(model, reference)
    assert history.loss == losses
    assert [(s.epoch, s.batch) for s in history.steps[:4]] == [(1, 1), (1, 2), (1, 3), (2, 1)]
    assert history.epochs[0].loss == sum(losses[:3]) / 3
    assert history.stop_reason == "completed 4 epochs"


def dataloader_run(shuffle, own_generator=True):
    model, x, y = regression()
    reference = twin(model)

    def loader():
        # Without a generator of its own, the loader draws from torch's global one.
        generator = torch.Generator().manual_seed(7) if own_generator else None
        torch.manual_seed(7)
        return DataLoader(TensorDataset(x, y), batch_size=10, shuffle=shuffle, generator=generator)

    fit(torch.optim.SGD(model.parameters(), lr=0.1), loader(), epochs=3, model=model,
        loss_fn=F.mse_loss, progress=False)  # fmt: skip
    hand = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = loader()
    for _ in range(3):
        hand_loop(reference, hand, batches, epochs=1)
    return model, reference


def test_dataloader_batches_are_the_hand_loops_batches():
    assert_bitwise(*dataloader_run(shuffle=False))


@pytest.mark.parametrize("own_generator", [True, False], ids=["own-generator", "global-rng"])
def test_shuffled_dataloader_order_is_the_hand_loops_order(own_generator):
    # fit iterates a loader once per epoch, as the hand loop does: no extra iter() whose
    # seed draw would move every later shuffle.
    assert_bitwise(*dataloader_run(shuffle=True, own_generator=own_generator))


def test_lbfgs_closure_path_equals_the_hand_written_closure_loop():
    model, x, y = regression()
    reference = twin(model)

    def make(p):
        return torch.optim.LBFGS(p, lr=1, max_iter=5, history_size=4)

    history = fit(make(model.parameters()), (x, y), epochs=3, model=model, loss_fn=F.mse_loss,
                  progress=False)  # fmt: skip
    hand = make(reference.parameters())
    first = []
    for _ in range(3):

        def closure():
            hand.zero_grad()
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            return loss

        first.append(float(hand.step(closure).detach()))
    assert_bitwise(model, reference)
    assert history.loss == first
    assert all(s.details["evaluations"] > 1 for s in history.steps)
    assert history.loss[-1] < history.loss[0]


class ScaleGrads:
    """A stand-in preconditioner: rewrites each .grad as K-FAC does, here a fixed scaling."""

    def __init__(self, model, seen=None):
        self.model, self.seen = model, seen

    def step(self):
        for i, p in enumerate(self.model.parameters()):
            if self.seen is not None:
                self.seen.append(p.grad is not None)
            p.grad.mul_(0.5 + 0.25 * i)


def test_preconditioner_runs_between_backward_and_step():
    model, x, y = regression()
    reference, again = twin(model), twin(model)
    batches = chunks(x, y, 24)
    seen: list[bool] = []
    fit(torch.optim.SGD(model.parameters(), lr=0.1), batches, epochs=2, model=model,
        loss_fn=F.mse_loss, preconditioner=ScaleGrads(model, seen), progress=False)  # fmt: skip
    hand_loop(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches, epochs=2,
              precondition=ScaleGrads(reference).step)  # fmt: skip
    assert_bitwise(model, reference)
    assert seen and all(seen)  # every .grad existed when the preconditioner ran
    # A plain function is a preconditioner too.
    fit(torch.optim.SGD(again.parameters(), lr=0.1), batches, epochs=2, model=again,
        loss_fn=F.mse_loss, preconditioner=ScaleGrads(again).step, progress=False)  # fmt: skip
    assert_bitwise(again, reference)


def test_records_of_a_torch_step():
    model, x, y = regression()
    opt = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}],
        lr=0.1,
    )
    history = fit(opt, (x, y), epochs=2, model=model, loss_fn=F.mse_loss, progress=False)
    record = history.steps[0]
    assert isinstance(record, StepRecord)
    assert record.loss_before is None and not record.terminated and record.reason == ""
    assert record.details == {"evaluations": 1, "lr": (0.1, 0.01)}
    assert history.loss_label == "loss"
    with pytest.raises(AttributeError, match=r"StepRecord\.damping is a Levenberg-Marquardt"):
        _ = record.damping
    single = fit(torch.optim.Adam(model.parameters(), lr=1e-3), (x, y), model=model,
                 loss_fn=F.mse_loss, progress=False)  # fmt: skip
    assert single.steps[0].details == {"evaluations": 1, "lr": 1e-3}


def test_validation_loss_is_the_per_sample_mean_over_batches():
    model, x, y = regression(points=60)
    xv, yv = x[:23], y[:23]
    history = fit(torch.optim.Adam(model.parameters(), lr=1e-2), (x[23:], y[23:]), epochs=3,
                  model=model, loss_fn=F.mse_loss, progress=False,
                  validation=[(xv[:10], yv[:10]), (xv[10:], yv[10:])])  # fmt: skip
    with torch.no_grad():
        direct = float(F.mse_loss(model(xv), yv))
    assert history.metric == "loss"
    assert history.validation[-1] == pytest.approx(direct, rel=1e-12)


def test_accuracy_early_stopping_and_restore_best_with_adamw():
    torch.manual_seed(0)
    x = torch.randn(90, 4, dtype=torch.float64)
    labels = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = fit(opt, (x[30:], labels[30:]), epochs=3, model=model, loss_fn=F.cross_entropy,
              progress=False, validation=(x[:30], labels[:30]), metric="accuracy")  # fmt: skip
    with torch.no_grad():
        right = (model(x[:30]).argmax(1) == labels[:30]).double().mean()
    assert acc.validation[-1] == pytest.approx(float(right))
    values = iter([3.0, 1.0, 2.0, 2.5, 0.1])
    snapshots = []

    class Snapshot(Callback):
        def on_epoch(self, record):
            snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))

    history = fit(opt, (x, labels), epochs=10, model=model, loss_fn=F.cross_entropy,
                  progress=False, validation=lambda: next(values), patience=2,
                  restore_best=True, callbacks=[Snapshot()])  # fmt: skip
    assert len(history.epochs) == 4 and history.best_epoch == 2
    assert history.stop_reason.startswith("early stopping: validation <lambda>")
    assert history.stop_reason.endswith("restored the parameters of epoch 2")
    now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(now, snapshots[1]) and not torch.equal(now, snapshots[-1])


def test_function_callbacks_get_the_record_and_can_stop():
    model, x, y = regression()
    seen: list[StepRecord] = []
    history = fit(torch.optim.SGD(model.parameters(), lr=0.05), chunks(x, y, 8), epochs=5,
                  model=model, loss_fn=F.mse_loss, progress=False,
                  callbacks=[seen.append, lambda r: r.step == 9])  # fmt: skip
    assert seen == history.steps and len(history) == 9
    assert history.stop_reason == "stopped by callback _FunctionCallback"
    assert len(history.epochs) == 2  # the stopped epoch is recorded


def test_csv_logger_writes_common_fields_and_details(tmp_path):
    model, x, y = regression()
    path = tmp_path / "steps.csv"
    history = fit(torch.optim.SGD(model.parameters(), lr=0.05), chunks(x, y, 16), epochs=2,
                  model=model, loss_fn=F.mse_loss, progress=False,
                  callbacks=[CSVLogger(path)])  # fmt: skip
    with path.open() as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    assert reader.fieldnames == [*CSVLogger.COMMON_FIELDS, "evaluations", "lr", "reason"]
    assert [float(r["loss"]) for r in rows] == history.loss
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert {r["lr"] for r in rows} == {"0.05"} and {r["loss_before"] for r in rows} == {""}


def test_tensorboard_logger_logs_loss_and_details(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    model, x, y = regression()
    history = fit(torch.optim.SGD(model.parameters(), lr=0.05), (x, y), epochs=3, model=model,
                  loss_fn=F.mse_loss, progress=False,
                  callbacks=[so.TensorBoardLogger(tmp_path, prefix="sgd/")])  # fmt: skip
    events = accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("sgd/loss")]
    assert losses == [(s.step, pytest.approx(s.loss, rel=1e-6)) for s in history.steps]
    assert [e.value for e in events.Scalars("sgd/lr")] == pytest.approx([0.05] * 3)
    assert [e.value for e in events.Scalars("sgd/evaluations")] == [1.0] * 3


def test_progress_shows_loss_and_learning_rate(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    model, x, y = regression()
    history = fit(torch.optim.SGD(model.parameters(), lr=0.05), (x, y), epochs=2, model=model,
                  loss_fn=F.mse_loss)  # fmt: skip
    err = capsys.readouterr().err
    assert f"epoch 1/2 step 1/2  loss {history.loss[0]:.3e}  lr 5.0e-02" in err
    assert "fit: completed 2 epochs" in err


def test_history_plot_without_a_loss_before(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model, x, y = regression()
    history = fit(torch.optim.SGD(model.parameters(), lr=0.05), (x, y), epochs=3, model=model,
                  loss_fn=F.mse_loss, progress=False)  # fmt: skip
    fig = history.plot(x="step", logy=False)
    line = fig.axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [1, 2, 3]
    assert list(line.get_ydata()) == history.loss
    assert fig.axes[0].get_ylabel() == "loss"
    plt.close(fig)


class HalfStep:
    """A custom TrainingStep: gradient descent written by hand, for the protocol test."""

    loss_label = "loss"

    def __init__(self, model):
        self.model, self.optimizer = model, "half-step"

    def step(self, inputs, targets):
        loss = F.mse_loss(self.model(inputs), targets)
        grads = torch.autograd.grad(loss, list(self.model.parameters()))
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.sub_(0.5 * g)
        value = float(loss.detach())
        return StepResult(loss=value, details={"rate": 0.5}, terminated=value < 0.1, reason="small")

    def batch_loss(self, inputs, targets):
        with torch.no_grad():
            return float(F.mse_loss(self.model(inputs), targets)) * len(inputs), len(inputs)

    def describe(self, record):
        return f"loss {record.loss:.3e}"


def test_a_custom_training_step_is_driven_as_is():
    model, x, y = regression()
    reference = twin(model)
    step = HalfStep(model)
    assert isinstance(step, TrainingStep) and as_training_step(step) is step
    begun = []

    class Begin(Callback):
        def on_train_begin(self, optimizer):
            begun.append(optimizer)

    history = fit(step, (x, y), epochs=200, progress=False, callbacks=[Begin()])
    assert begun == ["half-step"]
    assert history.stop_reason == "optimizer terminated: small"
    hand_loop(reference, torch.optim.SGD(reference.parameters(), lr=0.5), [(x, y)],
              epochs=len(history))  # fmt: skip
    assert torch.allclose(
        torch.cat([p.reshape(-1) for p in params(model)]),
        torch.cat([p.reshape(-1) for p in params(reference)]),
        rtol=1e-12,
        atol=1e-14,
    )


def test_lm_with_its_own_model_is_accepted_and_unchanged():
    model, x, y = regression()
    reference = twin(model)
    a = fit(so.LevenbergMarquardt(model), (x, y), epochs=3, model=model, progress=False)
    b = fit(so.LevenbergMarquardt(reference), (x, y), epochs=3, progress=False)
    assert_bitwise(model, reference)
    assert a.loss == b.loss and a.loss_label == "loss (mean r²)"


def test_torch_step_adapter_is_chosen_for_torch_optimizers():
    model, _, _ = regression()
    step = as_training_step(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                            loss_fn=F.mse_loss)  # fmt: skip
    assert isinstance(step, TorchStep) and step.model is model


class Lazy(torch.optim.SGD):
    """An optimizer whose step ignores the closure."""

    def step(self, closure=None):
        return None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, TypeError, r"fit needs model= and loss_fn= to train SGD, a torch\.optim optimizer"),
        ({"model": "m"}, TypeError, r"fit needs loss_fn= to train SGD"),
        ({"loss_fn": F.mse_loss}, TypeError, r"fit needs model= to train SGD"),
        (
            {"model": 3, "loss_fn": F.mse_loss},
            TypeError,
            "model must be a torch.nn.Module, got int",
        ),
        ({"model": "m", "loss_fn": "mse"}, TypeError, "loss_fn must be a function .* got 'mse'"),
        (
            {"model": "other", "loss_fn": F.mse_loss},
            ValueError,
            "model holds none of the parameters SGD updates",
        ),
        (
            {"model": "m", "loss_fn": F.mse_loss, "preconditioner": 5},
            TypeError,
            r"preconditioner must have a step\(\) method .* got int: 5",
        ),
    ],
)
def test_torch_optimizer_argument_errors_name_the_argument(kwargs, error, match):
    model, x, y = regression()
    before = params(model)
    stand_in = {"m": model, "other": nn.Linear(3, 1).double()}
    kwargs = {k: stand_in.get(v, v) if isinstance(v, str) and k == "model" else v
              for k, v in kwargs.items()}  # fmt: skip
    with pytest.raises(error, match=match):
        fit(torch.optim.SGD(model.parameters(), lr=0.1), (x, y), progress=False, **kwargs)
    assert all(torch.equal(p, q) for p, q in zip(before, params(model), strict=True))


def test_step_errors_name_the_cause():
    model, x, y = regression()
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got \(48, 1\)"):
        fit(torch.optim.SGD(model.parameters(), lr=0.1), (x, y), model=model,
            loss_fn=lambda o, t: (o - t) ** 2, progress=False)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"Lazy\.step\(closure\) never called the closure"):
        fit(Lazy(model.parameters(), lr=0.1), (x, y), model=model, loss_fn=F.mse_loss,
            progress=False)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_fn": F.mse_loss}, r"loss_fn= is for torch\.optim optimizers; LevenbergMarquardt"),
        ({"preconditioner": object()}, r"preconditioner= is for torch\.optim optimizers"),
        ({"model": nn.Linear(3, 1)}, "model= is not the module this LevenbergMarquardt trains"),
    ],
)
def test_lm_rejects_torch_only_arguments(kwargs, match):
    model, x, y = regression()
    with pytest.raises(ValueError, match=match):
        fit(so.LevenbergMarquardt(model), (x, y), progress=False, **kwargs)


def test_custom_step_rejects_torch_only_arguments_and_unknown_optimizers_are_named():
    model, x, y = regression()
    with pytest.raises(ValueError, match=r"loss_fn= is for torch\.optim optimizers; HalfStep"):
        fit(HalfStep(model), (x, y), loss_fn=F.mse_loss, progress=False)
    with pytest.raises(
        TypeError,
        match=r"optimizer must be a secondorder\.LevenbergMarquardt, a torch\.optim\.Optimizer "
        r"or a secondorder\.training\.TrainingStep, got str",
    ):
        fit("adam", (x, y))
