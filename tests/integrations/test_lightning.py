"""Training a LightningModule with LM takes exactly the steps of the optimizer used directly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import secondorder as so
from secondorder.integrations.lightning import LevenbergMarquardtMixin, lm_training_step

L = pytest.importorskip("lightning")

pytestmark = [
    # Lightning's advice for real data loaders; these tests use in-memory tensors.
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    # Lightning itself still builds torch's deprecated pytree LeafSpec.
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


def make_data(points=64, seed=0):
    torch.manual_seed(seed)
    x = torch.linspace(-1, 1, points).unsqueeze(1)
    return x, torch.sinc(3 * x)


def make_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


class Regressor(LevenbergMarquardtMixin, L.LightningModule):
    def __init__(self, net, **lm_options):
        super().__init__()
        self.net = net
        self.lm_options = lm_options

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        return so.LevenbergMarquardt(self.net, so.residuals.mse, **self.lm_options)


def trainer(**kwargs):
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return L.Trainer(**options)


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def test_lightning_steps_equal_direct_lm_steps():
    x, y = make_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    net = make_net()
    direct_net = copy.deepcopy(net)
    module = Regressor(net)
    trainer(max_epochs=2).fit(module, loader)

    opt = so.LevenbergMarquardt(direct_net, so.residuals.mse)
    infos = [opt.step(xb, yb) for _ in range(2) for xb, yb in loader]
    assert module.trainer.global_step == len(infos) == 8
    assert torch.equal(flat(module.net), flat(direct_net))
    assert not torch.equal(flat(module.net), flat(make_net()))  # training moved them
    logged = module.trainer.callback_metrics
    assert float(logged["loss"]) == pytest.approx(infos[-1].loss, rel=1e-6)
    assert float(logged["damping"]) == pytest.approx(infos[-1].damping, rel=1e-6)


def test_trainer_stops_when_the_optimizer_terminates():
    # A linear model on exactly linear data: LM solves it, a convergence test fires.
    torch.manual_seed(0)
    x = torch.randn(32, 2, dtype=torch.float64)
    y = x @ torch.tensor([[2.0], [-1.0]], dtype=torch.float64) + 0.5
    module = Regressor(nn.Linear(2, 1).double())
    run = trainer(max_epochs=100)
    run.fit(module, DataLoader(TensorDataset(x, y), batch_size=32))
    assert 1 < run.global_step < 100
    torch.testing.assert_close(module.net.weight, torch.tensor([[2.0, -1.0]], dtype=torch.float64))


def test_max_steps_counts_lm_steps():
    x, y = make_data()
    module = Regressor(make_net())
    run = trainer(max_steps=3)
    run.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    assert run.global_step == 3


class Custom(L.LightningModule):
    """A module with its own training_step that calls lm_training_step."""

    def __init__(self, optimizers=None):
        super().__init__()
        self.automatic_optimization = False
        self.net = make_net()
        self.make_optimizers = optimizers
        self.infos = []

    def training_step(self, batch, batch_idx):
        self.infos.append(lm_training_step(self, batch, prefix="train/", log=True))

    def configure_optimizers(self):
        if self.make_optimizers is not None:
            return self.make_optimizers(self.net)
        return so.LevenbergMarquardt(self.net)


def test_own_training_step_and_prefix():
    x, y = make_data()
    module = Custom()
    run = trainer(max_steps=2)
    run.fit(module, DataLoader(TensorDataset(x, y), batch_size=64))
    assert len(module.infos) == 2 and all(isinstance(i, so.StepInfo) for i in module.infos)
    assert float(run.callback_metrics["train/loss"]) == pytest.approx(module.infos[-1].loss)
    assert float(run.callback_metrics["train/attempts"]) == module.infos[-1].attempts


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"optimizers": lambda net: torch.optim.Adam(net.parameters())},
            TypeError,
            "configure_optimizers must return a secondorder.LevenbergMarquardt, got Adam",
        ),
        (
            {"optimizers": lambda net: [so.LevenbergMarquardt(net), so.LevenbergMarquardt(net)]},
            ValueError,
            "must return exactly one secondorder.LevenbergMarquardt, got 2 optimizers",
        ),
    ],
)
def test_misconfigured_modules_are_named(kwargs, error, match):
    x, y = make_data()
    module = Custom(**kwargs)
    before = flat(module.net)
    with pytest.raises(error, match=match):
        trainer(max_steps=1).fit(module, DataLoader(TensorDataset(x, y), batch_size=64))
    assert torch.equal(flat(module.net), before)


def test_mixin_refuses_automatic_optimization():
    module = Regressor(make_net())
    assert module.automatic_optimization is False
    with pytest.raises(ValueError, match="automatic_optimization cannot be set to True"):
        module.automatic_optimization = True


def test_not_a_lightning_module_is_named():
    with pytest.raises(TypeError, match="module must be a LightningModule"):
        lm_training_step(nn.Linear(1, 1), (torch.zeros(1, 1), torch.zeros(1, 1)))
