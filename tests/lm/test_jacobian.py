"""Jacobian strategies and residual adapters against independent references.

Every strategy's ``(J, r)`` is compared with :func:`torch.func.jacrev` of the whole
flattened residual vector, built here with :func:`torch.func.functional_call` rather
than with the package's own evaluation code, and with central finite differences.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev, vmap

import secondorder as so
from secondorder.distributed import LocalReducer
from secondorder.lm import jacobian
from secondorder.lm.jacobian import make_jacobian
from secondorder.lm.model import ModelFunction

DT = torch.float64
STRATEGIES = ("reverse", "forward", "batch_reverse", "batch_forward")


# -- helpers -------------------------------------------------------------------------------


def named_trainable(model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    return [k for k, _ in named], [p for _, p in named]


def flat_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])


def unflatten(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    out, start = {}, 0
    for name, p in model.named_parameters():
        out[name] = x[start : start + p.numel()].view(p.shape)
        start += p.numel()
    assert start == x.numel()
    return out


def reference_residuals(
    model: nn.Module, residual_fn: Callable[..., Tensor], inputs: Tensor, targets: Tensor
) -> Callable[[Tensor], Tensor]:
    """``x ↦ residual_fn(model(inputs), targets).reshape(-1)`` via functional_call."""

    def f(x: Tensor) -> Tensor:
        out = functional_call(model, unflatten(model, x), (inputs,))
        return residual_fn(out, targets).reshape(-1)

    return f


def central_differences(f: Callable[[Tensor], Tensor], x: Tensor, h: float = 1e-6) -> Tensor:
    """``(f(x + h·eᵢ) - f(x - h·eᵢ)) / 2h`` for every i, evaluated as one vmapped batch."""
    steps = h * torch.eye(x.numel(), dtype=x.dtype)
    with torch.no_grad():
        plus = vmap(f)(x + steps)
        minus = vmap(f)(x - steps)
    return ((plus - minus) / (2 * h)).T


def make_problem(model: nn.Module, residual_fn) -> ModelFunction:
    names, params = named_trainable(model)
    return ModelFunction(model, residual_fn, names, params, LocalReducer())


def mlp(n_in: int, n_out: int, hidden: int = 6) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out)).to(DT)


def conv_model(n_out: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, kernel_size=3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(2 * 4 * 4, n_out),
    ).to(DT)


# Each case: (model builder, residual function, inputs/targets builder).  Targets are
# chosen so that every branch of the residual function is visited (Huber residuals on
# both sides of delta, l1 residuals away from the smoothing region).
def _regression_data(batch: int, n_in: int, n_out: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(batch, n_in, dtype=DT)
    y = 2.0 * torch.randn(batch, n_out, dtype=DT)
    return x, y


def _probability_data(batch: int, n_in: int, n_out: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(batch, n_in, dtype=DT)
    y = torch.rand(batch, n_out, dtype=DT)
    return x, y


def _class_data(batch: int, n_in: int, classes: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(batch, n_in, dtype=DT)
    y = torch.randint(0, classes, (batch,))
    return x, y


def _image_regression(batch: int, _n_in: int, n_out: int) -> tuple[Tensor, Tensor]:
    return torch.randn(batch, 1, 6, 6, dtype=DT), torch.randn(batch, n_out, dtype=DT)


def _image_classes(batch: int, _n_in: int, classes: int) -> tuple[Tensor, Tensor]:
    return torch.randn(batch, 1, 6, 6, dtype=DT), torch.randint(0, classes, (batch,))


huber_half = functools.partial(so.residuals.huber, delta=0.5)

CASES = {
    "mlp1-mse": (lambda: mlp(2, 1), so.residuals.mse, _regression_data, 2, 1),
    "mlp1-l1": (lambda: mlp(2, 1), so.residuals.l1, _regression_data, 2, 1),
    "mlp1-huber": (lambda: mlp(2, 1), huber_half, _regression_data, 2, 1),
    "mlp1-bce": (lambda: mlp(2, 1), so.residuals.binary_cross_entropy, _probability_data, 2, 1),
    "mlp3-mse": (lambda: mlp(3, 3), so.residuals.mse, _regression_data, 3, 3),
    "mlp3-l1": (lambda: mlp(3, 3), so.residuals.l1, _regression_data, 3, 3),
    "mlp3-huber": (lambda: mlp(3, 3), huber_half, _regression_data, 3, 3),
    "mlp3-bce": (lambda: mlp(3, 3), so.residuals.binary_cross_entropy, _probability_data, 3, 3),
    "classifier-ce": (lambda: mlp(3, 4), so.residuals.cross_entropy, _class_data, 3, 4),
    "conv-mse": (lambda: conv_model(2), so.residuals.mse, _image_regression, 0, 2),
    "conv-ce": (lambda: conv_model(3), so.residuals.cross_entropy, _image_classes, 0, 3),
}


def build_case(key: str, batch: int = 5, seed: int = 0):
    make_model, residual_fn, make_data, n_in, n_out = CASES[key]
    torch.manual_seed(seed)
    model = make_model()
    x, y = make_data(batch, n_in, n_out)
    return model, residual_fn, x, y


# -- Jacobian strategies ----------------------------------------------------------------------


@functools.cache
def references(case: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(r, jacrev J, finite-difference J)`` of a case, computed once per session."""
    model, residual_fn, x, y = build_case(case)
    f = reference_residuals(model, residual_fn, x, y)
    x0 = flat_params(model)
    return f(x0).detach(), jacrev(f)(x0), central_differences(f, x0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_jacrev_reference_matches_finite_differences(case):
    _, J_ref, J_fd = references(case)
    torch.testing.assert_close(J_ref, J_fd, rtol=0, atol=1e-7)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_strategy_matches_jacrev_and_finite_differences(case, strategy):
    model, residual_fn, x, y = build_case(case)
    prob = make_problem(model, residual_fn)
    params = {k: p.detach() for k, p in model.named_parameters()}
    J, r = make_jacobian(strategy)(prob.program, params, x, y)

    r_ref, J_ref, J_fd = references(case)
    assert J.shape == J_ref.shape == (r_ref.numel(), flat_params(model).numel())
    assert J.dtype == DT
    torch.testing.assert_close(r, r_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(J, J_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(J, J_fd, rtol=0, atol=1e-7)
    # A wrong strategy would not pass by accident: the Jacobian is far from zero.
    assert float(J.abs().max()) > 1e-2


@pytest.mark.parametrize("strategy", ["reverse", "forward"])
def test_per_sample_strategy_with_probability_targets_for_cross_entropy(strategy):
    """Soft labels of the logits' shape go through the per-sample slicing too."""
    torch.manual_seed(1)
    model = mlp(3, 4)
    x = torch.randn(6, 3, dtype=DT)
    y = torch.softmax(torch.randn(6, 4, dtype=DT), dim=1)
    prob = make_problem(model, so.residuals.cross_entropy)
    params = {k: p.detach() for k, p in model.named_parameters()}
    J, r = make_jacobian(strategy)(prob.program, params, x, y)
    f = reference_residuals(model, so.residuals.cross_entropy, x, y)
    x0 = flat_params(model)
    torch.testing.assert_close(r, f(x0), rtol=0, atol=1e-13)
    torch.testing.assert_close(J, jacrev(f)(x0), rtol=0, atol=1e-12)


def test_unknown_strategy_lists_choices():
    with pytest.raises(ValueError, match=r"valid choices are .*batch_forward"):
        make_jacobian("sideways")


def test_batch_reverse_chunking_gives_the_same_jacobian():
    model, residual_fn, x, y = build_case("mlp3-mse", batch=7)
    prob = make_problem(model, residual_fn)
    params = {k: p.detach() for k, p in model.named_parameters()}
    J1, r1 = make_jacobian("batch_reverse")(prob.program, params, x, y)
    J2, r2 = make_jacobian("batch_reverse", chunk_size=4)(prob.program, params, x, y)
    torch.testing.assert_close(J1, J2, rtol=0, atol=1e-14)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)


# -- the optimizer end to end ---------------------------------------------------------------


def damped_gauss_newton(f: Callable[[Tensor], Tensor], x0: Tensor, lam: float) -> Tensor:
    """``x0 - (JᵀJ + λD)⁻¹Jᵀr`` from jacrev, D Marquardt's diag(JᵀJ) floored at 1e-9·max."""
    J = jacrev(f)(x0)
    r = f(x0).detach()
    G = J.T @ J
    col = G.diagonal()
    d = torch.clamp(col, min=float(col.max()) * 1e-9)
    return x0 + torch.linalg.solve(G + lam * torch.diag(d), -J.T @ r)


def reference_lm_step(model: nn.Module, residual_fn, x: Tensor, y: Tensor, lam: float) -> Tensor:
    return damped_gauss_newton(
        reference_residuals(model, residual_fn, x, y), flat_params(model), lam
    )


def nielsen_damping(lam0: float, attempts: int) -> float:
    """λ of attempt ``attempts``: each rejection multiplies λ by ν, then doubles ν (from 2)."""
    k = attempts - 1
    return lam0 * 2.0 ** (k * (k + 1) // 2)


def check_accepted_step(info, model: nn.Module, lam0: float, reference) -> None:
    """The model moved to ``reference(λ)`` for the λ of the accepted attempt."""
    assert info.accepted, info.reason
    lam = nielsen_damping(lam0, info.attempts)
    torch.testing.assert_close(flat_params(model), reference(lam), rtol=0, atol=1e-10)
    rho = info.gain_ratio
    assert info.damping == pytest.approx(lam * max(1 / 3, 1 - (2 * rho - 1) ** 3), rel=1e-12)


@pytest.mark.parametrize("case", ["mlp3-huber", "classifier-ce", "conv-mse"])
def test_one_step_is_the_same_for_every_strategy(case):
    base, residual_fn, x, y = build_case(case, batch=8, seed=3)
    lam = 1.0
    results = {}
    for name in (*STRATEGIES, "auto"):
        model = copy.deepcopy(base)
        # Nielsen's rule and Marquardt's D named: cross-entropy residuals default to the
        # multiplicative rule and D = I, and check_accepted_step reproduces Nielsen's λ
        # on the reference's Marquardt step.
        opt = so.LevenbergMarquardt(
            model,
            residual_fn,
            jacobian=name,
            solver="cholesky",
            form="primal",
            damping=lam,
            damping_rule="nielsen",
            damping_matrix="marquardt",
        )
        info = opt.step(x, y, slice_size=3)
        # ... and each is the damped Gauss-Newton step computed independently.
        check_accepted_step(
            info, model, lam, lambda lam: reference_lm_step(base, residual_fn, x, y, lam)
        )
        if name != "auto":
            assert info.jacobian == name
        results[name] = flat_params(model)
    for name, got in results.items():
        torch.testing.assert_close(got, results["reverse"], rtol=0, atol=1e-10, msg=name)
    assert float((results["reverse"] - flat_params(base)).norm()) > 1e-3


# -- BatchNorm in training mode ---------------------------------------------------------------


def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # No bias before the BatchNorm: BN cancels it exactly, its Jacobian column is round-off,
    # and the step along it (round-off over a floored damping) is not reproducible.
    return nn.Sequential(
        nn.Linear(3, 5, bias=False), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 1)
    ).to(DT)


def batch_stats_copy(model: nn.Module) -> nn.Module:
    """A copy whose BatchNorm layers use batch statistics and hold no running stats."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
            m.num_batches_tracked = None
    return twin.train()


def bn_data(batch: int = 12, seed: int = 5) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, generator=g, dtype=DT) * 2 + 1
    y = torch.sin(x.sum(1, keepdim=True))
    return x, y


def test_batchnorm_auto_uses_a_batch_mode_and_matches_whole_batch_jacrev():
    model = bn_model()
    x, y = bn_data()
    lam = 1e-2
    reference_model = batch_stats_copy(model)
    # Samples are coupled: the rows of a sub-batch differ from the same rows of the
    # whole batch, so a Jacobian that ignored the coupling would fail this test.
    f = reference_residuals(reference_model, so.residuals.mse, x, y)
    J_batch = jacrev(f)(flat_params(model))
    f_sub = reference_residuals(reference_model, so.residuals.mse, x[:6], y[:6])
    J_sub = jacrev(f_sub)(flat_params(model))
    assert float((J_sub - J_batch[:6]).abs().max()) > 1e-3

    with torch.no_grad():
        r0 = f(flat_params(model))
    opt = so.LevenbergMarquardt(model, so.residuals.mse, damping=lam, solver="cholesky")
    info = opt.step(x, y)
    assert info.jacobian.startswith("batch")
    # 12 residuals < 31 parameters: reverse mode over the batch is the cheaper one.
    assert info.jacobian == "batch_reverse"
    assert info.loss_before == pytest.approx(float(r0 @ r0) / r0.numel(), rel=1e-12)
    check_accepted_step(
        info,
        model,
        lam,
        lambda lam: reference_lm_step(reference_model, so.residuals.mse, x, y, lam),
    )


def test_batchnorm_auto_picks_batch_forward_with_many_residuals():
    """More residuals than parameters: one forward pass per parameter is cheaper."""
    model = bn_model(seed=1)
    x, y = bn_data(batch=40)
    reference_model = batch_stats_copy(model)
    opt = so.LevenbergMarquardt(model, so.residuals.mse, damping=1e-2, solver="cholesky")
    info = opt.step(x, y)
    assert info.jacobian == "batch_forward"
    check_accepted_step(
        info,
        model,
        1e-2,
        lambda lam: reference_lm_step(reference_model, so.residuals.mse, x, y, lam),
    )


@pytest.mark.parametrize("name", ["reverse", "forward"])
def test_per_sample_jacobian_with_batchnorm_in_training_mode_is_refused(name):
    model = bn_model()
    before = copy.deepcopy(model.state_dict())
    x, y = bn_data()
    opt = so.LevenbergMarquardt(model, so.residuals.mse, jacobian=name)
    with pytest.raises(ValueError, match="BatchNorm"):
        opt.step(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_batchnorm_in_eval_mode_allows_reverse():
    model = bn_model()
    x, y = bn_data()
    # Give the running statistics non-trivial values first.
    with torch.no_grad():
        model(x)
    model.eval()
    twin = copy.deepcopy(model)
    stats = copy.deepcopy(model.state_dict())
    opt = so.LevenbergMarquardt(model, so.residuals.mse, jacobian="reverse", damping=1e-2)
    info = opt.step(x, y)
    assert info.jacobian == "reverse"
    check_accepted_step(
        info, model, 1e-2, lambda lam: reference_lm_step(twin, so.residuals.mse, x, y, lam)
    )
    # Eval mode: running statistics are left alone.
    for k in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(model.state_dict()[k], stats[k])


def test_batchnorm_running_stats_updated_once_per_accepted_step():
    model = bn_model()
    x, y = bn_data()
    opt = so.LevenbergMarquardt(model, so.residuals.mse, damping=1e-2)
    for step in range(1, 4):
        before = copy.deepcopy(model)
        info = opt.step(x, y)
        assert info.accepted, info.reason
        # Reference: the model before the step, moved to the new parameters, then one
        # plain forward in training mode.
        with torch.no_grad():
            for p, q in zip(before.parameters(), model.parameters(), strict=True):
                p.copy_(q)
            before.train()(x)
        bn, ref = model[1], before[1]
        torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=1e-14)
        torch.testing.assert_close(bn.running_var, ref.running_var, rtol=0, atol=1e-14)
        assert int(bn.num_batches_tracked) == step


def test_batchnorm_running_stats_untouched_by_a_rejected_step():
    model = bn_model()
    x, y = bn_data()
    # lr=1000 overshoots every attempt; one attempt only, so the step is rejected.
    opt = so.LevenbergMarquardt(model, so.residuals.mse, damping=1e-2, lr=1000.0, max_attempts=1)
    stats = copy.deepcopy(model.state_dict())
    info = opt.step(x, y)
    assert not info.accepted
    for k, v in model.state_dict().items():
        assert torch.equal(v, stats[k]), k


@pytest.mark.parametrize("dims", [1, 2])
def test_batchnorm_without_running_stats_in_eval_mode_uses_batch_jacobian(dims):
    torch.manual_seed(0)
    if dims == 1:
        model = nn.Sequential(
            nn.Linear(3, 4, bias=False),
            nn.BatchNorm1d(4, track_running_stats=False),
            nn.Tanh(),
            nn.Linear(4, 1),
        )
        x = torch.randn(12, 3, dtype=DT)
    else:
        model = nn.Sequential(
            nn.Conv2d(1, 2, 3, bias=False),
            nn.BatchNorm2d(2, track_running_stats=False),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(2 * 4 * 4, 1),
        )
        x = torch.randn(6, 1, 6, 6, dtype=DT)
    model = model.to(DT).eval()
    y = torch.randn(x.shape[0], 1, dtype=DT)
    base = copy.deepcopy(model)  # eval mode, batch statistics: PyTorch's own semantics
    opt = so.LevenbergMarquardt(model, so.residuals.mse, damping=1e-2)
    info = opt.step(x, y)
    assert info.jacobian.startswith("batch")
    check_accepted_step(
        info, model, 1e-2, lambda lam: reference_lm_step(base, so.residuals.mse, x, y, lam)
    )


# -- residual adapters against torch's losses ----------------------------------------------


def _outputs_targets(shape=(50, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    o = 3.0 * torch.randn(*shape, generator=g, dtype=DT)
    t = torch.randn(*shape, generator=g, dtype=DT)
    return o, t


def test_mse_residuals():
    o, t = _outputs_targets()
    r = so.residuals.mse(o, t)
    assert r.shape == o.shape
    torch.testing.assert_close((r**2).mean(), F.mse_loss(o, t), rtol=1e-14, atol=0)
    # Targets of another shape with as many entries are reshaped to the outputs.
    torch.testing.assert_close(so.residuals.mse(o[:, :1], t[:, 0]), o[:, :1] - t[:, :1])


@pytest.mark.parametrize("delta", [1.0, 0.3, 2.5])
def test_huber_residuals_square_to_twice_the_huber_loss(delta):
    o, t = _outputs_targets()
    e = o - t
    assert bool((e.abs() < delta).any()) and bool((e.abs() > delta).any())
    r = so.residuals.huber(o, t, delta=delta)
    torch.testing.assert_close(
        (r**2).mean(), 2.0 * F.huber_loss(o, t, delta=delta), rtol=1e-13, atol=0
    )
    torch.testing.assert_close(
        r**2, 2.0 * F.huber_loss(o, t, delta=delta, reduction="none"), rtol=1e-12, atol=1e-14
    )
    assert torch.equal(torch.sign(r), torch.sign(e))


def test_huber_residual_is_c1_at_the_threshold():
    delta = 0.7
    zero = torch.zeros(1, dtype=DT)
    for side in (-1e-7, 1e-7):
        e = torch.tensor([delta + side], dtype=DT, requires_grad=True)
        r = so.residuals.huber(e, zero, delta=delta)
        (g,) = torch.autograd.grad(r.sum(), e)
        assert float(r.detach()) == pytest.approx(delta + side, abs=1e-12)
        assert float(g) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("delta", [1.0, 0.5])
def test_huber_reverse_derivative_at_half_delta(delta):
    e = torch.tensor([delta / 2, -delta / 2], dtype=DT, requires_grad=True)
    r = so.residuals.huber(e, torch.zeros(2, dtype=DT), delta=delta)
    (g,) = torch.autograd.grad(r.sum(), e)
    torch.testing.assert_close(g, torch.ones(2, dtype=DT))


@pytest.mark.parametrize("strategy", ["reverse", "batch_reverse"])
def test_huber_fit_with_a_residual_at_half_delta_makes_progress(strategy):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, generator=g, dtype=DT)
    y = torch.randn(10, 1, generator=g, dtype=DT)
    y[0] = 0.5  # the zero-initialised model's residual there is -delta/2
    model = nn.Linear(2, 1).to(DT)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    opt = so.LevenbergMarquardt(model, so.residuals.huber, jacobian=strategy)
    info = opt.step(x, y)
    assert info.accepted, info.reason


@pytest.mark.parametrize("eps", [1e-6, 1e-3])
def test_l1_residuals_square_to_smoothed_absolute_error(eps):
    o, t = _outputs_targets()
    e = o - t
    r = so.residuals.l1(o, t, eps=eps)
    # r² = sqrt(e² + eps²) - eps, within eps of |e| everywhere.
    torch.testing.assert_close(r**2, torch.sqrt(e * e + eps * eps) - eps, rtol=1e-12, atol=1e-15)
    assert float(((r**2) - e.abs()).abs().max()) <= eps
    assert abs(float((r**2).mean() - F.l1_loss(o, t))) <= eps
    assert torch.equal(torch.sign(r), torch.sign(e))


@pytest.mark.parametrize("e0", [0.0, 1e-14])
def test_l1_residual_derivative_near_zero_is_the_documented_slope(e0):
    eps = 1e-6
    e = torch.tensor([e0], dtype=DT, requires_grad=True)
    r = so.residuals.l1(e, torch.zeros(1, dtype=DT), eps=eps)
    (g,) = torch.autograd.grad(r.sum(), e)
    assert float(g) == pytest.approx((2 * eps) ** -0.5, rel=1e-3)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_l1_fit_with_an_exactly_fitted_sample_makes_progress(strategy):
    """A zero-initialised output layer fits a zero target exactly at the start."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, generator=g, dtype=DT)
    y = torch.randn(10, 1, generator=g, dtype=DT)
    y[0] = 0.0
    model = nn.Linear(2, 1).to(DT)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    opt = so.LevenbergMarquardt(model, so.residuals.l1, jacobian=strategy)
    info = opt.step(x, y)
    assert info.accepted, info.reason


def test_cross_entropy_residuals_with_class_indices_and_probabilities():
    g = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(40, 5, generator=g, dtype=DT)
    labels = torch.randint(0, 5, (40,), generator=g)
    r = so.residuals.cross_entropy(logits, labels)
    assert r.shape == (40,)
    torch.testing.assert_close((r**2).mean(), F.cross_entropy(logits, labels), rtol=0, atol=1e-11)
    probs = torch.softmax(torch.randn(40, 5, generator=g, dtype=DT), dim=1)
    r = so.residuals.cross_entropy(logits, probs)
    torch.testing.assert_close((r**2).mean(), F.cross_entropy(logits, probs), rtol=0, atol=1e-11)
    # Spatial targets (batch, classes, d) with labels (batch, d): one residual per entry.
    logits3 = torch.randn(4, 5, 7, generator=g, dtype=DT)
    labels3 = torch.randint(0, 5, (4, 7), generator=g)
    r3 = so.residuals.cross_entropy(logits3, labels3)
    assert r3.shape == (4, 7)
    torch.testing.assert_close(
        (r3**2).mean(), F.cross_entropy(logits3, labels3), atol=1e-11, rtol=0
    )


def test_binary_cross_entropy_residuals():
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(30, 2, generator=g, dtype=DT)
    targets = torch.rand(30, 2, generator=g, dtype=DT)
    r = so.residuals.binary_cross_entropy(logits, targets)
    assert r.shape == logits.shape
    expected = F.binary_cross_entropy_with_logits(logits, targets)
    torch.testing.assert_close((r**2).mean(), expected, rtol=0, atol=1e-11)
    hard = (targets > 0.5).to(DT)
    r = so.residuals.binary_cross_entropy(logits, hard)
    expected = F.binary_cross_entropy_with_logits(logits, hard)
    torch.testing.assert_close((r**2).mean(), expected, rtol=0, atol=1e-11)


# -- ModelResidual: derivatives with respect to the inputs ------------------------------------


def poisson(model, x: Tensor, f: Tensor) -> Tensor:
    """1-D Poisson ``u'' = f`` on (0, 1) with ``u(0) = u(1) = 0``."""

    def u(s: Tensor) -> Tensor:
        return model(s.reshape(1, 1)).reshape(())

    u_xx = vmap(hessian(u))(x[:, 0])
    boundary = model(torch.tensor([[0.0], [1.0]], dtype=x.dtype)).reshape(-1)
    return torch.cat([u_xx - f, 10.0 * boundary])


def poisson_setup():
    torch.manual_seed(2)
    model = mlp(1, 1, hidden=5)
    x = torch.linspace(0.05, 0.95, 9, dtype=DT).reshape(-1, 1)
    f = -(torch.pi**2) * torch.sin(torch.pi * x[:, 0])
    return model, x, f


def poisson_reference(model: nn.Module, x: Tensor, f: Tensor) -> Callable[[Tensor], Tensor]:
    def res(flat: Tensor) -> Tensor:
        p = unflatten(model, flat)
        return poisson(lambda z: functional_call(model, p, (z,)), x, f)

    return res


@pytest.mark.parametrize("strategy", ["batch_reverse", "batch_forward"])
def test_model_residual_jacobian(strategy):
    model, x, f = poisson_setup()
    prob = make_problem(model, so.ModelResidual(poisson))
    assert prob.program.per_sample is None
    params = {k: p.detach() for k, p in model.named_parameters()}
    J, r = make_jacobian(strategy)(prob.program, params, x, f)

    res = poisson_reference(model, x, f)
    x0 = flat_params(model)
    torch.testing.assert_close(r, res(x0), rtol=0, atol=1e-13)
    J_ref = jacrev(res)(x0)
    assert J.shape == J_ref.shape == (x.shape[0] + 2, x0.numel())
    torch.testing.assert_close(J, J_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(J, central_differences(res, x0), rtol=0, atol=1e-7)
    assert float(J[: x.shape[0]].abs().max()) > 1e-2  # the u'' rows are not trivially zero


@pytest.mark.parametrize("strategy", ["reverse", "forward"])
def test_model_residual_refuses_per_sample_strategies(strategy):
    model, x, f = poisson_setup()
    prob = make_problem(model, so.ModelResidual(poisson))
    params = {k: p.detach() for k, p in model.named_parameters()}
    with pytest.raises(ValueError, match="batch_reverse"):
        make_jacobian(strategy)(prob.program, params, x, f)
    opt = so.LevenbergMarquardt(model, so.ModelResidual(poisson), jacobian=strategy)
    with pytest.raises(ValueError, match="ModelResidual"):
        opt.step(x, f)


def test_model_residual_step_matches_reference():
    model, x, f = poisson_setup()
    res = poisson_reference(copy.deepcopy(model), x, f)
    x0 = flat_params(model)
    lam = 1e-2
    opt = so.LevenbergMarquardt(model, so.ModelResidual(poisson), damping=lam, solver="cholesky")
    info = opt.step(x, f)
    assert info.jacobian.startswith("batch")
    check_accepted_step(info, model, lam, lambda lam: damped_gauss_newton(res, x0, lam))


# -- the outer-product rule of per-sample reverse mode for nn.Linear models ---------------------


class _Tied(nn.Module):
    """Two calls of one Linear and a second Linear sharing its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(self.a(x))))))


class _WeightOutside(nn.Module):
    """Uses a Linear's weight outside the layer's forward: the rule would miss a term."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + x[:, :2] * self.lin.weight[:, 0]


class _MyLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(2.0 * x)


def _frozen_first_layer() -> nn.Module:
    model = mlp(3, 2)
    model[0].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("make", "shape", "expect_rule"),
    [
        (lambda: mlp(3, 1), (7, 3), True),
        (lambda: mlp(3, 4), (7, 3), True),  # k = 4 residuals per sample
        (lambda: mlp(40, 3, hidden=5), (7, 40), True),  # fan_out < fan_in in the first layer
        (lambda: conv_model(3), (7, 1, 6, 6), True),  # convolution rows, read from J
        (
            lambda: nn.Sequential(nn.Linear(3, 6, bias=False), nn.Tanh(), nn.Linear(6, 2)).to(DT),
            (7, 3),
            True,
        ),
        (lambda: mlp(3, 2), (7, 5, 3), True),  # a sequence dimension between batch and features
        (lambda: _Tied().to(DT), (7, 3), True),  # a layer called twice, a tied weight
        (_frozen_first_layer, (7, 3), True),
        (lambda: _WeightOutside().to(DT), (7, 3), False),
        (lambda: nn.Sequential(_MyLinear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT), (7, 3), None),
    ],
)
def test_reverse_outer_product_rule_matches_jacrev(make, shape, expect_rule, monkeypatch):
    # Every layer's Jᵀr and diag(JᵀJ) from its factors, however small (checked below).
    monkeypatch.setattr(jacobian.factors, "FACTOR_MIN_ENTRIES", 0)
    monkeypatch.setattr(jacobian.factors, "FACTOR_GAIN", 0)
    torch.manual_seed(4)
    model = make()
    x = torch.randn(*shape, dtype=DT)
    with torch.no_grad():
        out_shape = model(x).shape
    y = torch.randn(out_shape, dtype=DT)
    prob = make_problem(model, so.residuals.mse)
    names, _ = named_trainable(model)
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    J, r = make_jacobian("reverse")(prob.program, params, x, y)

    def f(flat: Tensor) -> Tensor:
        full = {k: p.detach() for k, p in model.named_parameters()}
        start = 0
        for k in names:
            full[k] = flat[start : start + full[k].numel()].view(full[k].shape)
            start += full[k].numel()
        return so.residuals.mse(functional_call(model, full, (x,)), y).reshape(-1)

    x0 = torch.cat([params[k].reshape(-1) for k in names])
    torch.testing.assert_close(r, f(x0), rtol=0, atol=1e-13)
    torch.testing.assert_close(J, jacrev(f)(x0), rtol=0, atol=1e-12)
    assert float(J.abs().max()) > 1e-2
    # Jᵀr and diag(JᵀJ) from the layers' factors, for the rule's rows only, once.
    products = prob.program.row_products.take(J, col_sq=True, outer=True)
    # A sequence dimension makes every block a sum of outer products: J is read whole.
    if expect_rule and x.ndim != 3:
        assert products is not None and products.col_sq is not None
        torch.testing.assert_close(products.grad, J.T @ r, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(products.col_sq, (J * J).sum(0), rtol=1e-12, atol=1e-14)
        assert prob.program.row_products.take(J, col_sq=True) is None
        # J Jᵀ from the factors where every column is one outer product per row.
        whole = J.shape[0] == x.shape[0] and x.ndim == 2 and not isinstance(model, _Tied)
        if whole:
            assert products.outer is not None
            torch.testing.assert_close(products.outer(DT), J @ J.T, rtol=1e-12, atol=1e-13)
        else:
            assert products.outer is None
    else:
        assert products is None
    if expect_rule is None:
        # A subclass of nn.Linear may change its forward: vmap, never the rule.
        assert prob.program.layers is None
    else:
        assert prob.program.layers is not None
        assert list(prob.program.verified.values()) == [expect_rule]


def test_row_products_from_factors_only_where_j_is_large():
    """At the default thresholds a small J gives its one pass over J for each (bitwise
    the optimizer's products before factors); a large one gives them from the
    factors, equal to that pass.  The rows are held weakly: the pooled buffer is not
    kept busy."""
    torch.manual_seed(0)
    small = mlp(20, 3, hidden=16)  # a wide first layer, a narrow second one
    prob = make_problem(small, so.residuals.mse)
    params = {k: p.detach() for k, p in small.named_parameters()}
    x, y = torch.randn(9, 20, dtype=DT), torch.randn(9, 3, dtype=DT)
    J, r = make_jacobian("reverse")(prob.program, params, x, y)
    small_sums = prob.program.row_products.take(J, col_sq=True, outer=True)
    # A small J: its one pass each, exactly the products the optimizer made before.
    assert small_sums is not None and small_sums.col_sq is not None
    assert torch.equal(small_sums.grad, J.T @ r)
    assert torch.equal(small_sums.col_sq, (J * J).sum(0))
    assert small_sums.outer is None  # three residuals per sample
    wide = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10)).to(DT)
    prob = make_problem(wide, so.residuals.cross_entropy)
    params = {k: p.detach() for k, p in wide.named_parameters()}
    x, y = torch.randn(64, 64, dtype=DT), torch.randint(0, 10, (64,))
    J, r = make_jacobian("reverse")(prob.program, params, x, y)
    assert J.numel() >= jacobian.factors.FACTOR_MIN_ENTRIES
    held = prob.program.row_products
    products = held.take(J, col_sq=False)
    # J Jᵀ only when asked for: it holds the rows (the primal form lets them go).
    assert products is not None and products.col_sq is None and products.outer is None
    torch.testing.assert_close(products.grad, J.T @ r, rtol=1e-12, atol=1e-14)
    J2, _ = make_jacobian("reverse")(prob.program, params, x, y)
    del J2
    assert held._rows is not None and held._rows() is None  # not kept alive


class _TwiceCalled(nn.Module):
    """A wide first layer, a layer called twice, a head of 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(200, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.b(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.c(h)


@pytest.mark.parametrize(
    ("make", "shape", "residual_fn", "blocks"),
    [
        (  # the narrow last layer's 33 columns read from J
            lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(DT),
            (9, 16),
            so.residuals.mse,
            [(544, 577)],
        ),
        (
            lambda: nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 10)).to(DT),
            (9, 20),
            so.residuals.cross_entropy,
            [],
        ),
        (  # a convolution's 20 columns read from J, the linear layer's 730 from factors
            lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(72, 10)),
            (9, 1, 8, 8),
            so.residuals.cross_entropy,
            [(0, 20)],
        ),
        (  # a layer called twice: its 4,160 columns read from J, its factors dropped
            lambda: _TwiceCalled(),
            (9, 200),
            so.residuals.cross_entropy,
            [(12864, 17024)],
        ),
    ],
    ids=["mlp", "classifier", "conv", "layer-called-twice"],
)
def test_factor_gram_is_j_jt(make, shape, residual_fn, blocks):
    """``J Jᵀ`` from the layers' factors (and J's own blocks where a layer has no
    factors) against the product of the rule's rows, float64 and float32."""
    torch.manual_seed(5)
    model = make().to(DT)
    x = torch.randn(*shape, dtype=DT)
    with torch.no_grad():
        out = model(x)
    y = torch.randint(0, 10, (shape[0],)) if residual_fn is so.residuals.cross_entropy else out
    y = y if residual_fn is so.residuals.cross_entropy else torch.randn_like(out)
    prob = make_problem(model, residual_fn)
    params = {k: p.detach() for k, p in model.named_parameters()}
    J, _ = make_jacobian("reverse")(prob.program, params, x, y)
    sums = prob.program.row_products.take(J, col_sq=False, outer=True)
    assert sums is not None and sums.outer is not None
    assert sums.outer.blocks == blocks
    torch.testing.assert_close(sums.outer(DT), J @ J.T, rtol=1e-12, atol=1e-12)
    j32 = J.float()
    torch.testing.assert_close(sums.outer(torch.float32), j32 @ j32.T, rtol=1e-5, atol=1e-5)


def test_outer_product_rule_is_checked_once_per_input_signature():
    model = mlp(3, 2)
    prob = make_problem(model, so.residuals.mse)
    params = {k: p.detach() for k, p in model.named_parameters()}
    strategy = make_jacobian("reverse")
    for batch in (5, 9, 2):
        x, y = torch.randn(batch, 3, dtype=DT), torch.randn(batch, 2, dtype=DT)
        strategy(prob.program, params, x, y)
    assert len(prob.program.verified) == 1
    x3, y3 = torch.randn(4, 6, 3, dtype=DT), torch.randn(4, 6, 2, dtype=DT)
    strategy(prob.program, params, x3, y3)
    assert len(prob.program.verified) == 2 and all(prob.program.verified.values())


def test_linear_layers_declines_models_with_other_parameterised_modules():
    from secondorder.lm.jacobian import outer_product_layers as linear_layers

    conv3d = nn.Sequential(nn.Conv3d(1, 2, 3), nn.Flatten(), nn.Linear(2, 2)).to(DT)
    names, params = named_trainable(conv3d)
    assert linear_layers(conv3d, names, params) is None
    # Conv1d/Conv2d have a per-sample rule (secondorder.lm.conv_rows).
    conv = conv_model(2)
    names, params = named_trainable(conv)
    layers = linear_layers(conv, names, params)
    assert layers is not None and isinstance(layers[0].module, nn.Conv2d)
    net = mlp(3, 2)
    names, params = named_trainable(net)
    layers = linear_layers(net, names, params)
    assert layers is not None
    assert [(layer.weight, layer.bias) for layer in layers] == [
        ("0.weight", "0.bias"),
        ("2.weight", "2.bias"),
    ]
