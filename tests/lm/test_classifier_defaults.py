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
    expected = {"damping_rule": "multiplicative", "damping_matrix": "identity"}
    assert residual_defaults(fn) == expected
    assert LMConfig.for_residual(fn).damping_rule == "multiplicative"
    # Only the rule and the damping matrix change; every other field keeps its default.
    assert LMConfig.for_residual(fn) == LMConfig(**expected)


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
    assert cfg == LMConfig(damping_rule="nielsen", damping_matrix="identity", lr=0.5)
    cfg = LMConfig.for_residual(cross_entropy, damping_matrix="marquardt")
    assert cfg == LMConfig(damping_rule="multiplicative", damping_matrix="marquardt")
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
    new_ce, new = _train({"damping_rule": "multiplicative", "damping_matrix": "marquardt"}, 20)
    old_ce, old = _train({"damping_rule": "nielsen", "damping_matrix": "marquardt"}, 20)
    assert isinstance(new.internals().damping_rule, MultiplicativeRule)
    assert isinstance(old.internals().damping_rule, NielsenRule)
    assert new_ce < 0.1 < 0.2 < old_ce
    # The mechanism: Nielsen's rule holds λ near 80 (Marquardt's scaling); the
    # multiplicative rule brings it down to 0.1-1, where steps are near Gauss-Newton.
    assert new.damping < 10.0 < 30.0 < old.damping


def _minibatch_accuracy(options: dict[str, object]) -> tuple[float, float]:
    """Test accuracy and train cross-entropy of a 64-32-10 MLP after 30 steps on batches
    of 256 digits (float32, seeded; the bench's digits_mlp at half its steps)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    (xtr, ytr), (xte, yte) = (x[:1437], y[:1437]), (x[1437:], y[1437:])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    opt = LevenbergMarquardt(model, cross_entropy, **options)
    for k in range(30):
        i = (k % 5) * 256
        opt.step(xtr[i : i + 256], ytr[i : i + 256])
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
        return acc, float(F.cross_entropy(model(xtr), ytr))


def test_identity_damping_trains_a_minibatch_classifier_marquardts_scaling_does_not() -> None:
    # Measured: the defaults (D = I) reach test accuracy 0.97 and train CE 0.04;
    # Marquardt's per-batch column scaling 0.66 and 1.16 (seeded, float32).
    acc, ce = _minibatch_accuracy({})
    old_acc, old_ce = _minibatch_accuracy({"damping_matrix": "marquardt"})
    assert acc > 0.9 > 0.8 > old_acc
    assert ce < 0.2 < 0.5 < old_ce
