"""torch loss modules as residual_fn: each maps onto the adapter of the same loss.

References: the torch loss itself.  For every mapped loss and both reductions,
``c·‖r‖²`` equals the loss's value (``c`` the constant torch divides by, times ½ for
Huber and smooth L1) and its gradient with respect to the model's outputs equals
torch's; an optimizer given the module steps bitwise as one given the adapter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.residuals import LossResidual, from_torch_loss

F64 = torch.float64


def data(kind: str) -> tuple[Tensor, Tensor]:
    """(outputs, targets) for a loss kind: regression, classes, binary or probabilities."""
    g = torch.Generator().manual_seed(3)
    if kind == "regression":
        out = 2.0 * torch.randn(6, 3, generator=g, dtype=F64)
        return out, torch.randn(6, 3, generator=g, dtype=F64)
    if kind == "classes":
        logits = torch.randn(7, 4, generator=g, dtype=F64)
        return logits, torch.tensor([0, 3, 1, 1, 2, 0, 3])
    if kind == "soft":
        logits = torch.randn(5, 4, generator=g, dtype=F64)
        return logits, torch.softmax(torch.randn(5, 4, generator=g, dtype=F64), 1)
    if kind == "binary":
        logits = torch.randn(6, 2, generator=g, dtype=F64)
        return logits, torch.rand(6, 2, generator=g, dtype=F64)
    assert kind == "probs"
    probs = torch.rand(6, 2, generator=g, dtype=F64) * 0.9 + 0.05
    return probs, torch.rand(6, 2, generator=g, dtype=F64)


def divisor(loss: nn.Module, out: Tensor, target: Tensor) -> float:
    """What torch divides the summed loss by for reduction='mean'."""
    if isinstance(loss, nn.CrossEntropyLoss) and not target.is_floating_point():
        keep = target != loss.ignore_index
        w = torch.ones(out.shape[1], dtype=F64) if loss.weight is None else loss.weight
        return float(w[target[keep]].sum())
    if isinstance(loss, nn.CrossEntropyLoss):
        return float(out.shape[0])
    return float(out.numel())


WEIGHT = torch.tensor([1.0, 0.5, 2.0, 1.5], dtype=F64)
CASES: list[tuple[Callable[[str], nn.Module], str, float, float]] = [
    # (loss factory given the reduction, data kind, ½-factor, relative tolerance)
    (lambda r: nn.MSELoss(reduction=r), "regression", 1.0, 1e-14),
    (lambda r: nn.L1Loss(reduction=r), "regression", 1.0, 1e-5),  # l1's eps=1e-6 smoothing
    (lambda r: nn.HuberLoss(reduction=r), "regression", 0.5, 1e-14),
    (lambda r: nn.HuberLoss(reduction=r, delta=2.5), "regression", 0.5, 1e-14),
    (lambda r: nn.SmoothL1Loss(reduction=r), "regression", 0.5, 1e-14),
    (lambda r: nn.SmoothL1Loss(reduction=r, beta=0.3), "regression", 0.5, 1e-14),
    (lambda r: nn.SmoothL1Loss(reduction=r, beta=0.0), "regression", 1.0, 1e-5),
    (lambda r: nn.CrossEntropyLoss(reduction=r), "classes", 1.0, 1e-10),
    (lambda r: nn.CrossEntropyLoss(reduction=r, label_smoothing=0.2), "classes", 1.0, 1e-10),
    (lambda r: nn.CrossEntropyLoss(reduction=r, weight=WEIGHT), "classes", 1.0, 1e-10),
    (lambda r: nn.CrossEntropyLoss(reduction=r, ignore_index=3), "classes", 1.0, 1e-10),
    (lambda r: nn.CrossEntropyLoss(reduction=r, weight=WEIGHT), "soft", 1.0, 1e-10),
    (lambda r: nn.BCEWithLogitsLoss(reduction=r), "binary", 1.0, 1e-10),
    (
        lambda r: nn.BCEWithLogitsLoss(reduction=r, pos_weight=torch.tensor([2.0, 0.5], dtype=F64)),
        "binary",
        1.0,
        1e-10,
    ),
    (
        lambda r: nn.BCEWithLogitsLoss(reduction=r, weight=torch.tensor([0.3, 1.2], dtype=F64)),
        "binary",
        1.0,
        1e-10,
    ),
    (lambda r: nn.BCELoss(reduction=r), "probs", 1.0, 1e-10),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("make", "kind", "half", "rtol"), CASES)
def test_residuals_square_to_the_torch_loss_and_its_gradient(
    make: Callable[[str], nn.Module], kind: str, half: float, rtol: float, reduction: str
) -> None:
    loss = make(reduction)
    out, target = data(kind)
    out = out.clone().requires_grad_(True)
    residual_fn = from_torch_loss(loss)
    r = residual_fn(out, target)
    assert r.shape[0] == out.shape[0]
    scale = half / (divisor(loss, out, target) if reduction == "mean" else 1.0)
    ours = scale * r.pow(2).sum()
    theirs = loss(out, target)
    # Each CE/BCE residual carries eps=1e-12 inside its root.
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=1e-10)
    (g_ours,) = torch.autograd.grad(ours, out)
    (g_theirs,) = torch.autograd.grad(theirs, out)
    torch.testing.assert_close(g_ours, g_theirs, rtol=max(rtol, 1e-9), atol=1e-12)


@pytest.mark.parametrize(
    ("loss", "adapter"),
    [
        (nn.MSELoss(), so.residuals.mse),
        (
            nn.HuberLoss(delta=0.5, reduction="sum"),
            functools.partial(so.residuals.huber, delta=0.5),
        ),
        (nn.L1Loss(), so.residuals.l1),
    ],
)
def test_an_optimizer_given_the_module_steps_as_one_given_the_adapter(
    loss: nn.Module, adapter: Callable[..., Tensor]
) -> None:
    x = torch.linspace(-2, 2, 40, dtype=F64)[:, None]
    y = torch.sin(2 * x)
    models = []
    for residual_fn in (loss, adapter):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1)).double()
        opt = so.LevenbergMarquardt(model, residual_fn)
        losses = [opt.step(x, y).loss for _ in range(4)]
        models.append((model, losses))
    (a, la), (b, lb) = models
    assert la == lb
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_mapped_module_keeps_its_parameters_and_says_what_it_is() -> None:
    residual_fn = from_torch_loss(nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=2))
    assert isinstance(residual_fn, LossResidual)
    assert residual_fn.adapter is so.residuals.cross_entropy
    assert residual_fn.options["label_smoothing"] == 0.1
    assert residual_fn.options["ignore_index"] == 2
    assert repr(residual_fn) == (
        "LossResidual(torch.nn.CrossEntropyLoss(ignore_index=2, label_smoothing=0.1) "
        "-> so.residuals.cross_entropy)"
    )
    opt = so.LevenbergMarquardt(nn.Linear(3, 4).double(), nn.CrossEntropyLoss())
    assert isinstance(opt.residual_fn, LossResidual)


@pytest.mark.parametrize(
    "loss",
    [nn.MSELoss, nn.L1Loss, nn.HuberLoss, nn.SmoothL1Loss, nn.CrossEntropyLoss, nn.BCELoss],
)
def test_reduction_none_is_refused_naming_the_adapter(loss: type[nn.Module]) -> None:
    adapter = from_torch_loss(loss()).adapter.__name__
    message = (
        rf"residual_fn=torch.nn.{loss.__name__}\(reduction='none'\) is refused: .* fourth "
        rf"power .* use reduction='mean' or 'sum' .* residual_fn=so.residuals.{adapter}"
    )
    with pytest.raises(ValueError, match=message):
        so.LevenbergMarquardt(nn.Linear(2, 1).double(), loss(reduction="none"))


@pytest.mark.parametrize(
    ("loss", "pattern"),
    [
        (nn.NLLLoss(), r"NLLLoss\(\) has no residual form .*\(drop the LogSoftmax\)"),
        (nn.KLDivLoss(), r"KLDivLoss\(\) has no residual form .* so.residuals.cross_entropy"),
        (
            nn.PoissonNLLLoss(),
            r"PoissonNLLLoss\(\) has no residual form .*\(it maps BCELoss, "
            r".*torch.sqrt\(per_sample_loss",
        ),
        (nn.MarginRankingLoss(), r"MarginRankingLoss\(\) has no residual form"),
    ],
)
def test_losses_without_a_residual_form_are_refused(loss: nn.Module, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        so.LevenbergMarquardt(nn.Linear(2, 1).double(), loss)


def test_a_torch_loss_subclass_with_its_own_forward_is_refused() -> None:
    class Scaled(nn.MSELoss):
        def forward(self, input: Tensor, target: Tensor) -> Tensor:
            return 3.0 * super().forward(input, target)

    with pytest.raises(TypeError, match=r"residual_fn=.*Scaled\(\) is a torch loss module"):
        so.LevenbergMarquardt(nn.Linear(2, 1).double(), Scaled())


def test_a_users_own_loss_module_returning_residuals_is_used_as_is() -> None:
    class Residual(nn.modules.loss._Loss):
        def forward(self, input: Tensor, target: Tensor) -> Tensor:
            return input - target

    x = torch.randn(10, 2, dtype=F64)
    y = x @ torch.tensor([[1.0], [-2.0]], dtype=F64)
    model = nn.Linear(2, 1, bias=False).double()
    opt = so.LevenbergMarquardt(model, Residual(), damping=1e-9)
    assert isinstance(opt.residual_fn, Residual)
    opt.step(x, y)
    torch.testing.assert_close(model.weight, torch.tensor([[1.0, -2.0]], dtype=F64))


def test_a_residual_fn_that_returns_the_loss_itself_is_refused() -> None:
    opt = so.LevenbergMarquardt(nn.Linear(2, 1).double(), lambda o, t: F.mse_loss(o, t))
    x = torch.randn(5, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"returned a scalar \(a 0-d tensor\) .* not the loss"):
        opt.step(x, torch.zeros(5, 1, dtype=F64))


@pytest.mark.parametrize("delta", [0.0, -1.0])
def test_huber_needs_a_positive_delta(delta: float) -> None:
    out = torch.zeros(3, 1, dtype=F64)
    with pytest.raises(
        ValueError, match=rf"Invalid huber delta={delta}: must be a finite number > 0"
    ):
        so.residuals.huber(out, out, delta=delta)
    opt = so.LevenbergMarquardt(nn.Linear(2, 1).double(), nn.HuberLoss(delta=delta))
    with pytest.raises(ValueError, match=r"Invalid huber delta"):
        opt.step(torch.zeros(3, 2, dtype=F64), out)
    with pytest.raises(
        ValueError, match=r"Invalid smooth_l1 beta=-1.0: must be a finite number >= 0"
    ):
        so.residuals.smooth_l1(out, out, beta=-1.0)


class Pair(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 1).double()

    def forward(self, x: Tensor) -> Any:
        out = self.lin(x)
        return (out, x) if self.kind == "tuple" else {"pred": out, "features": x}


@pytest.mark.parametrize(
    ("kind", "residual_fn", "pattern"),
    [
        (
            "tuple",
            so.residuals.mse,
            r"mse: the model returned a tuple of 2 \(Tensor of shape \(2, 1\), dtype "
            r"torch.float64, Tensor of shape \(2, 3\).*\), not one tensor; .* pass "
            r"residual_fn=lambda out, y: so.residuals.mse\(out\[0\], y\)",
        ),
        (
            "dict",
            nn.HuberLoss(),
            r"huber: the model returned a dict with keys \['pred', 'features'\], not one "
            r"tensor; .* residual_fn=lambda out, y: so.residuals.huber\(out\['pred'\], y\)",
        ),
    ],
)
def test_models_returning_several_outputs_get_a_message_naming_residual_fn(
    kind: str, residual_fn: Any, pattern: str
) -> None:
    model = Pair(kind)
    opt = so.LevenbergMarquardt(model, residual_fn)
    x, y = torch.randn(6, 3, dtype=F64), torch.randn(6, 1, dtype=F64)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=pattern):
        opt.step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    # The fix the message names works.
    pick = (lambda out, t: so.residuals.mse(out[0], t)) if kind == "tuple" else None
    if pick is not None:
        info = so.LevenbergMarquardt(model, pick).step(x, y)
        assert info.accepted
