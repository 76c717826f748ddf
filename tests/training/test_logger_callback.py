"""LoggerCallback hands each epoch's (or step's) numbers to a log(metrics, step) function."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.training import LoggerCallback, fit


def problem(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(24, 2, dtype=torch.float64)
    y = torch.sin(x[:, :1]) - x[:, 1:]
    model = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    return model, x, y, (x[:8] + 0.1, y[:8])


def epoch_metrics(e):
    """What an epoch should log: its record's fields."""
    return {"epoch": e.epoch, "epoch_loss": e.loss, "time": e.time, "validation": e.validation}


class Recorder:
    """A stand-in for mlflow.log_metrics / wandb.log: the calls it received."""

    def __init__(self):
        self.calls: list[tuple[dict[str, float], int]] = []

    def __call__(self, metrics, step):
        self.calls.append((metrics, step))


def test_every_epoch_logs_the_epoch_records():
    model, x, y, val = problem()
    log = Recorder()
    opt = so.LevenbergMarquardt(model)
    history = fit(opt, (x, y), epochs=5, progress=False, validation=val,
                  stop_on_terminated=False, callbacks=[LoggerCallback(log)])  # fmt: skip
    assert log.calls == [(epoch_metrics(e), e.step) for e in history.epochs]
    assert len(log.calls) == 5 and all(
        isinstance(v, float) for m, _ in log.calls for v in m.values()
    )


def test_every_step_logs_levenberg_marquardt_steps():
    model, x, y, _ = problem()
    log = Recorder()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=4, progress=False,
                  stop_on_terminated=False,
                  callbacks=[LoggerCallback(log, every="step", prefix="lm/")])  # fmt: skip
    assert [step for _, step in log.calls] == [s.step for s in history.steps] == [1, 2, 3, 4]
    for (metrics, _), record in zip(log.calls, history.steps, strict=True):
        expected = {
            "lm/loss": record.loss,
            "lm/damping": record.damping,
            "lm/attempts": float(record.attempts),
            **{f"lm/time/{k}": v for k, v in record.timings.items()},
        }
        assert metrics == expected


def test_both_with_a_torch_optimizer_and_mini_batches():
    model, x, y, val = problem()
    groups = [
        {"params": model[0].parameters(), "lr": 0.05},
        {"params": model[2].parameters(), "lr": 0.02},
    ]
    opt = torch.optim.SGD(groups)
    data = [(x[:12], y[:12]), (x[12:], y[12:])]
    log = Recorder()
    logger = LoggerCallback(log, every="both")
    history = fit(opt, data, epochs=3, model=model, loss_fn=nn.functional.mse_loss,
                  validation=val, progress=False, callbacks=[logger])  # fmt: skip
    steps, epochs = iter(history.steps), iter(history.epochs)
    expected = []
    for _epoch in range(3):
        for _ in range(2):
            s = next(steps)
            metrics = {"loss": s.loss, "lr/0": 0.05, "lr/1": 0.02, "evaluations": 1.0}
            expected.append((metrics, s.step))
        e = next(epochs)
        expected.append((epoch_metrics(e), e.step))
    assert log.calls == expected
    # The steps handed to the logger never decrease (W&B refuses a smaller step).
    assert [s for _, s in log.calls] == sorted(s for _, s in log.calls)


def test_without_validation_no_validation_key():
    model, x, y, _ = problem()
    log = Recorder()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=2, progress=False,
                  stop_on_terminated=False, callbacks=[LoggerCallback(log)])  # fmt: skip
    assert [m for m, _ in log.calls] == [
        {"epoch": e.epoch, "epoch_loss": e.loss, "time": e.time} for e in history.epochs
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"log": "mlflow"}, TypeError,
         r"log must be a function log\(metrics: dict, step: int\), got 'mlflow'; for example"),
        ({"log": print, "every": "batch"}, ValueError,
         r"Unknown every='batch'; valid choices are \('epoch', 'step', 'both'\)\."),
        ({"log": print, "prefix": 3}, TypeError, "prefix must be a str, got 3"),
    ],
)  # fmt: skip
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoggerCallback(**kwargs)
