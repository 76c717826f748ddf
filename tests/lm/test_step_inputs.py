"""What step() accepts: DataLoader pairs, grad modes, and clear refusals of the rest.

References: ``step(x, y)`` itself (a pair, a step under no_grad or inference_mode must
give the same bits), and the optimizer's state before a refused call.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import secondorder as so
from secondorder.lm.records import SmallBatchWarning

F64 = torch.float64


def problem(seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 2, generator=g, dtype=F64)
    return model, x, torch.sin(x.sum(1, keepdim=True))


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run(call: Any, steps: int = 3) -> tuple[Tensor, list[float], float]:
    """Parameters, losses and λ after ``steps`` calls of ``call(opt, x, y)``."""
    model, x, y = problem()
    opt = so.LevenbergMarquardt(model)
    losses = [call(opt, x, y).loss for _ in range(steps)]
    return flat(model), losses, opt.damping


REFERENCE = lambda opt, x, y: opt.step(x, y)  # noqa: E731


@pytest.mark.parametrize(
    "call",
    [
        lambda opt, x, y: opt.step([x, y]),
        lambda opt, x, y: opt.step((x, y)),
        lambda opt, x, y: opt.step(next(iter(DataLoader(TensorDataset(x, y), batch_size=64)))),
    ],
    ids=["list", "tuple", "dataloader-batch"],
)
def test_an_inputs_targets_pair_steps_as_two_arguments(call: Any) -> None:
    ref, got = run(REFERENCE), run(call)
    assert torch.equal(ref[0], got[0]) and ref[1:] == got[1:]


def test_a_pair_with_explicit_none_targets_stays_the_inputs() -> None:
    """A model whose one input is a pair, with a residual that needs no targets."""

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 1).double()

        def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
            x1, x2 = pair
            out: Tensor = self.a(x1) - x2
            return out

    x1 = torch.randn(20, 2, dtype=F64)
    x2 = x1 @ torch.tensor([[0.5], [-1.0]], dtype=F64) + 0.25
    model = TwoInputs()
    opt = so.LevenbergMarquardt(model, lambda out, _: out, damping=1e-10)
    opt.step((x1, x2), None)
    torch.testing.assert_close(model.a.weight, torch.tensor([[0.5, -1.0]], dtype=F64))
    torch.testing.assert_close(model.a.bias, torch.tensor([0.25], dtype=F64))


def test_a_nested_pair_of_two_inputs_and_targets() -> None:
    class Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 1).double(), nn.Linear(2, 1).double()

        def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
            out: Tensor = self.a(xs[0]) + self.b(xs[1])
            return out

    torch.manual_seed(0)
    x1, x2 = torch.randn(16, 2, dtype=F64), torch.randn(16, 2, dtype=F64)
    y = x1[:, :1] - x2[:, 1:]
    results = []
    for call in (lambda o: o.step((x1, x2), y), lambda o: o.step(((x1, x2), y))):
        torch.manual_seed(1)
        model = Sum()
        call(so.LevenbergMarquardt(model))
        results.append(flat(model))
    assert torch.equal(results[0], results[1])


def in_no_grad(opt: so.LevenbergMarquardt, x: Tensor, y: Tensor) -> Any:
    with torch.no_grad():
        return opt.step(x, y)


def in_inference_mode(opt: so.LevenbergMarquardt, x: Tensor, y: Tensor) -> Any:
    with torch.inference_mode():
        return opt.step(x, y)


def inference_tensors(opt: so.LevenbergMarquardt, x: Tensor, y: Tensor) -> Any:
    """Inputs made under inference_mode (autograd cannot save them for backward)."""
    with torch.inference_mode():
        xi, yi = x.clone(), y.clone()
        assert xi.is_inference()
        return opt.step(xi, yi)


@pytest.mark.parametrize("call", [in_no_grad, in_inference_mode, inference_tensors])
def test_step_under_no_grad_or_inference_mode_equals_a_normal_step(call: Any) -> None:
    ref, got = run(REFERENCE), run(call)
    assert torch.equal(ref[0], got[0]) and ref[1:] == got[1:]
    assert torch.is_grad_enabled()


def refused_state(opt: so.LevenbergMarquardt) -> tuple[Any, ...]:
    return (flat(opt.model), opt.damping, opt.state_dict()["state"][0]["steps"])


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        (
            lambda x, y: (DataLoader(TensorDataset(x, y), batch_size=8),),
            TypeError,
            r"step\(\) takes one batch, got a DataLoader: loop over the loader yourself, "
            r"for x, y in loader: info = opt.step\(x, y\)",
        ),
        (
            lambda x, y: ((b for b in [(x, y)]),),
            TypeError,
            r"step\(\) takes one batch, got a generator",
        ),
        (
            lambda x, y: (lambda: 0.0,),
            TypeError,
            r"step\(\) takes the batch, step\(inputs, targets\), not a function: .* cannot "
            r"use a closure that returns a loss; .* \(info.loss\)",
        ),
        (
            lambda x, y: (np.random.default_rng(0).normal(size=(1000, 2)), y),
            TypeError,
            r"^inputs must be torch tensors, got a numpy.ndarray of shape \(1000, 2\), dtype "
            r"float64; convert it with torch.as_tensor\(inputs, dtype=torch.float64\)",
        ),
        (
            lambda x, y: (x, y.numpy().astype(np.float32)),
            TypeError,
            r"^targets must be torch tensors, got a numpy.ndarray of shape \(64, 1\), dtype "
            r"float32; convert it with torch.as_tensor\(targets, dtype=torch.float32\)",
        ),
        (
            lambda x, y: ([1.0, 2.0, 3.0], y),
            TypeError,
            r"inputs must be a tensor or a tuple/list/dict of tensors, got list of 3 \(float",
        ),
    ],
    ids=["loader", "generator", "closure", "numpy-inputs", "numpy-targets", "floats"],
)
def test_refused_inputs_say_what_to_do_in_a_short_message(
    args: Any, error: type[Exception], pattern: str
) -> None:
    model, x, y = problem()
    opt = so.LevenbergMarquardt(model)
    opt.step(x, y)
    before = refused_state(opt)
    with pytest.raises(error, match=pattern) as info:
        opt.step(*args(x, y))
    assert len(str(info.value)) < 400  # never the array's values
    after = refused_state(opt)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


@pytest.mark.parametrize("lr", [float("inf"), "0.1", 0.0, float("nan")])
def test_a_bad_lr_in_param_groups_is_refused_before_the_step(lr: Any) -> None:
    model, x, y = problem()
    opt = so.LevenbergMarquardt(model)
    opt.param_groups[0]["lr"] = lr
    before = flat(model)
    with pytest.raises(ValueError, match=r"Invalid lr=.* in param_groups\[0\]: must be a finite"):
        opt.step(x, y)
    assert torch.equal(flat(model), before)


@pytest.mark.parametrize("options", [{"form": "primal"}, {"solver": "cg"}])
def test_small_primal_mini_batches_warn_once_with_what_to_do(options: dict[str, Any]) -> None:
    model, x, y = problem()  # 25 parameters
    opt = so.LevenbergMarquardt(model, **options)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    message = (
        r"mini-batches of 16 residuals for 25 parameters in the primal form: JᵀJ has rank "
        r"at most 16 < 25.*batches of at least 25 residuals.*form='dual' \(or 'auto'\)"
        r".*first-order optimizer"
    )
    with pytest.warns(SmallBatchWarning, match=message) as record:
        for _ in range(2):
            for xb, yb in loader:
                opt.step(xb, yb)
    assert len(record) == 1 and issubclass(SmallBatchWarning, UserWarning)


def test_no_small_batch_warning_for_one_batch_large_batches_or_the_dual_form() -> None:
    model, x, y = problem()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = so.LevenbergMarquardt(model, form="primal")
        for _ in range(3):
            opt.step(x[:10], y[:10])  # a fit of one small batch is not mini-batch training
        small = x[:10]
        for _ in range(2):
            opt.step(small, y[:10])
        big = so.LevenbergMarquardt(problem()[0], form="primal")
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=32):
            big.step(xb, yb)  # 32 residuals >= 25 parameters
        dual = so.LevenbergMarquardt(problem()[0])
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=16):
            dual.step(xb, yb)  # form="auto" solves these in the dual form


def test_constructor_messages_describe_arrays_without_their_values() -> None:
    big = np.zeros((500, 40))
    with pytest.raises(
        TypeError,
        match=r"^model must be a torch.nn.Module, got numpy.ndarray "
        r"of shape \(500, 40\), dtype float64$",
    ):
        so.LevenbergMarquardt(big)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"^residual_fn must be callable, got numpy.ndarray of "
        r"shape \(500, 40\), dtype float64$",
    ):
        so.LevenbergMarquardt(nn.Linear(2, 1).double(), big)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "returns",
    [
        lambda r: (r, r),
        lambda r: [r],
        lambda r: {"interior": r},
        lambda r: r.detach().numpy(),
    ],
    ids=["tuple", "list", "dict", "numpy"],
)
def test_a_model_residual_that_returns_no_tensor_is_refused_and_changes_nothing(
    returns: Any,
) -> None:
    # Before: a raw "AttributeError: 'tuple' object has no attribute 'reshape'" from
    # inside the optimizer.
    model, x, y = problem()

    def fn(f: Any, inputs: Tensor, targets: Tensor) -> Any:
        return returns((f(inputs) - targets).reshape(-1))

    opt = so.LevenbergMarquardt(model, so.ModelResidual(fn))
    before, state = flat(model), opt.state_dict()
    kind = type(returns(torch.zeros(1, dtype=F64))).__name__
    with pytest.raises(TypeError, match=rf"ModelResidual's fn must return a tensor.*got {kind}"):
        opt.step(x, y)
    assert torch.equal(flat(model), before)
    after = opt.state_dict()
    assert after["state"].keys() == state["state"].keys()
    for key, value in state["state"][0].items():
        got = after["state"][0][key]
        assert torch.equal(got, value) if isinstance(value, Tensor) else got == value
