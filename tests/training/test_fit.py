"""The training loop: convergence, stopping rules, callbacks, logging and plots."""

from __future__ import annotations

import csv
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import secondorder as so
from secondorder.compat.cupylma import LMA
from secondorder.lm import StepInfo
from secondorder.training import Callback, CSVLogger, History, StepRecord, fit


def sinc_problem(points=200, hidden=32, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    x = torch.linspace(-1, 1, points, dtype=dtype).unsqueeze(1)
    y = torch.sinc(10 * x)
    model = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)
    return model, x, y


def linear_problem(seed=0):
    """A linear model on exactly linear data: LM solves it and its tests fire."""
    torch.manual_seed(seed)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.3
    return nn.Linear(3, 1).double(), x, y


def test_sinc_reaches_low_mse():
    model, x, y = sinc_problem()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=300, progress=False)
    assert len(history) == len(history.epochs) <= 300
    with torch.no_grad():
        mse = float(nn.functional.mse_loss(model(x), y))
    # The history's last loss is the model's MSE, measured independently here.
    assert history.loss[-1] == pytest.approx(mse, rel=1e-3)
    assert mse < 1e-6
    assert history.time == sorted(history.time)
    assert [s.step for s in history.steps] == list(range(1, len(history) + 1))


def test_stops_when_the_optimizer_terminates():
    model, x, y = linear_problem()
    seen: list[StepInfo] = []
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=500, callbacks=[seen.append])
    assert len(history) < 50
    assert history.steps[-1].terminated
    assert history.stop_reason.startswith("optimizer terminated: ")
    assert history.stop_reason.endswith(history.steps[-1].reason)
    assert len(seen) == len(history) and all(isinstance(i, StepInfo) for i in seen)
    assert [i.loss for i in seen] == history.loss
    lstsq = torch.linalg.lstsq(torch.cat([x, torch.ones(40, 1, dtype=x.dtype)], 1), y).solution
    assert torch.allclose(model.weight[0], lstsq[:3, 0], atol=1e-8)
    assert torch.allclose(model.bias, lstsq[3], atol=1e-8)


def test_stop_on_terminated_false_runs_all_epochs():
    model, x, y = linear_problem()
    history = fit(
        so.LevenbergMarquardt(model), (x, y), epochs=12, progress=False, stop_on_terminated=False
    )
    assert len(history) == 12
    assert history.stop_reason == "completed 12 epochs"


def test_early_stopping_triggers_after_patience_epochs():
    model, x, y = sinc_problem(points=50, hidden=8, dtype=torch.float64)
    values = iter([3.0, 2.0, 1.0, 1.5, 1.2, 1.0, 0.5])
    history = fit(
        so.LevenbergMarquardt(model),
        (x, y),
        epochs=50,
        progress=False,
        validation=lambda: next(values),
        patience=3,
    )
    assert [e.validation for e in history.epochs] == [3.0, 2.0, 1.0, 1.5, 1.2, 1.0]
    assert history.best_validation == 1.0 and history.best_epoch == 3
    assert history.stop_reason.startswith("early stopping: validation <lambda> did not improve")


def test_restore_best_loads_the_best_epoch():
    model, x, y = sinc_problem(points=50, hidden=8, dtype=torch.float64)
    values = iter([3.0, 1.0, 2.0, 2.5])
    snapshots: list[torch.Tensor] = []

    class Snapshot(Callback):
        def on_epoch(self, record):
            snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))

    fit(
        so.LevenbergMarquardt(model),
        (x, y),
        epochs=10,
        progress=False,
        validation=lambda: next(values),
        patience=2,
        restore_best=True,
        callbacks=[Snapshot()],
    )
    now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert len(snapshots) == 4
    assert torch.equal(now, snapshots[1])
    assert not torch.equal(now, snapshots[-1])


def test_validation_loss_and_accuracy_match_direct_computation():
    torch.manual_seed(0)
    x = torch.randn(120, 4, dtype=torch.float64)
    labels = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy)
    xv, yv = x[:40], labels[:40]
    acc = fit(opt, (x[40:], labels[40:]), epochs=3, progress=False, validation=(xv, yv),
              metric="accuracy")  # fmt: skip
    with torch.no_grad():
        logits = model(xv)
    assert acc.validation[-1] == pytest.approx(float((logits.argmax(1) == yv).double().mean()))
    assert acc.metric == "accuracy"
    loss = fit(opt, (x[40:], labels[40:]), epochs=1, progress=False, validation=[(xv, yv)])
    with torch.no_grad():
        ce = float(nn.functional.cross_entropy(model(xv), yv))
    assert loss.validation[0] == pytest.approx(ce, rel=1e-9)


def test_dataloader_mini_batches_and_epochs():
    model, x, y = sinc_problem(points=64, hidden=8, dtype=torch.float64)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    history = fit(
        so.LevenbergMarquardt(model),
        loader,
        epochs=3,
        progress=False,
        stop_on_terminated=False,
    )
    assert len(history) == 12
    assert [(s.epoch, s.batch) for s in history.steps[:5]] == [
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
        (2, 1),
    ]
    assert len(history.epochs) == 3
    assert history.epochs[0].loss == pytest.approx(sum(history.loss[:4]) / 4)


def test_csv_logger_writes_a_row_per_step(tmp_path):
    model, x, y = linear_problem()
    path = tmp_path / "logs" / "steps.csv"
    epochs_path = tmp_path / "epochs.csv"
    history = fit(
        so.LevenbergMarquardt(model),
        (x, y),
        epochs=5,
        progress=False,
        stop_on_terminated=False,
        validation=(x, y),
        callbacks=[CSVLogger(path, epochs_path=epochs_path)],
    )
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(history) == 5
    assert [float(r["loss"]) for r in rows] == history.loss
    assert [float(r["damping"]) for r in rows] == [s.damping for s in history.steps]
    assert all(float(r["time_total"]) > 0 for r in rows)
    with epochs_path.open() as fh:
        epochs = list(csv.DictReader(fh))
    assert [float(r["validation"]) for r in epochs] == history.validation
    # append=True continues the file without a second header.
    fit(so.LevenbergMarquardt(model), (x, y), epochs=2, progress=False,
        stop_on_terminated=False, callbacks=[CSVLogger(path, append=True)])  # fmt: skip
    with path.open() as fh:
        assert len(list(csv.DictReader(fh))) == 7


def test_history_plot_writes_png(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model, x, y = linear_problem()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=4, progress=False,
                  validation=(x, y), stop_on_terminated=False)  # fmt: skip
    for axis in ("time", "step"):
        path = tmp_path / f"loss_{axis}.png"
        fig = history.plot(x=axis, path=path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(fig.axes) == 2  # loss, and the validation metric
        plt.close(fig)
    fig, ax = plt.subplots()
    assert history.plot(ax=ax, label="LM") is fig
    plt.close(fig)
    with pytest.raises(ValueError, match="Unknown x='epoch'"):
        history.plot(x="epoch")
    with pytest.raises(ValueError, match="history is empty"):
        History().plot()


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    model, x, y = linear_problem()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=1, progress=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"History\.plot needs matplotlib"):
        history.plot()


def test_callback_can_stop_training():
    model, x, y = sinc_problem(points=50, hidden=8, dtype=torch.float64)
    history = fit(
        so.LevenbergMarquardt(model),
        (x, y),
        epochs=100,
        progress=False,
        callbacks=[lambda info: info.loss < 0.05],
    )
    assert history.loss[-1] < 0.05
    assert all(loss >= 0.05 for loss in history.loss[:-1])
    assert history.stop_reason == "stopped by callback _FunctionCallback"


def test_progress_plain_lines_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    model, x, y = linear_problem()
    fit(so.LevenbergMarquardt(model), (x, y), epochs=3, stop_on_terminated=False)
    err = capsys.readouterr().err
    assert "epoch 1/3 step 1/3  loss" in err and "λ" in err and "attempts" in err
    assert "fit: completed 3 epochs" in err


def test_progress_false_is_silent(capsys):
    model, x, y = linear_problem()
    fit(so.LevenbergMarquardt(model), (x, y), epochs=3, progress=False)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_cupylma_drop_in_is_accepted():
    model, x, y = linear_problem()
    lma = LMA(model, [], so.residuals.mse)
    history = fit(lma, (x, y), epochs=3, progress=False, stop_on_terminated=False)
    assert len(history) == 3 and history.loss[-1] < history.steps[0].loss_before


def test_tensorboard_logger_records_every_step(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    from secondorder.training import TensorBoardLogger

    model, x, y = sinc_problem(points=60, hidden=6, dtype=torch.float64)
    seen: list[StepInfo] = []
    history = fit(so.LevenbergMarquardt(model, solver="cg"), (x, y), epochs=3, progress=False,
                  validation=(x, y), stop_on_terminated=False,
                  callbacks=[TensorBoardLogger(tmp_path, prefix="lm/"), seen.append])  # fmt: skip
    events = event_accumulator.EventAccumulator(str(tmp_path))
    events.Reload()

    def scalars(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    steps = [1, 2, 3]
    assert scalars("lm/loss") == [
        (s, pytest.approx(i.loss, rel=1e-6)) for s, i in zip(steps, seen, strict=True)
    ]
    assert scalars("lm/damping") == [
        (s, pytest.approx(i.damping, rel=1e-6)) for s, i in zip(steps, seen, strict=True)
    ]
    assert scalars("lm/attempts") == [(s, i.attempts) for s, i in zip(steps, seen, strict=True)]
    assert scalars("lm/cg_iterations") == [
        (s, i.cg_iterations) for s, i in zip(steps, seen, strict=True)
    ]
    assert all(i.cg_iterations > 0 for i in seen)
    for stage in ("linearize", "solve_and_trials", "total"):
        assert [v for _, v in scalars(f"lm/time/{stage}")] == pytest.approx(
            [i.timings[stage] for i in seen], rel=1e-6
        )
    assert [v for _, v in scalars("lm/validation")] == pytest.approx(history.validation, rel=1e-6)


def test_csv_logger_records_cg_iterations(tmp_path):
    model, x, y = sinc_problem(points=60, hidden=6, dtype=torch.float64)
    seen: list[StepInfo] = []
    path = tmp_path / "steps.csv"
    history = fit(so.LevenbergMarquardt(model, solver="cg"), (x, y), epochs=3, progress=False,
                  stop_on_terminated=False, callbacks=[CSVLogger(path), seen.append])  # fmt: skip
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["cg_iterations"]) for r in rows] == [i.cg_iterations for i in seen]
    assert [s.cg_iterations for s in history.steps] == [i.cg_iterations for i in seen]
    assert all(i.cg_iterations > 0 for i in seen)
    for stage in ("linearize", "solve_and_trials", "total"):
        assert [float(r[f"time_{stage}"]) for r in rows] == pytest.approx(
            [i.timings[stage] for i in seen], abs=1e-6
        )


def test_progress_bar_with_tqdm_shows_loss_damping_and_attempts(capsys):
    pytest.importorskip("tqdm")
    model, x, y = linear_problem()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=3, stop_on_terminated=False,
                  validation=(x, y))  # fmt: skip
    err = capsys.readouterr().err
    last = history.steps[-1]
    assert f"loss {last.loss:.3e}" in err
    assert f"λ {last.damping:.1e}" in err and f"attempts {last.attempts}" in err
    assert "epoch 3/3" in err and "val loss" in err
    assert "fit: completed 3 epochs" in err


def test_step_record_fields():
    model, x, y = linear_problem()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=1, progress=False)
    record = history.steps[0]
    assert isinstance(record, StepRecord)
    assert record.epoch == 1 and record.batch == 1 and record.attempts >= 1
    assert set(record.timings) >= {"linearize", "total"}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"epochs": 0}, ValueError, r"Invalid epochs=0: must be an integer >= 1"),
        ({"epochs": 2.5}, ValueError, r"Invalid epochs=2\.5"),
        ({"patience": 3}, ValueError, "patience=3 needs validation data"),
        ({"patience": 0, "validation": "xy"}, ValueError, r"Invalid patience=0"),
        ({"restore_best": True}, ValueError, "restore_best=True needs validation data"),
        ({"metric": "accuracy"}, ValueError, "metric='accuracy' needs validation data"),
        ({"metric": "f1", "validation": "xy"}, ValueError, "Unknown metric='f1'"),
        ({"metric": "loss", "validation": lambda: 1.0}, ValueError, "metric must be None"),
        ({"mode": "best"}, ValueError, "Unknown mode='best'"),
        ({"progress": "yes"}, TypeError, "progress must be True or False, got 'yes'"),
        ({"callbacks": print}, TypeError, "callbacks must be a list of callbacks"),
        ({"callbacks": [42]}, TypeError, "each of callbacks must be a Callback or a function"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    model, x, y = linear_problem()
    if kwargs.get("validation") == "xy":
        kwargs["validation"] = (x, y)
    with pytest.raises(error, match=match):
        fit(so.LevenbergMarquardt(model), (x, y), **{"progress": False, **kwargs})


def test_bad_optimizer_and_data_are_named():
    model, x, y = linear_problem()
    with pytest.raises(
        TypeError, match=r"optimizer must be a secondorder\.LevenbergMarquardt, got Adam"
    ):
        fit(torch.optim.Adam(model.parameters()), (x, y))
    opt = so.LevenbergMarquardt(model)
    with pytest.raises(TypeError, match=r"data must be an .* got a single tensor of shape"):
        fit(opt, x, progress=False)
    with pytest.raises(TypeError, match=r"data must be an .* got int"):
        fit(opt, 3, progress=False)
    with pytest.raises(TypeError, match=r"each batch of data has 3 items; fit takes \(inputs"):
        fit(opt, [(x, y, y)], progress=False)
    with pytest.raises(TypeError, match=r"each batch of data must be \(inputs, targets\)"):
        fit(opt, [(1, 2, 3)], progress=False)
    with pytest.raises(ValueError, match="data is a one-shot iterator"):
        fit(opt, iter([(x, y)]), epochs=2, progress=False, stop_on_terminated=False)
    with pytest.raises(ValueError, match="validation is a one-shot iterator"):
        fit(opt, (x, y), validation=iter([(x, y)]), progress=False)
    with pytest.raises(TypeError, match="validation\\(\\) must return a number"):
        fit(opt, (x, y), validation=lambda: "good", progress=False)
    with pytest.raises(ValueError, match="data yielded no batches in epoch 1"):
        fit(opt, [], progress=False)
