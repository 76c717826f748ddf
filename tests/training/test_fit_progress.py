"""The progress display shows each epoch's validation value on that epoch's line."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.training import fit
from secondorder.training.progress import Progress

LINE = re.compile(
    r"epoch (\d+)/(\d+) step (\d+)/\d+ .*?(?:  val loss (\S+)(?: \(epoch (\d+)\))?)?  [\d.]+s$"
)


def problem():
    torch.manual_seed(0)
    x = torch.randn(30, 2, dtype=torch.float64)
    y = torch.sin(x[:, :1]) + x[:, 1:] ** 2
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    xv = torch.randn(10, 2, dtype=torch.float64)
    return model, x, y, (xv, torch.sin(xv[:, :1]) + xv[:, 1:] ** 2)


def shown(value: float | None) -> str | None:
    return None if value is None else f"{value:.4g}"


def lines(err: str) -> list[tuple[int, int, str | None, int | None]]:
    """(epoch, step, validation text, epoch the value is labelled with) of each line."""
    out = []
    for line in err.splitlines():
        found = LINE.match(line)
        if found:
            labelled = None if found.group(5) is None else int(found.group(5))
            out.append((int(found.group(1)), int(found.group(3)), found.group(4), labelled))
    return out


def test_plain_line_of_each_full_batch_epoch_shows_that_epochs_validation(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(Progress, "LINE_INTERVAL", 0.0)
    model, x, y, val = problem()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=4, validation=val,
                  stop_on_terminated=False)  # fmt: skip
    seen = lines(capsys.readouterr().err)
    expected = [(e.epoch, e.step, shown(e.validation), None) for e in history.epochs]
    assert seen == expected
    assert len({v for _, _, v, _ in seen}) == 4  # four different values, not one repeated


def test_plain_lines_of_mini_batches_label_an_earlier_epochs_value(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(Progress, "LINE_INTERVAL", 0.0)
    model, x, y, val = problem()
    data = [(x[:10], y[:10]), (x[10:20], y[10:20]), (x[20:], y[20:])]
    history = fit(so.LevenbergMarquardt(model), data, epochs=2, validation=val,
                  stop_on_terminated=False)  # fmt: skip
    first, second = (shown(e.validation) for e in history.epochs)
    assert lines(capsys.readouterr().err) == [
        (1, 1, None, None),
        (1, 2, None, None),
        (1, 3, first, None),
        (2, 4, first, 1),
        (2, 5, first, 1),
        (2, 6, second, None),
    ]


def test_bar_shows_each_epochs_validation_beside_that_epoch(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(Progress, "BAR_INTERVAL", 0.0)
    model, x, y, val = problem()
    history = fit(so.LevenbergMarquardt(model), (x, y), epochs=5, validation=val,
                  stop_on_terminated=False)  # fmt: skip
    values = {e.epoch: shown(e.validation) for e in history.epochs}
    draws = re.findall(r"epoch (\d+)/5[^\r\n]*?val loss (\S+?)(?: \(epoch (\d+)\))?\]",
                       capsys.readouterr().err)  # fmt: skip
    assert draws, "the bar never showed a validation value"
    for epoch, value, labelled in draws:
        assert value == values[int(labelled or epoch)], (epoch, value, labelled)
    unlabelled = {int(epoch) for epoch, _, labelled in draws if not labelled}
    assert unlabelled == set(values)  # every epoch's own value was drawn beside it
    assert draws[-1] == ("5", values[5], "")
