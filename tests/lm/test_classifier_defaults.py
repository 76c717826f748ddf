"""The classifier defaults: cross-entropy adapters get the multiplicative damping rule.

The references: ``LMConfig(**options)`` for every other residual function (so least
squares such as the sinc fit keep exactly their configuration), the damping rule the
optimizer builds from the options, and the old default run side by side on the same
seeded digits classifier.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from secondorder import LevenbergMarquardt
from secondorder.lm.classifier_defaults import (
    CLASSIFIER_DEFAULTS,
    is_classifier_residual,
    residual_defaults,
)
from secondorder.lm.config import LMConfig
from secondorder.lm.damping import MultiplicativeRule, NielsenRule
from secondorder.lm.residuals import (
    ModelResidual,
    binary_cross_entropy,
    cross_entropy,
    from_torch_loss,
    huber,
    l1,
    mse,
)


@pytest.mark.parametrize(
    "fn",
    [
        cross_entropy,
        binary_cross_entropy,
        functools.partial(cross_entropy, eps=1e-10),
        from_torch_loss(torch.nn.CrossEntropyLoss()),
        from_torch_loss(torch.nn.BCEWithLogitsLoss()),
        from_torch_loss(torch.nn.BCELoss(reduction="sum")),
    ],
    ids=["cross_entropy", "binary_cross_entropy", "partial", "CE_loss", "BCE_logits", "BCE"],
)
def test_cross_entropy_adapters_get_the_multiplicative_rule(fn: object) -> None:
    assert is_classifier_residual(fn)
    assert residual_defaults(fn) == {"damping_rule": "multiplicative"}
    assert LMConfig.for_residual(fn).damping_rule == "multiplicative"
    # Only the rule changes; every other field keeps the plain default.
    assert LMConfig.for_residual(fn) == LMConfig(damping_rule="multiplicative")


def _own_residual(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return outputs - targets


@pytest.mark.parametrize(
    "fn",
    [
        mse,
        huber,
        l1,
        _own_residual,
        ModelResidual(lambda m, x, y: m(x) - y),
        from_torch_loss(torch.nn.MSELoss()),
    ],
    ids=["mse", "huber", "l1", "own", "model_residual", "MSE_loss"],
)
def test_other_residuals_keep_the_plain_configuration(fn: object) -> None:
    assert not is_classifier_residual(fn)
    assert residual_defaults(fn) == {}
    options = {"lr": 0.5, "damping": 1e-2, "max_attempts": 7}
    assert LMConfig.for_residual(fn, **options) == LMConfig(**options)
    assert LMConfig.for_residual(fn).damping_rule == LMConfig().damping_rule == "nielsen"


def test_options_given_win_over_the_classifier_defaults() -> None:
    cfg = LMConfig.for_residual(cross_entropy, damping_rule="nielsen", lr=0.5)
    assert cfg == LMConfig(damping_rule="nielsen", lr=0.5)
    # The dict handed out is a copy: changing it cannot change the defaults.
    residual_defaults(cross_entropy)["damping_rule"] = "nielsen"
    assert CLASSIFIER_DEFAULTS["damping_rule"] == "multiplicative"


def test_for_residual_validates_as_the_constructor_does() -> None:
    with pytest.raises(ValueError, match=r"damping_rule='bogus'"):
        LMConfig.for_residual(cross_entropy, damping_rule="bogus")
    with pytest.raises(TypeError, match="unexpected keyword argument 'dampnig'"):
        LMConfig.for_residual(cross_entropy, dampnig=1.0)


def _digits(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data[:n], dtype=torch.float64) / 16.0
    return x, torch.tensor(data.target[:n])


def _train(options: dict[str, object], steps: int) -> tuple[float, LevenbergMarquardt]:
    x, y = _digits(500)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 10), nn.Tanh(), nn.Linear(10, 10)).double()
    opt = LevenbergMarquardt(model, cross_entropy, **options)
    for _ in range(steps):
        if opt.step(x, y).terminated:
            break
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y)), opt


def test_classifier_defaults_train_a_digits_classifier_the_old_default_does_not() -> None:
    # 500 digits, a 64-10-10 MLP (760 parameters), 20 full-batch steps, float64, seeded.
    # Measured: the classifier defaults reach 0.034, Nielsen's rule 0.33 (λ held
    # near 80 by gain ratios around 0.5, see secondorder.lm.classifier_defaults).
    new_ce, new = _train(residual_defaults(cross_entropy), 20)
    old_ce, old = _train({"damping_rule": "nielsen"}, 20)
    assert isinstance(new.internals().damping_rule, MultiplicativeRule)
    assert isinstance(old.internals().damping_rule, NielsenRule)
    assert new_ce < 0.1 < 0.2 < old_ce
    # The mechanism: Nielsen's rule holds λ near 80 (Marquardt's scaling); the
    # multiplicative rule brings it down to 0.1-1, where steps are near Gauss-Newton.
    assert new.damping < 10.0 < 30.0 < old.damping
