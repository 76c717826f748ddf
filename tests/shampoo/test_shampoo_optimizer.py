"""Shampoo against torch.optim, a hand-written float64 reference, and its own resume."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from secondorder.shampoo import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    CoupledNewtonConfig,
    EigenConfig,
    RMSpropGraftingConfig,
    SGDGraftingConfig,
    Shampoo,
)

NEVER = 10**9  # a start_preconditioning_step that is never reached


def _model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _data(dtype: torch.dtype, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)


def _train(
    model: nn.Module, make: Callable[[Any], torch.optim.Optimizer], steps: int, dtype: torch.dtype
) -> torch.Tensor:
    x, y = _data(dtype)
    opt = make(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


GRAFTING_CASES = [
    (
        "adam",
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-8),
        dict(betas=(0.9, 1.0), grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8)),
    ),
    (
        "adamw",
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1),
        dict(
            betas=(0.8, 1.0),
            weight_decay=0.1,
            grafting_config=AdamGraftingConfig(beta2=0.99, epsilon=1e-7),
        ),
    ),
    (
        "adagrad",
        lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-10),
        dict(lr=0.05, betas=(0.0, 1.0), grafting_config=AdaGradGraftingConfig(epsilon=1e-10)),
    ),
    (
        "rmsprop",
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.99, eps=1e-8),
        dict(betas=(0.0, 1.0), grafting_config=RMSpropGraftingConfig(beta2=0.99, epsilon=1e-8)),
    ),
    (
        "sgd-nesterov-l2",
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        dict(
            lr=0.1,
            betas=(0.0, 1.0),
            momentum=0.9,
            use_nesterov=True,
            weight_decay=0.01,
            use_decoupled_weight_decay=False,
            grafting_config=SGDGraftingConfig(),
        ),
    ),
    # (No dampening case: torch.optim.SGD starts its buffer at the first direction,
    # Shampoo, like DistributedShampoo, at zero: see test_dampening_as_documented.)
    (
        "sgd-momentum-decoupled",
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
        dict(lr=0.1, betas=(0.0, 1.0), momentum=0.5, grafting_config=SGDGraftingConfig()),
    ),
]


def _ulps(a: torch.Tensor, b: torch.Tensor, before: torch.Tensor) -> float:
    """Largest distance between ``a`` and ``b`` in ulps of ``max(|b|, |before|)``.

    ``b = before − lr·d``: where the step nearly cancels the parameter, rounding the
    step is measured against the operands' size, not the small difference.
    """
    size = torch.maximum(b.abs(), before.abs())
    spacing = torch.nextafter(size, torch.full_like(size, float("inf"))) - size
    return float(((a - b).abs() / spacing).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("name", "torch_opt", "kwargs"), GRAFTING_CASES, ids=[c[0] for c in GRAFTING_CASES]
)
def test_never_preconditioning_equals_torch_optim(
    name: str,
    torch_opt: Callable[[Any], torch.optim.Optimizer],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
) -> None:
    # Lockstep: after each step Shampoo's parameters are compared with torch's and then
    # overwritten by them, so each step is judged on its own (no accumulated drift).
    x, y = _data(dtype)
    ma, mb = _model(dtype), _model(dtype)
    oa = torch_opt(ma.parameters())
    ob = Shampoo(
        mb.parameters(),
        **{"lr": 0.01, **kwargs},
        precondition_frequency=NEVER,
        max_preconditioner_dim=4,
    )
    worst = 0.0
    for _ in range(8):
        before = [p.detach().clone() for p in ma.parameters()]
        for m, o in ((ma, oa), (mb, ob)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
        for pa, pb, p0 in zip(ma.parameters(), mb.parameters(), before, strict=True):
            worst = max(worst, _ulps(pb.detach(), pa.detach(), p0))
            with torch.no_grad():
                pb.copy_(pa)
    if name.startswith("sgd"):
        assert worst == 0.0  # the same operations in the same order: bitwise
    else:
        # torch folds lr and the bias correction into one addcdiv; Shampoo forms the
        # direction first: measured at most 3 ulps per step.
        assert worst <= 4.0, worst


def test_step_count_is_per_group_as_documented() -> None:
    # b has no gradient at step 1.  Shared group: its first update uses the group's t = 2,
    # i.e. torch.optim.Adam whose count for b already reads 1.  Own group: plain Adam.
    torch.manual_seed(0)
    a0, b0 = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    kw: dict[str, Any] = dict(
        lr=0.1,
        betas=(0.9, 0.999),
        epsilon=1e-8,
        precondition_frequency=NEVER,
        grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
    )
    adam: dict[str, Any] = dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    shared = [a0.clone().requires_grad_(), b0.clone().requires_grad_()]
    own = [a0.clone().requires_grad_(), b0.clone().requires_grad_()]
    late = [a0.clone().requires_grad_(), b0.clone().requires_grad_()]
    plain = [a0.clone().requires_grad_(), b0.clone().requires_grad_()]
    s_shared = Shampoo(shared, **kw)
    s_own = Shampoo([{"params": [own[0]]}, {"params": [own[1]]}], **kw)
    t_late = torch.optim.Adam(late, **adam)
    t_late.state[late[1]] = {
        "step": torch.tensor(1.0),
        "exp_avg": torch.zeros(3, dtype=torch.float64),
        "exp_avg_sq": torch.zeros(3, dtype=torch.float64),
    }
    t_plain = torch.optim.Adam(plain, **adam)
    gen = torch.Generator().manual_seed(1)
    for t in range(4):
        ga = torch.randn(3, 2, generator=gen, dtype=torch.float64)
        gb = torch.randn(3, generator=gen, dtype=torch.float64)
        for params, opt in ((shared, s_shared), (own, s_own), (late, t_late), (plain, t_plain)):
            params[0].grad = ga.clone()
            params[1].grad = None if t == 0 else gb.clone()
            opt.step()
    for got, want in ((shared, late), (own, plain)):
        for p, q in zip(got, want, strict=True):
            # A few ulps per step, as in test_never_preconditioning_equals_torch_optim.
            torch.testing.assert_close(p, q, rtol=1e-15, atol=0)
    assert not torch.allclose(shared[1], plain[1], rtol=1e-3, atol=0)  # the documented gap


def test_dampening_as_documented() -> None:
    # The momentum buffer starts at zero (DistributedShampoo), so Shampoo equals
    # torch.optim.SGD given a zero buffer, and plain SGD's b_t minus d·μ^(t−1)·P₁.
    torch.manual_seed(0)
    w = torch.randn(3, 2, dtype=torch.float64)
    mu, d, lr = 0.9, 0.5, 0.1
    sh = [w.clone().requires_grad_()]
    zero, plain = [w.clone().requires_grad_()], [w.clone().requires_grad_()]
    s = Shampoo(
        sh,
        lr=lr,
        betas=(0.0, 1.0),
        momentum=mu,
        dampening=d,
        precondition_frequency=NEVER,
        grafting_config=SGDGraftingConfig(),
    )
    t_zero = torch.optim.SGD(zero, lr=lr, momentum=mu, dampening=d)
    t_zero.state[zero[0]]["momentum_buffer"] = torch.zeros_like(w)
    t_plain = torch.optim.SGD(plain, lr=lr, momentum=mu, dampening=d)
    gen = torch.Generator().manual_seed(1)
    g1 = torch.randn(3, 2, generator=gen, dtype=torch.float64)
    for t in range(1, 4):
        g = g1 if t == 1 else torch.randn(3, 2, generator=gen, dtype=torch.float64)
        _step_both([(sh, s), (zero, t_zero), (plain, t_plain)], [g])
        assert torch.equal(sh[0], zero[0])
        torch.testing.assert_close(
            s.state[sh[0]]["block0.momentum_buffer"].view(3, 2),
            t_plain.state[plain[0]]["momentum_buffer"] - d * mu ** (t - 1) * g1,
            rtol=1e-14,
            atol=1e-15,
        )


def test_eigenvalue_corrected_with_identity_basis_is_adam() -> None:
    # The basis starts as the identity; never refreshing it leaves Adam in disguise.
    dtype = torch.float64
    want = _train(_model(dtype), lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-8), 8, dtype)
    got = _train(
        _model(dtype),
        lambda ps: Shampoo(
            ps,
            lr=0.01,
            betas=(0.9, 0.999),
            epsilon=1e-8,
            preconditioner="eigenvalue_corrected",
            precondition_frequency=NEVER,
        ),
        8,
        dtype,
    )
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


def test_eigenvalue_corrected_diagonal_factors_rotate_exactly() -> None:
    # Diagonal gradients of growing magnitude keep every factor diagonal with ascending
    # entries, so eigh returns signed unit vectors and SOAP must still equal Adam.
    W = nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
    V = nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
    opt = Shampoo(
        [W],
        lr=0.01,
        betas=(0.9, 0.999),
        epsilon=1e-8,
        preconditioner="eigenvalue_corrected",
        max_preconditioner_dim=4,  # keep (4, 4): two 4x4 diagonal factors
    )
    ref = torch.optim.Adam([V], lr=0.01, eps=1e-8)
    for t in range(1, 6):
        g = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * t)
        W.grad, V.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    Q = opt.state[W]["block0.eigenvectors0"]
    assert torch.equal(Q.abs(), torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(W, V, rtol=1e-14, atol=1e-15)


# ----------------------------------------------------------------------------------------
# A hand-written float64 reference of the six steps, block by block, no batching.
# Blocks with max_preconditioner_dim=4 (worked by hand):
#   weight (5, 6): 5·6 > 4, no merge; rows [0:4], [4:5] × columns [0:4], [4:6]
#   bias (5,): [0:4], [4:5];  weight (3, 5): columns [0:4], [4:5];  bias (3,): one block
BLOCKS = {
    0: [
        (slice(0, 4), slice(0, 4)),
        (slice(0, 4), slice(4, 6)),
        (slice(4, 5), slice(0, 4)),
        (slice(4, 5), slice(4, 6)),
    ],
    1: [(slice(0, 4),), (slice(4, 5),)],
    2: [(slice(0, 3), slice(0, 4)), (slice(0, 3), slice(4, 5))],
    3: [(slice(0, 3),)],
}


def _reference(model: nn.Module, steps: int, hp: dict[str, Any]) -> torch.Tensor:
    x, y = _data(torch.float64)
    params = list(model.parameters())
    b1, b2 = hp["betas"]
    gb2, geps = 0.999, 1e-8
    eps, wd, mu, lr = hp["epsilon"], hp["weight_decay"], hp["momentum"], hp["lr"]
    freq, start = hp["precondition_frequency"], hp["start_preconditioning_step"]
    st: dict[tuple[int, int], dict[str, Any]] = {}
    for t in range(1, steps + 1):
        for p in params:
            p.grad = None
        ((model(x) - y) ** 2).mean().backward()
        updates = []
        for pi, p in enumerate(params):
            for bi, sl in enumerate(BLOCKS[pi]):
                W = p.detach()[sl].clone()
                G = p.grad[sl].clone()
                s = st.setdefault(
                    (pi, bi),
                    {
                        "F": [torch.zeros(d, d, dtype=torch.float64) for d in G.shape],
                        "R": [torch.eye(d, dtype=torch.float64) for d in G.shape],
                        "M": torch.zeros_like(G),
                        "V": torch.zeros_like(G),
                        "buf": torch.zeros_like(G),
                    },
                )
                r = G.ndim
                # 1. L2 weight decay
                if not hp["use_decoupled_weight_decay"]:
                    G = G + wd * W
                # 2. factors and grafting state
                for k in range(r):
                    Gk = G.movedim(k, 0).reshape(G.shape[k], -1)
                    # β₂ = 1: a plain sum (AdaGrad), with no bias correction
                    w = 1.0 if b2 == 1.0 else 1 - b2
                    s["F"][k] = b2 * s["F"][k] + w * Gk @ Gk.T
                s["V"] = gb2 * s["V"] + (1 - gb2) * G * G
                # 3. roots
                if (t % freq == 0 and t > start) or t == start:
                    for k in range(r):
                        d = G.shape[k]
                        bc2 = 1.0 if b2 == 1.0 else 1 - b2**t
                        A = s["F"][k] / bc2 + eps * torch.eye(d, dtype=torch.float64)
                        L, Q = torch.linalg.eigh(A)
                        if L.min() < eps:
                            L = L - L.min() + eps
                        s["R"][k] = Q @ torch.diag(L ** (-1.0 / (2 * r))) @ Q.T
                # 4. first moment
                s["M"] = b1 * s["M"] + (1 - b1) * G
                Mh = s["M"] / (1 - b1**t)
                # 5. direction
                graft = Mh / (torch.sqrt(s["V"] / (1 - gb2**t)) + geps)
                if t < start:
                    P = graft
                else:
                    P = Mh
                    for k in range(r):
                        P = torch.tensordot(s["R"][k], P.movedim(k, 0), dims=([1], [0])).movedim(
                            0, k
                        )
                    P = P * torch.linalg.norm(graft) / torch.linalg.norm(P)
                # 6. decoupled weight decay, momentum, update
                if hp["use_decoupled_weight_decay"]:
                    P = P + wd * W
                s["buf"] = mu * s["buf"] + P
                P = P + mu * s["buf"] if hp["use_nesterov"] else s["buf"]
                updates.append((p, sl, W - lr * P))
        with torch.no_grad():
            for p, sl, new in updates:
                p[sl] = new
    return torch.cat([p.detach().reshape(-1) for p in params])


REFERENCE_CASES = [
    dict(
        # epsilon 1e-6, not smaller: the (1, 4) blocks' 4x4 factors are rank deficient in
        # the first steps, and eigh's rounding of their null space (1e-16·‖F‖) relative
        # to epsilon is what limits the agreement of two correct implementations.
        lr=0.05,
        betas=(0.9, 0.99),
        epsilon=1e-6,
        weight_decay=0.01,
        use_decoupled_weight_decay=True,
        momentum=0.5,
        use_nesterov=False,
        precondition_frequency=2,
        start_preconditioning_step=2,
    ),
    dict(
        lr=0.05,
        betas=(0.5, 1.0),
        epsilon=1e-6,
        weight_decay=0.02,
        use_decoupled_weight_decay=False,
        momentum=0.9,
        use_nesterov=True,
        precondition_frequency=1,
        start_preconditioning_step=3,
    ),
]


@pytest.mark.parametrize("hp", REFERENCE_CASES)
def test_six_steps_equal_hand_written_float64_reference(hp: dict[str, Any]) -> None:
    want = _reference(_model(torch.float64), 6, hp)
    got = _train(
        _model(torch.float64),
        lambda ps: Shampoo(
            ps,
            **hp,
            max_preconditioner_dim=4,
            grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
        ),
        6,
        torch.float64,
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.equal(got, _reference(_model(torch.float64), 0, hp))  # it moved


def test_blocks_of_one_shape_share_one_batch() -> None:
    model = _model(torch.float64)
    opt = Shampoo(model.parameters(), max_preconditioner_dim=4)
    _train(model, lambda ps: opt, 1, torch.float64)
    shapes = sorted((b.shape, len(b.blocks)) for b in opt._batches)
    assert shapes == [
        ((1,), 1),
        ((1, 2), 1),
        ((1, 4), 1),
        ((3,), 1),
        ((3, 1), 1),
        ((3, 4), 1),
        ((4,), 1),
        ((4, 2), 1),
        ((4, 4), 1),
    ]
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)).double()
    opt = Shampoo(model.parameters(), max_preconditioner_dim=4)
    opt._build()
    # Two 8x8 weights: merged 64 > 4, so four (4, 4) blocks each, stacked into one batch of 8.
    assert [(b.shape, len(b.blocks)) for b in opt._batches] == [((4, 4), 8)]


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    x, y = _data(torch.float64)
    for _ in range(n):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def test_factored_roots_where_cheaper_and_equal_to_formed_roots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A (5, 6) weight with max dim 8 is one (5, 6) block: factor 0 (d=5, m=6) and
    # factor 1 (d=6, m=5).  Factored iff precondition_frequency·m < d.
    def make(ps: Any, freq: int) -> Shampoo:
        return Shampoo(
            ps,
            betas=(0.9, 0.999),
            epsilon=1e-8,
            precondition_frequency=freq,
            max_preconditioner_dim=8,
            grafting_config=AdamGraftingConfig(),
        )

    m = _model(torch.float64)
    opt = make(m.parameters(), 1)
    _steps(m, opt, 3)
    keys = {k for k in opt.state[m[0].weight] if "root" in k}
    assert keys == {"block0.root0", "block0.root_factor1"}
    assert {k for k in opt.state[m[0].bias] if "root" in k} == {"block0.root_factor0"}
    got = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # The same run with every root formed: equal to rounding.
    monkeypatch.setattr(Shampoo, "_factored", lambda self, g, b: tuple(False for _ in b.shape))
    m2 = _model(torch.float64)
    opt2 = make(m2.parameters(), 1)
    _steps(m2, opt2, 3)
    assert {k for k in opt2.state[m2[0].weight] if "root" in k} == {"block0.root0", "block0.root1"}
    want = torch.cat([p.detach().reshape(-1) for p in m2.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert not torch.equal(got, want)  # the two paths really differ
    monkeypatch.undo()
    # A saved layout wins over the frequency: factored state loads into freq 6 (which
    # would form every root) and continues bitwise like the original with freq 6.
    sd = opt.state_dict()
    sd["param_groups"][0]["precondition_frequency"] = 6
    sd["param_groups"][0]["start_preconditioning_step"] = 6
    m3 = _model(torch.float64)
    m3.load_state_dict(m.state_dict())
    opt3 = make(m3.parameters(), 6)
    opt3.load_state_dict(sd)
    assert "block0.root_factor1" in opt3.state[m3[0].weight]
    for g in opt.param_groups:
        g["precondition_frequency"] = g["start_preconditioning_step"] = 6
    _steps(m, opt, 4)
    _steps(m3, opt3, 4)
    for a, b in zip(m.parameters(), m3.parameters(), strict=True):
        assert torch.equal(a, b)
    fresh = _model(torch.float64)
    o6 = make(fresh.parameters(), 6)
    o6._build()
    assert {k for k in o6.state[fresh[0].weight] if "root" in k} == {"block0.root0", "block0.root1"}


def test_coupled_newton_after_a_factored_layout_uses_cholesky() -> None:
    # Switching to coupled Newton after the state was built for eigh keeps the layout:
    # D = chol(R)ᵀ, so DᵀD is Newton's root of the factor (β₂ = 1: no bias correction).
    from secondorder.shampoo.root_inverse import coupled_newton_root_inverse

    newton = CoupledNewtonConfig(max_iterations=200, tolerance=1e-12)
    a = _model(torch.float64)
    oa = Shampoo(a.parameters(), epsilon=1e-6, max_preconditioner_dim=8)
    _steps(a, oa, 1)
    assert "block0.root_factor1" in oa.state[a[0].weight]
    oa.param_groups[0]["root_inv_config"] = newton
    _steps(a, oa, 2)
    state = oa.state[a[0].weight]
    want, failed, converged = coupled_newton_root_inverse(
        state["block0.factor1"][None], 4, 1e-6, max_iterations=200, tolerance=1e-12
    )
    assert converged.all() and not failed.any()
    Dm = state["block0.root_factor1"]
    torch.testing.assert_close(Dm.mT @ Dm, want[0], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(
            grafting_config=AdamGraftingConfig(),
            betas=(0.9, 0.999),
            momentum=0.9,
            weight_decay=0.01,
        ),
        dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.999), factor_dtype=torch.float64),
        dict(
            root_inv_config=CoupledNewtonConfig(),
            epsilon=1e-6,  # Newton diverges on the exactly singular factors of the (1, 4) blocks
            grafting_config=AdaGradGraftingConfig(),
            precondition_frequency=2,
        ),
    ],
)
def test_state_dict_resume_is_bitwise_with_weights_only(kwargs: dict[str, Any]) -> None:
    x, y = _data(torch.float32)

    def run(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()

    a = _model(torch.float32)
    oa = Shampoo(a.parameters(), max_preconditioner_dim=4, **kwargs)
    run(a, oa, 3)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    run(a, oa, 3)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b = _model(torch.float32, seed=5)
    b.load_state_dict(ckpt["model"])
    ob = Shampoo(b.parameters(), max_preconditioner_dim=4, **kwargs)
    ob.load_state_dict(ckpt["opt"])
    run(b, ob, 3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    if "factor_dtype" in kwargs:  # not cast to the parameter's float32 on load
        assert ob.state[next(b.parameters())]["block0.factor0"].dtype == torch.float64


def test_step_count_is_exact_past_two_to_the_24() -> None:
    # A float32 count stalls at 2²⁴ (2²⁴ + 1 rounds back to it): with an even frequency
    # the roots would never refresh again.  The root must be the float64 eigh root of
    # the factor at each refreshing step (a 2-vector: one formed 2x2 root).
    torch.manual_seed(0)
    p = torch.randn(2, dtype=torch.float64, requires_grad=True)
    opt = Shampoo([p], lr=0.0, betas=(0.0, 1.0), epsilon=1e-3, precondition_frequency=2)
    p.grad = torch.randn(2, dtype=torch.float64)
    opt.step()
    opt.state[p]["step"].fill_(2**24 - 1)
    for t in range(2**24, 2**24 + 4):
        p.grad = torch.randn(2, dtype=torch.float64)
        opt.step()
        assert int(opt.state[p]["step"]) == t
        if t % 2 == 0:
            F = opt.state[p]["block0.factor0"]
            L, Q = torch.linalg.eigh(F + 1e-3 * torch.eye(2, dtype=torch.float64))
            want = Q @ torch.diag(L**-0.5) @ Q.T
            torch.testing.assert_close(opt.state[p]["block0.root0"], want, rtol=1e-10, atol=0)


def test_old_float_step_count_loads() -> None:
    pa, oa, pb, ob = _twins((4, 3), grafting_config=AdamGraftingConfig())
    gen = torch.Generator().manual_seed(3)

    def grads() -> list[torch.Tensor]:
        return [
            torch.randn(4, 3, generator=gen, dtype=torch.float64),
            torch.randn(4, generator=gen, dtype=torch.float64),
        ]

    for _ in range(3):
        _step_both([(pa, oa), (pb, ob)], grads())
    sd = oa.state_dict()
    for pstate in sd["state"].values():  # as saved before the count became int64
        pstate["step"] = pstate["step"].to(torch.float32)
    oa.load_state_dict(sd)
    assert oa.state[pa[0]]["step"].dtype == torch.int64
    for _ in range(2):
        _step_both([(pa, oa), (pb, ob)], grads())
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
    _assert_same_state_dict(oa.state_dict(), ob.state_dict())


def test_load_refuses_another_rank_layout() -> None:
    m = _model(torch.float32)
    opt = Shampoo(m.parameters())
    sd = opt.state_dict()
    sd["shampoo"] = {"rank": 1, "world_size": 2}
    with pytest.raises(
        ValueError, match=r"saved by rank 1 of 2, but this optimizer is rank 0 of 1"
    ):
        opt.load_state_dict(sd)


def _assert_same_state_dict(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bitwise equal optimizer state dicts: same keys, dtypes and bits, same groups."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, sa in a["state"].items():
        sb = b["state"][pid]
        assert sa.keys() == sb.keys()
        for k, v in sa.items():
            assert v.dtype == sb[k].dtype and torch.equal(v, sb[k]), (pid, k)


def _twins(
    shape: tuple[int, ...], **kw: Any
) -> tuple[list[torch.Tensor], Shampoo, list[torch.Tensor], Shampoo]:
    """Two identical float64 parameters-and-optimizers, the second kept as the reference."""
    torch.manual_seed(0)
    w = [torch.randn(*shape, dtype=torch.float64), torch.randn(shape[0], dtype=torch.float64)]
    pa = [x.clone().requires_grad_() for x in w]
    pb = [x.clone().requires_grad_() for x in w]
    return pa, Shampoo(pa, **kw), pb, Shampoo(pb, **kw)


def _step_both(
    pairs: list[tuple[list[torch.Tensor], torch.optim.Optimizer]], grads: list[torch.Tensor]
) -> None:
    for params, opt in pairs:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()


def test_refused_load_leaves_the_optimizer_as_it_was() -> None:
    kw: dict[str, Any] = dict(
        max_preconditioner_dim=4, grafting_config=AdamGraftingConfig(), momentum=0.5
    )
    pa, oa, pb, ob = _twins((6, 5), **kw)
    gen = torch.Generator().manual_seed(2)

    def grads() -> list[torch.Tensor]:
        return [
            torch.randn(6, 5, generator=gen, dtype=torch.float64),
            torch.randn(6, generator=gen, dtype=torch.float64),
        ]

    for _ in range(2):
        _step_both([(pa, oa), (pb, ob)], grads())
    before = oa.state_dict()
    # (5, 6) saved into (6, 5): same number of entries, other block shapes.
    q = [
        torch.randn(5, 6, dtype=torch.float64, requires_grad=True),
        torch.randn(6, dtype=torch.float64, requires_grad=True),
    ]
    oq = Shampoo(q, **kw)
    _step_both(
        [(q, oq)], [torch.randn(5, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)]
    )
    with pytest.raises(
        ValueError,
        match=r"saved for a param_groups\[0\]\['params'\]\[0\] of shape \(5, 6\), but this "
        r"optimizer's has shape \(6, 5\): it belongs to another model",
    ):
        oa.load_state_dict(oq.state_dict())
    unrecorded = oq.state_dict()  # as saved before the shapes were recorded
    del unrecorded["shampoo"]["shapes"]
    with pytest.raises(
        ValueError,
        match=r"the saved state 'block1.factor1' of parameter param_groups\[0\]\['params'\]\[0\] "
        r"\(shape \(6, 5\)\) has shape \(2, 2\), expected \(1, 1\)",
    ):
        oa.load_state_dict(unrecorded)
    bad = ob.state_dict()
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"Invalid lr=-1.0"):
        oa.load_state_dict(bad)
    _assert_same_state_dict(oa.state_dict(), before)
    for _ in range(3):  # and it still steps exactly like the untouched twin
        _step_both([(pa, oa), (pb, ob)], grads())
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
    _assert_same_state_dict(oa.state_dict(), ob.state_dict())


@pytest.mark.parametrize("shape", [(3, 4), (12,), (2, 6)])
def test_a_checkpoint_of_other_shapes_with_the_same_blocks_is_refused(
    shape: tuple[int, ...],
) -> None:
    # A (4, 3) weight and a (3, 4), (12,) or (2, 6) one all become one (12,) block: the
    # block entries alone cannot tell them apart, and the filter, grafting state and
    # factor of one model would be read element by element as the other's.
    kw: dict[str, Any] = dict(betas=(0.9, 0.99), grafting_config=AdamGraftingConfig())
    pa, oa, pb, ob = _twins((4, 3), **kw)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((4, 3), (4,))]
    _step_both([(pa, oa), (pb, ob)], grads)
    q = [torch.zeros(shape, dtype=torch.float64, requires_grad=True), pa[1].detach().clone()]
    oq = Shampoo(q, **kw)
    before = oq.state_dict()
    with pytest.raises(
        ValueError,
        match=r"the state dict was saved for a param_groups\[0\]\['params'\]\[0\] of shape "
        rf"\(4, 3\), but this optimizer's has shape {re.escape(str(shape))}: it belongs to "
        r"another model \(or the parameters are in another order\); nothing was loaded",
    ):
        oq.load_state_dict(oa.state_dict())
    _assert_same_state_dict(oq.state_dict(), before)
    ob.load_state_dict(oa.state_dict())  # the same shapes load, through weights_only too
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    ob.load_state_dict(torch.load(buf, weights_only=True))
    _assert_same_state_dict(ob.state_dict(), oa.state_dict())


def test_refused_param_group_is_not_added() -> None:
    kw: dict[str, Any] = dict(grafting_config=AdamGraftingConfig(), momentum=0.5)
    pa, oa, pb, ob = _twins((4, 3), **kw)
    grads = [torch.ones(4, 3, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
    _step_both([(pa, oa), (pb, ob)], grads)
    before = oa.state_dict()
    extra = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"Invalid lr=-1.0: must be a finite number >= 0"):
        oa.add_param_group({"params": [extra], "lr": -1.0})
    with pytest.raises(
        TypeError,
        match=r"Shampoo optimizes floating-point parameters; got one of dtype torch.int64",
    ):
        oa.add_param_group({"params": iter([torch.zeros(3, dtype=torch.int64)])})
    assert len(oa.param_groups) == 1
    _assert_same_state_dict(oa.state_dict(), before)
    _step_both([(pa, oa), (pb, ob)], [2 * g for g in grads])
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
    # A valid group (from a generator) still joins and steps.
    oa.add_param_group({"params": (x for x in [extra]), "lr": 0.1})
    extra.grad = torch.ones(3, dtype=torch.float64)
    oa.step()
    assert len(oa.param_groups) == 2 and extra.ne(0).all()


def test_param_groups_have_their_own_hyperparameters() -> None:
    dtype = torch.float64
    m1, m2 = _model(dtype), _model(dtype)
    want = _train(
        m1,
        lambda ps: torch.optim.SGD(
            [{"params": list(ps)[:2], "lr": 0.1}, {"params": list(m1.parameters())[2:], "lr": 0.01}]
        ),
        3,
        dtype,
    )
    got = _train(
        m2,
        lambda ps: Shampoo(
            [
                {"params": list(m2.parameters())[:2], "lr": 0.1},
                {"params": list(m2.parameters())[2:]},
            ],
            lr=0.01,
            betas=(0.0, 1.0),
            grafting_config=SGDGraftingConfig(),
            precondition_frequency=NEVER,
        ),
        3,
        dtype,
    )
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_raises_before_any_change(bad: float) -> None:
    m = _model(torch.float32)
    opt = Shampoo(m.parameters(), grafting_config=AdamGraftingConfig())
    _train(m, lambda ps: opt, 2, torch.float32)
    before = {k: v.clone() for k, v in opt.state[next(m.parameters())].items()}
    params = [p.clone() for p in m.parameters()]
    m[2].weight.grad[0, 0] = bad
    with pytest.raises(
        FloatingPointError,
        match=r"non-finite gradient .* param_groups\[0\]\['params'\]\[2\] \(shape \(3, 5\)\); "
        "no state was changed",
    ):
        opt.step()
    for k, v in opt.state[next(m.parameters())].items():
        assert torch.equal(v, before[k])
    for p, q in zip(m.parameters(), params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "kwargs",
    [
        # float32 factors: GGᵀ of a 1e20 gradient is 3e40 > 3.4e38.
        dict(betas=(0.9, 0.999), grafting_config=AdamGraftingConfig()),
        # float64 factors hold it; the float32 AdaGrad state g² does not.
        dict(factor_dtype=torch.float64, grafting_config=AdaGradGraftingConfig()),
        dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.99)),
    ],
)
@pytest.mark.parametrize("sign", [1.0, -1.0])  # the bound reads both ends of G
def test_overflowing_finite_gradient_is_refused_before_any_change(
    kwargs: dict[str, Any], sign: float
) -> None:
    torch.manual_seed(0)
    w = [torch.randn(3, 3), torch.randn(3)]
    pa = [x.clone().requires_grad_() for x in w]
    pb = [x.clone().requires_grad_() for x in w]
    oa, ob = Shampoo(pa, **kwargs), Shampoo(pb, **kwargs)
    gen = torch.Generator().manual_seed(1)

    def grads() -> list[torch.Tensor]:
        return [torch.randn(3, 3, generator=gen), torch.randn(3, generator=gen)]

    _step_both([(pa, oa), (pb, ob)], grads())
    before = oa.state_dict()
    values = [p.detach().clone() for p in pa]
    pa[0].grad = torch.full((3, 3), sign * 1e20)
    pa[0].grad[0, 0] = 0.5  # the other end of G small
    pa[1].grad = torch.ones(3)
    with pytest.raises(
        FloatingPointError,
        match=r"the gradient of parameter param_groups\[0\]\['params'\]\[0\] \(shape \(3, 3\)\) "
        r"is finite but would overflow Shampoo's factors or grafting state .*; no state was "
        "changed",
    ):
        oa.step()
    _assert_same_state_dict(oa.state_dict(), before)
    for p, v in zip(pa, values, strict=True):
        assert torch.equal(p, v)
    for _ in range(3):  # the next steps equal an optimizer that never saw the bad gradient
        _step_both([(pa, oa), (pb, ob)], grads())
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
    _assert_same_state_dict(oa.state_dict(), ob.state_dict())


def test_large_gradient_that_fits_is_taken() -> None:
    # |g| = 1e18 in float32 (one 9-vector block: F = ggᵀ): entries 1e36 fit, and so does
    # AdaGrad's g², so the step is taken, not refused.
    p = torch.zeros(3, 3, requires_grad=True)
    opt = Shampoo([p], grafting_config=AdaGradGraftingConfig())
    p.grad = torch.full((3, 3), 1e18)
    opt.step()
    assert torch.isfinite(opt.state[p]["block0.factor0"]).all()
    assert opt.state[p]["block0.factor0"][0, 0] == pytest.approx(1e36, rel=1e-6)
    assert p.ne(0).all()


def test_failed_root_keeps_previous_with_warning_naming_parameter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import secondorder.shampoo.root_inverse as ri

    m = nn.Linear(3, 2, bias=False)
    opt = Shampoo(
        [{"params": [m.weight], "param_names": ["enc.weight"]}],
        grafting_config=AdamGraftingConfig(),
        max_preconditioner_dim=3,  # one (2, 3) block
        num_tolerated_failed_amortized_computations=1,
    )
    x = torch.randn(8, 3)
    m(x).square().mean().backward()
    opt.step()
    root = opt.state[m.weight]["block0.root0"].clone()
    root_factor = opt.state[m.weight]["block0.root_factor1"].clone()

    def broken(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("linalg.eigh: failed to converge")

    monkeypatch.setattr(ri, "_eigh", broken)
    with pytest.warns(
        RuntimeWarning,
        match=r"block 0 \(factors \[0, 1\]\) of parameter 'enc.weight' \(shape \(2, 3\)\) "
        r"failed at step 2 \(eigh, even in float64\); keeping its previous root",
    ):
        opt.step()
    assert torch.equal(opt.state[m.weight]["block0.root0"], root)
    # Factor 1 (d=3, m=2) keeps its root factored; it too is left as it was.
    assert torch.equal(opt.state[m.weight]["block0.root_factor1"], root_factor)
    with pytest.raises(
        RuntimeError,
        match=r"failed 2 times in a row, more than num_tolerated_failed_amortized_computations=1",
    ):
        opt.step()


def test_pseudo_inverse_trains_rank_deficient_factors() -> None:
    # One sample: every factor has rank 1; the pseudo-inverse needs no epsilon.
    m = _model(torch.float64)
    x, y = _data(torch.float64, n=1)
    opt = Shampoo(
        m.parameters(),
        epsilon=0.0,
        root_inv_config=EigenConfig(pseudo_inverse=True),
        grafting_config=SGDGraftingConfig(),
    )
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert losses[-1] < losses[0]


BAD = [
    (dict(lr=-1.0), ValueError, r"Invalid lr=-1.0: must be a finite number >= 0"),
    (
        dict(betas=(1.0, 0.9)),
        ValueError,
        r"Invalid betas\[0\]=1.0: must be a finite number in \[0, 1\)",
    ),
    (
        dict(betas=(0.9, 1.5)),
        ValueError,
        r"Invalid betas\[1\]=1.5: must be a finite number in \[0, 1\]",
    ),
    (dict(betas=(0.9,)), ValueError, r"Invalid betas=\(0.9,\): must be a pair"),
    (dict(epsilon=0.0), ValueError, r"Invalid epsilon=0.0: must be a finite number > 0"),
    (dict(epsilon=-1.0), ValueError, r"Invalid epsilon=-1.0"),
    (dict(momentum=1.0), ValueError, r"Invalid momentum=1.0: must be a finite number in \[0, 1\)"),
    (dict(dampening=-0.1), ValueError, r"Invalid dampening=-0.1"),
    (
        dict(use_nesterov=True),
        ValueError,
        r"use_nesterov=True needs momentum > 0 and dampening = 0 \(got momentum=0.0, "
        r"dampening=0.0\): set momentum > 0 and dampening=0.0 \(torch.optim.SGD requires "
        r"the same\)",
    ),
    (dict(use_nesterov=1), TypeError, r"Invalid use_nesterov=1: must be True or False"),
    (dict(weight_decay=-0.1), ValueError, r"Invalid weight_decay=-0.1"),
    (
        dict(use_decoupled_weight_decay="yes"),
        TypeError,
        r"Invalid use_decoupled_weight_decay='yes'",
    ),
    (dict(use_bias_correction=None), TypeError, r"Invalid use_bias_correction=None"),
    (
        dict(max_preconditioner_dim=0),
        ValueError,
        r"Invalid max_preconditioner_dim=0: must be an integer >= 1 or math.inf",
    ),
    (dict(max_preconditioner_dim=2.5), ValueError, r"Invalid max_preconditioner_dim=2.5"),
    (
        dict(precondition_frequency=0),
        ValueError,
        r"Invalid precondition_frequency=0: must be an integer >= 1",
    ),
    (
        dict(precondition_frequency=10, start_preconditioning_step=5),
        ValueError,
        r"Invalid start_preconditioning_step=5: must be >= precondition_frequency=10",
    ),
    (
        dict(start_preconditioning_step=0),
        ValueError,
        r"Invalid start_preconditioning_step=0: must be an integer >= 1",
    ),
    (
        dict(num_tolerated_failed_amortized_computations=-1),
        ValueError,
        r"Invalid num_tolerated_failed_amortized_computations=-1",
    ),
    (
        dict(grafting_config="adam"),
        TypeError,
        r"Invalid grafting_config='adam': must be None or one of SGDGraftingConfig",
    ),
    (
        dict(preconditioner="soap"),
        ValueError,
        r"Invalid preconditioner='soap': must be one of \('root_inverse', 'eigenvalue_corrected'\)",
    ),
    (
        dict(root_inv_config="eigh"),
        TypeError,
        r"Invalid root_inv_config='eigh': must be EigenConfig",
    ),
    (
        dict(root_inv_config=EigenConfig(pseudo_inverse=True)),
        ValueError,
        r"Invalid epsilon=1e-12: must be 0.0 with EigenConfig\(pseudo_inverse=True\)",
    ),
    (
        dict(factor_dtype=torch.float16),
        ValueError,
        r"Invalid factor_dtype=torch.float16: must be None",
    ),
    (dict(communication_dtype=torch.int32), ValueError, r"Invalid communication_dtype=torch.int32"),
]


@pytest.mark.parametrize(("kwargs", "exc", "match"), BAD)
def test_bad_arguments_are_named(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        Shampoo(_model(torch.float32).parameters(), **kwargs)


def test_bad_config_fields_are_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"Invalid AdamGraftingConfig.beta2=1.0: must be a finite number in \(0, 1\)",
    ):
        AdamGraftingConfig(beta2=1.0)
    with pytest.raises(ValueError, match=r"Invalid RMSpropGraftingConfig.epsilon=0.0"):
        RMSpropGraftingConfig(epsilon=0.0)
    with pytest.raises(ValueError, match=r"Invalid AdaGradGraftingConfig.epsilon=-1"):
        AdaGradGraftingConfig(epsilon=-1)
    with pytest.raises(
        TypeError, match=r"Invalid AdaGradGraftingConfig.epsilon='x': must be a finite number"
    ):
        AdaGradGraftingConfig(epsilon="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid CoupledNewtonConfig.max_iterations=0"):
        CoupledNewtonConfig(max_iterations=0)
    with pytest.raises(ValueError, match=r"Invalid CoupledNewtonConfig.tolerance=0.0"):
        CoupledNewtonConfig(tolerance=0.0)
    with pytest.raises(ValueError, match=r"Invalid EigenConfig.rank_rtol=2.0"):
        EigenConfig(rank_rtol=2.0)
    with pytest.raises(TypeError, match=r"Invalid EigenConfig.pseudo_inverse=1"):
        EigenConfig(pseudo_inverse=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Invalid EigenConfig.retry_double_precision=0"):
        EigenConfig(retry_double_precision=0)  # type: ignore[arg-type]
    from secondorder.shampoo.config import config_from_dict

    with pytest.raises(
        ValueError, match=r"cannot rebuild a Shampoo configuration from \{'type': 'Nope'\}"
    ):
        config_from_dict({"type": "Nope"})


def test_unset_start_follows_a_later_precondition_frequency() -> None:
    kw: dict[str, Any] = dict(max_preconditioner_dim=4, grafting_config=AdamGraftingConfig())
    pa, oa, _, _ = _twins((6, 5), precondition_frequency=1, **kw)
    _, _, pb, ob = _twins((6, 5), precondition_frequency=3, **kw)
    assert oa.param_groups[0]["start_preconditioning_step"] is None
    oa.param_groups[0]["precondition_frequency"] = 3  # the start (unset) moves to 3 too
    gen = torch.Generator().manual_seed(4)
    for _ in range(7):
        g = [
            torch.randn(6, 5, generator=gen, dtype=torch.float64),
            torch.randn(6, generator=gen, dtype=torch.float64),
        ]
        _step_both([(pa, oa), (pb, ob)], g)
    for a, b in zip(pa, pb, strict=True):
        assert torch.equal(a, b)
    _assert_same_state_dict(oa.state_dict(), ob.state_dict())
    assert oa.state_dict()["param_groups"][0]["start_preconditioning_step"] is None
    # An explicit start is still checked against the new frequency, naming both.
    oa.param_groups[0]["start_preconditioning_step"] = 4
    oa.param_groups[0]["precondition_frequency"] = 5
    with pytest.raises(
        ValueError,
        match=r"Invalid start_preconditioning_step=4: must be >= precondition_frequency=5",
    ):
        oa.step()


def test_structural_change_after_first_step_and_integer_params_are_refused() -> None:
    m = _model(torch.float32)
    opt = Shampoo(m.parameters())
    _train(m, lambda ps: opt, 1, torch.float32)
    opt.param_groups[0]["max_preconditioner_dim"] = 2
    with pytest.raises(
        ValueError, match=r"param_groups\[0\] changed one of \('max_preconditioner_dim'"
    ):
        _train(m, lambda ps: opt, 1, torch.float32)
    with pytest.raises(
        TypeError,
        match=r"Shampoo optimizes floating-point parameters; got one of dtype torch.int64",
    ):
        Shampoo([torch.zeros(3, dtype=torch.int64)])
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(TypeError, match="does not support sparse gradients"):
        Shampoo([p]).step()
    p.grad = torch.full((3,), float("inf"))
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        Shampoo([p]).step()


def test_parameters_without_gradient_are_skipped_within_a_batch() -> None:
    # w1, w2, w3 share one block shape, so they share a batch; w2 never gets a gradient.
    torch.manual_seed(3)
    w1, w2, w3 = (nn.Parameter(torch.randn(4, 4, dtype=torch.float64)) for _ in range(3))
    v1, v3 = nn.Parameter(w1.detach().clone()), nn.Parameter(w3.detach().clone())
    w2_before = w2.detach().clone()
    kw: dict[str, Any] = dict(max_preconditioner_dim=4, grafting_config=AdamGraftingConfig())
    oa, ob = Shampoo([w1, w2, w3], **kw), Shampoo([v1, v3], **kw)
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(4):
        for o, (a, b) in ((oa, (w1, w3)), (ob, (v1, v3))):
            o.zero_grad()
            (x @ a @ b).square().mean().backward()
            o.step()
    assert [len(b.blocks) for b in oa._batches] == [3]
    assert torch.equal(w1, v1) and torch.equal(w3, v3)
    assert torch.equal(w2, w2_before)
    assert not oa.state[w2]["block0.factor0"].any()


def test_named_parameters_name_the_culprit() -> None:
    m = _model(torch.float32)
    opt = Shampoo(m.named_parameters())
    x, y = _data(torch.float32)
    ((m(x) - y) ** 2).mean().backward()
    m[0].bias.grad[0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"parameter '0.bias' \(shape \(5,\)\)"):
        opt.step()


def test_soap_keeps_the_filter_in_the_eigenbasis_and_derives_it_when_missing() -> None:
    # Between refreshes SOAP carries M rotated into the eigenbasis by linearity; a state
    # dict saved without that entry (an older one) gets it rotated from filtered_grad.
    dtype = torch.float64
    kw: dict[str, Any] = dict(
        lr=0.01, betas=(0.9, 0.99), preconditioner="eigenvalue_corrected", precondition_frequency=3
    )
    x, y = _data(dtype)
    a, b = _model(dtype), _model(dtype)
    oa = Shampoo(a.parameters(), **kw)
    for _ in range(4):
        oa.zero_grad()
        ((a(x) - y) ** 2).mean().backward()
        oa.step()
    sd = oa.state_dict()
    p0 = next(a.parameters())
    kept = oa.state[p0]["block0.filtered_grad_eigenbasis"].clone()
    basis = [oa.state[p0][f"block0.eigenvectors{k}"] for k in range(kept.ndim)]
    rotated = oa.state[p0]["block0.filtered_grad"]
    for Q in basis:
        rotated = torch.tensordot(rotated, Q, dims=([0], [0]))
    torch.testing.assert_close(kept, rotated, rtol=0, atol=1e-14)
    for pstate in sd["state"].values():
        for key in [k for k in pstate if k.endswith("filtered_grad_eigenbasis")]:
            del pstate[key]
    b.load_state_dict(a.state_dict())
    ob = Shampoo(b.parameters(), **kw)
    ob.load_state_dict(sd)
    torch.testing.assert_close(
        ob.state[next(b.parameters())]["block0.filtered_grad_eigenbasis"], kept, rtol=0, atol=1e-14
    )
    # two more steps, the second refreshing the basis (a later one may magnify the
    # derived entry's last-bit difference: this small factor is rank deficient)
    for m, o in ((a, oa), (b, ob)):
        for _ in range(2):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-12)
