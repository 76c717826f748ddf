"""The per-step shortcuts of a one-slice batch, against the same step without them.

A batch whose slice is the whole batch is handed to the Jacobian and the trial
evaluations as it is (no ``x[0:B]`` views), the flat point is cut into parameter
views with ``split_with_sizes``, and one local device moves and gathers nothing
that is already in place.  The reference is the step as it ran before: slices made
with :func:`~secondorder.lm.model.slice_tree` and the device pipeline, every
trajectory bitwise equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.lm.model import slice_tree
from secondorder.lm.problem import ModelProblem

STEPS = 4


def _old_slices(self: ModelProblem) -> Iterator[tuple[Any, Any]]:
    """``ModelProblem.slices`` without the one-slice shortcut (views of every slice)."""
    setup = self.setup
    if not setup.strategy.per_sample:
        yield setup.inputs, setup.targets
        return
    for start in range(0, setup.batch_size, setup.slice_size):
        stop = min(start + setup.slice_size, setup.batch_size)
        targets = slice_tree(setup.targets, start, stop) if setup.targets is not None else None
        yield slice_tree(setup.inputs, start, stop), targets


def _problem(kind: str) -> tuple[nn.Module, Any, Any, Any]:
    torch.manual_seed(0)
    if kind == "mlp-ce":
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        return model, so.residuals.cross_entropy, x, y
    if kind == "cnn-ce":
        model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
        x, y = torch.randn(20, 1, 6, 6), torch.randint(0, 4, (20,))
        return model, so.residuals.cross_entropy, x, y
    # A dict input, a tuple target holding a non-tensor leaf, float64, MSE.
    lin = nn.Linear(3, 2).double()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.tanh(self.lin(batch["a"])) * batch["b"]

    def residual(out: torch.Tensor, target: tuple[torch.Tensor, float]) -> torch.Tensor:
        return (out - target[0]) * target[1]

    x = {"a": torch.randn(16, 3, dtype=torch.float64), "b": torch.rand(16, 2).double()}
    y = (torch.randn(16, 2, dtype=torch.float64), 0.5)
    return Net(), residual, x, y


def _run(kind: str, options: dict[str, Any], old: bool, monkeypatch: Any) -> list[Any]:
    model, residual, x, y = _problem(kind)
    with monkeypatch.context() as patch:
        if old:
            patch.setattr(ModelProblem, "slices", _old_slices)
        opt = so.LevenbergMarquardt(model, residual, **options)
        if old:
            opt._function.group._local = False  # the pipelined path of several devices
        out: list[Any] = []
        for _ in range(STEPS):
            info = opt.step(x, y)
            out.append((info.loss, info.accepted, info.damping, info.attempts))
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("kind", ["mlp-ce", "cnn-ce", "tree-mse"])
@pytest.mark.parametrize(
    "options",
    [{}, {"form": "primal"}, {"form": "dual"}, {"solver": "qr"}, {"geodesic": True}],
    ids=["auto", "primal", "dual", "qr", "geodesic"],
)
def test_one_slice_steps_equal_the_sliced_pipeline_bitwise(
    kind: str, options: dict[str, Any], monkeypatch: Any
) -> None:
    new = _run(kind, options, old=False, monkeypatch=monkeypatch)
    ref = _run(kind, options, old=True, monkeypatch=monkeypatch)
    assert new[:-1] == ref[:-1]
    for a, b in zip(new[-1], ref[-1], strict=True):
        assert torch.equal(a, b)
    # The run moved the parameters: the comparison is not between two idle models.
    model, *_ = _problem(kind)
    assert any(not torch.equal(a, p) for a, p in zip(new[-1], model.parameters(), strict=True))


def test_the_one_slice_shortcut_hands_over_the_batch_itself() -> None:
    model, residual, x, y = _problem("mlp-ce")
    opt = so.LevenbergMarquardt(model, residual)
    opt.step(x, y)
    prob = opt.internals().problem
    assert prob is not None
    (got,) = list(prob.slices())
    assert got[0] is x and got[1] is y
    # Several slices are still views of the batch, in order.
    opt.step(x, y, slice_size=10)
    prob = opt.internals().problem
    assert prob is not None
    parts = list(prob.slices())
    assert [len(p[0]) for p in parts] == [10, 10, 10, 2]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_unflatten_and_write_match_split_and_view_as() -> None:
    model, residual, _, _ = _problem("cnn-ce")
    opt = so.LevenbergMarquardt(model, residual)
    fn = opt._function
    flat = torch.randn(fn.n)
    views = fn.unflatten(flat)
    for (name, p), chunk in zip(
        model.named_parameters(), torch.split(flat, fn.numels), strict=True
    ):
        assert views[name].shape == p.shape
        assert torch.equal(views[name], chunk.view_as(p))
        assert views[name].data_ptr() == chunk.data_ptr()  # a view, not a copy
    fn.write(flat)
    for p, chunk in zip(model.parameters(), torch.split(flat, fn.numels), strict=True):
        assert torch.equal(p.detach(), chunk.view_as(p))
