"""The cuPyLMA drop-in: same calls, and the fixes it promises."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.cli import sinc_data, sinc_model
from secondorder.compat.cupylma import LMA, get_available_gpus


def test_get_available_gpus_on_this_machine():
    gpus = get_available_gpus()
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_shim_converges_on_sinc_in_slices():
    x, y = sinc_data(1_000)
    model = sinc_model(hidden=32, seed=0)
    lma = LMA(model, get_available_gpus()[:1], so.residuals.mse)
    losses = []
    for _ in range(250):
        loss, terminated = lma.step(x, y, slice_size=250)
        losses.append(loss)
        if terminated:
            break
    with torch.no_grad():
        mse = float(nn.functional.mse_loss(model(x), y))
    assert losses[-1] == pytest.approx(mse, rel=1e-4)
    assert mse < 1e-5
    assert all(b <= a for a, b in itertools.pairwise(losses))


def test_shim_equals_the_optimizer_with_the_multiplicative_rule():
    x, y = sinc_data(300, dtype=torch.float64)
    model = sinc_model(hidden=6, seed=1, dtype=torch.float64)
    twin = copy.deepcopy(model)
    lma = LMA(model, [], learning_rate=0.7, damping_start=1e-2, damping_up=5.0, damping_down=0.2)
    opt = so.LevenbergMarquardt(
        twin,
        lr=0.7,
        damping=1e-2,
        damping_rule="multiplicative",
        damping_up=5.0,
        damping_down=0.2,
        damping_matrix="marquardt",
    )
    for _ in range(5):
        loss, _ = lma.step(x, y, slice_size=100)
        info = opt.step(x, y)
        assert loss == pytest.approx(info.loss, rel=1e-10)
        assert lma.damping == pytest.approx(opt.damping, rel=1e-12)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_learning_rate_is_applied():
    """cuPyLMA ignores learning_rate; the shim scales the step by it."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 4, generator=g, dtype=torch.float64)
    y = torch.randn(30, 1, generator=g, dtype=torch.float64)
    steps = {}
    for lr in (1.0, 0.25):
        model = nn.Linear(4, 1, bias=False).double()
        with torch.no_grad():
            model.weight.zero_()
        LMA(model, [], learning_rate=lr, damping_start=1e-6).step(X, y)
        steps[lr] = model.weight.detach().clone()
    torch.testing.assert_close(steps[0.25], 0.25 * steps[1.0], rtol=1e-10, atol=0)


def test_zero_jacobian_column_does_not_stall():
    """cuPyLMA's JᵀJ + λ·diag(JᵀJ) is singular for every λ with a dead unit; ours is not."""
    x, y = sinc_data(200, dtype=torch.float64)
    model = sinc_model(hidden=8, seed=0, dtype=torch.float64)
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0  # hidden unit 0 feeds nothing...
        model[0].weight[0, 0] = 0.0  # ...and receives nothing: its columns are zero
        model[0].bias[0] = 0.0
    lma = LMA(model, [])
    first, _ = lma.step(x, y)
    for _ in range(20):
        loss, terminated = lma.step(x, y)
        assert not terminated
    assert loss < 0.5 * first


def test_several_devices_equal_none():
    """cuPyLMA's devices list: slices dispatched in turn, the same fit as one device."""
    x, y = sinc_data(300, dtype=torch.float64)
    model = sinc_model(hidden=6, seed=1, dtype=torch.float64)
    twin = copy.deepcopy(model)
    lma = LMA(model, ["cpu", "cpu"], learning_rate=0.7)
    ref = LMA(twin, [], learning_rate=0.7)
    assert lma.devices == [torch.device("cpu")] * 2
    assert lma.optimizer.devices == (torch.device("cpu"),) * 2
    assert lma.optimizer.replicas[0] is model
    for _ in range(5):
        loss, terminated = lma.step(x, y, slice_size=70)  # 5 slices, the last of 20
        ref_loss, ref_terminated = ref.step(x, y, slice_size=70)
        # The per-device Grams are added in another order than one device adds them.
        assert loss == pytest.approx(ref_loss, rel=1e-9)
        assert terminated == ref_terminated
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    replica = lma.optimizer.replicas[1]
    for a, b in zip(model.parameters(), replica.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_devices_are_refused_before_the_model_moves():
    model = sinc_model(hidden=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"Invalid devices\[1\]='gpu'"):
        LMA(model, ["cpu", "gpu"])
    with pytest.raises(TypeError, match=r"devices must be a list of devices .* got str: 'cpu'"):
        LMA(model, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_cupylma_solver_and_dtype_arguments_are_accepted():
    """cuPyLMA's own call passes a NumPy solve function and a NumPy dtype."""
    np = pytest.importorskip("numpy")
    x, y = sinc_data(200)
    model = sinc_model(hidden=8, seed=2)
    twin = copy.deepcopy(model)
    lma = LMA(model, [], so.residuals.mse, solver=np.linalg.solve, dtype=np.float32)
    assert lma.optimizer.config.gram_dtype == torch.float32
    opt = so.LevenbergMarquardt(
        twin, damping_rule="multiplicative", damping_matrix="marquardt", gram_dtype=torch.float32
    )
    for _ in range(3):
        loss, _ = lma.step(x, y)
        assert loss == opt.step(x, y).loss
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert LMA(sinc_model(hidden=2), [], solver="qr").optimizer.config.solver == "qr"
    with pytest.raises(ValueError, match="dtype must be float32 or float64, got 'int32'"):
        LMA(sinc_model(hidden=2), [], dtype="int32")
    with pytest.raises(TypeError, match="solver must be a solver name or a callable, got 3"):
        LMA(sinc_model(hidden=2), [], solver=3)
