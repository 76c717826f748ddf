"""The cuPyLMA drop-in: same calls, and the fixes it promises."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import secondorder as so
from secondorder.cli import sinc_data, sinc_model
from secondorder.compat.cupylma import LMA, Configuration, configuration, get_available_gpus


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


# -- cuPyLMA's two argument orders and its configuration ------------------------------------


def reference(model: nn.Module, **options: object) -> so.LevenbergMarquardt:
    """LevenbergMarquardt with cuPyLMA's rule, matrix and configuration defaults."""
    settings = {
        "damping_rule": "multiplicative",
        "damping_matrix": "marquardt",
        "damping_max": 1e10,
        "damping_min": 1e-10,
        "max_attempts": 10,
        **options,
    }
    return so.LevenbergMarquardt(model, **settings)  # type: ignore[arg-type]


def test_cupylma_02_positional_order_equals_the_optimizer():
    """LMA(model, devices, residual_fn, solver, learning_rate, damping_start, up, down, dtype)."""
    np = pytest.importorskip("numpy")
    x, y = sinc_data(200, dtype=torch.float64)
    model = sinc_model(hidden=6, seed=3, dtype=torch.float64)
    twin = copy.deepcopy(model)
    lma = LMA(model, [], so.residuals.mse, np.linalg.solve, 0.7, 1e-2, 5.0, 0.2, np.float64)
    opt = reference(
        twin, lr=0.7, damping=1e-2, damping_up=5.0, damping_down=0.2, gram_dtype=torch.float64
    )
    assert lma.loss_fn is None
    for _ in range(4):
        loss, terminated = lma.step(x, y)
        info = opt.step(x, y)
        assert (loss, terminated, lma.damping) == (info.loss, info.terminated, opt.damping)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_cupylma_01_order_with_loss_fn_reports_that_loss():
    """0.1.x: LMA(model, devices, loss_fn, residual_fn, solver, learning_rate, ...)."""
    np = pytest.importorskip("numpy")
    x, y = sinc_data(300, dtype=torch.float64)
    model = sinc_model(hidden=6, seed=1, dtype=torch.float64)
    twin = copy.deepcopy(model)
    l1 = nn.L1Loss()
    old = LMA(model, [], l1, so.residuals.mse, np.linalg.solve, 0.7)
    new = LMA(twin, [], so.residuals.mse, np.linalg.solve, 0.7)
    assert old.loss_fn is l1 and new.loss_fn is None
    for _ in range(3):
        loss, _ = old.step(x, y, slice_size=70)  # 5 slices, the last of 20
        new_loss, _ = new.step(x, y, slice_size=70)
        with torch.no_grad():
            assert loss == pytest.approx(float(l1(model(x), y)), rel=1e-12)
            assert new_loss == pytest.approx(float(nn.functional.mse_loss(twin(x), y)), rel=1e-9)
    # The loss function only reports: both orders take the same steps.
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    by_keyword = LMA(sinc_model(hidden=2), [], residual_fn=so.residuals.mse, loss_fn=l1)
    assert by_keyword.loss_fn is l1


def test_cupylma_argument_errors_name_the_argument():
    model = sinc_model(hidden=2)
    with pytest.raises(TypeError, match=r"LMA takes at most 9 positional arguments .* got 10"):
        LMA(model, [], so.residuals.mse, "cholesky", 1.0, 1e-3, 10.0, 0.1, None, 7)
    with pytest.raises(TypeError, match=r"LMA got multiple values for argument 'learning_rate'"):
        LMA(model, [], so.residuals.mse, "cholesky", 1.0, learning_rate=0.5)
    with pytest.raises(TypeError, match=r"loss_fn must be callable, got int"):
        LMA(model, [], loss_fn=3)


@pytest.fixture
def restore_configuration():
    saved = {name: getattr(configuration, name) for name in Configuration.__slots__}
    yield configuration
    for name, value in saved.items():
        setattr(configuration, name, value)


def test_configuration_has_cupylmas_defaults_and_is_read_at_construction(restore_configuration):
    cfg = restore_configuration
    assert (cfg.DAMPING_MAX, cfg.DAMPING_MIN, cfg.UPDATE_ATTEMPTS) == (1e10, 1e-10, 10)
    assert (cfg.FORCED_JACOBIAN_MODE, cfg.JACOBIAN_MODE) == (False, "forward")
    config = LMA(sinc_model(hidden=2), []).optimizer.config
    assert (config.damping_max, config.damping_min, config.max_attempts) == (1e10, 1e-10, 10)
    assert config.jacobian == "auto"
    cfg.DAMPING_MAX, cfg.DAMPING_MIN, cfg.UPDATE_ATTEMPTS = 1e4, 1e-6, 3
    cfg.FORCED_JACOBIAN_MODE, cfg.JACOBIAN_MODE = True, "reverse"
    config = LMA(sinc_model(hidden=2), []).optimizer.config
    assert (config.damping_max, config.damping_min, config.max_attempts) == (1e4, 1e-6, 3)
    assert config.jacobian == "batch_reverse"
    # An explicit option wins over the configuration.
    assert LMA(sinc_model(hidden=2), [], max_attempts=5).optimizer.config.max_attempts == 5
    cfg.JACOBIAN_MODE = "sideways"
    with pytest.raises(ValueError, match=r"Unknown configuration.JACOBIAN_MODE='sideways'"):
        LMA(sinc_model(hidden=2), [])
    with pytest.raises(AttributeError, match="DAMPING_MAXX"):
        cfg.DAMPING_MAXX = 1.0  # type: ignore[attr-defined]
