"""Preconditioned gradients against explicit Kronecker solves; KL clip; schedules; state."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from secondorder.kfac import KFAC, KFACOptimizer

DT = torch.float64


class Mixed(nn.Module):
    """Embedding → grouped Conv1d → Linear: every kind of layer in one model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(6, 4)
        self.conv = nn.Conv1d(4, 4, 3, groups=2, padding=1)
        self.fc = nn.Linear(4 * 5, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).transpose(1, 2)
        return self.fc(torch.relu(self.conv(h)).flatten(1))


def batch(n: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (n, 5), generator=g), torch.randn(n, 2, generator=g, dtype=DT)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((model(x) - y) ** 2).sum(1).mean()


def vec(m: torch.Tensor) -> torch.Tensor:
    return m.T.reshape(-1)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_preconditioned_gradient_equals_kronecker_solve(method: str) -> None:
    model = Mixed().to(DT)
    k = KFAC(
        model, factor_decay=0.5, kl_clip=None, inv_dtype=DT, compute_method=method, damping=0.3
    )
    x, y = batch()
    loss_of(model, x, y).backward()
    raw = {n: k.layers[n].grad().clone() for n in k.layers}  # type: ignore[union-attr]
    k.step()
    lam = 0.3
    for name, layer in k.layers.items():
        assert layer.A is not None and layer.G is not None
        got = layer.grad()
        assert got is not None
        for grp in range(raw[name].shape[0]):
            A = torch.diag(layer.A[grp]) if layer.A.ndim == 2 else layer.A[grp]
            G = layer.G[grp]
            ia, ig = torch.eye(A.shape[0], dtype=DT), torch.eye(G.shape[0], dtype=DT)
            if method == "eigen":
                M = torch.kron(A, G) + lam * torch.eye(A.shape[0] * G.shape[0], dtype=DT)
            else:
                M = torch.kron(A + lam * ia, G + lam * ig)
            expect = torch.linalg.solve(M, vec(raw[name][grp]))
            torch.testing.assert_close(vec(got[grp]), expect, rtol=1e-10, atol=1e-12)


def test_kl_clip_closed_form() -> None:
    x, y = batch()
    grads = {}
    for clip in (None, 1e-6, 1e6):
        model = Mixed().to(DT)
        k = KFAC(model, kl_clip=clip, lr=0.5, inv_dtype=DT)
        loss_of(model, x, y).backward()
        raw = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        k.step()
        grads[clip] = ([p.grad.clone() for p in model.parameters()], raw, k.last_nu)  # type: ignore[union-attr]
    pre, raw, _ = grads[None]
    vg = 0.5**2 * sum(float((p * g).sum()) for p, g in zip(pre, raw, strict=True))
    nu = math.sqrt(1e-6 / abs(vg))
    assert nu < 1  # the clip is active in this case
    for got, p in zip(grads[1e-6][0], pre, strict=True):
        torch.testing.assert_close(got, nu * p, rtol=1e-12, atol=1e-15)
    assert grads[1e6][2] == 1.0
    for got, p in zip(grads[1e6][0], pre, strict=True):
        assert torch.equal(got, p)


def test_callable_hyperparameters_are_read_at_each_step() -> None:
    x, y = batch()
    sched = KFAC(Mixed().to(DT), damping=lambda s: 0.1 * (s + 1), inv_dtype=DT)
    assert sched.damping == pytest.approx(0.1)
    m1, m2 = Mixed().to(DT), Mixed().to(DT)
    k1 = KFAC(m1, damping=lambda s: 0.1 * (s + 1), kl_clip=lambda s: None, inv_dtype=DT)
    k2 = KFAC(m2, damping=0.1, kl_clip=None, inv_dtype=DT)
    for m, k in ((m1, k1), (m2, k2)):
        loss_of(m, x, y).backward()
        k.step()
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert k1.damping == pytest.approx(0.2)


def test_update_intervals() -> None:
    model = Mixed().to(DT)
    k = KFAC(model, factor_update_steps=2, inv_update_steps=3, inv_dtype=DT)
    seen_A, seen_Q = [], []
    for step in range(4):
        model.zero_grad()
        x, y = batch(seed=step)
        loss_of(model, x, y).backward()
        k.step()
        seen_A.append(k.layers["fc"].A.clone())  # type: ignore[union-attr]
        seen_Q.append(k.layers["fc"].inv["QA"].clone())
    assert torch.equal(seen_A[0], seen_A[1]) and not torch.equal(seen_A[1], seen_A[2])
    assert torch.equal(seen_Q[0], seen_Q[2]) and not torch.equal(seen_Q[2], seen_Q[3])


def test_in_place_activation_after_linear() -> None:
    x = torch.randn(5, 3, dtype=DT)
    out = []
    for inplace in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=inplace), nn.Linear(4, 1)).to(DT)
        k = KFAC(m, inv_dtype=DT)
        m(x).pow(2).mean().backward()
        k.step()
        out.append((k.layers["0"].G, m[0].weight.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_summary_lists_preconditioned_and_plain_layers() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    k = KFAC(model, skip_layers=["2"])
    assert list(k.layers) == ["0"]
    assert k.skipped == {"1": "LayerNorm is not supported", "2": "in skip_layers"}
    text = k.summary()
    assert "0" in text and "LayerNorm is not supported" in text and "A (1, 4, 4)" in text


def test_multihead_attention_out_proj_is_skipped_not_broken() -> None:
    class Att(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.attn(x, x, x)[0])

    model = Att()
    k = KFAC(model)
    assert k.skipped["attn.out_proj"] == "weight used functionally by its parent"
    model(torch.randn(2, 3, 4)).sum().backward()
    k.step()  # no error: only fc is preconditioned


def test_functional_use_of_a_layer_is_named_before_anything_changes() -> None:
    class Fn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.other = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.fc.weight, self.fc.bias) + self.other(x)

    model = Fn()
    k = KFAC(model)
    model(torch.randn(4, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(
        RuntimeError,
        match=r"K-FAC layer 'fc' \(Linear\) has a gradient but its forward hook did not "
        r"fire.*skip_layers=\['fc'\]",
    ):
        k.step()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    assert k.steps == 0 and k.layers["other"].A is None


def test_frozen_layer_warns_and_keeps_no_gradient() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    k = KFAC(model)
    model[0].requires_grad_(False)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.warns(RuntimeWarning, match=r"K-FAC layer '0' has no gradient at step 0"):
        k.step()
    assert k.layers["2"].A is not None


def test_grad_scaler_factors_are_unscaled_and_overflow_skips() -> None:
    x = torch.randn(6, 3)
    y = torch.randn(6, 2)
    res = []
    for scale in (None, 1024.0):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
        k = KFAC(m, grad_scaler=scaler)
        loss = ((m(x) - y) ** 2).mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        k.step()
        res.append((k.layers["2"].G.clone(), m[2].weight.grad.clone()))  # type: ignore[union-attr]
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-5, atol=1e-7)

    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=3e38)
    k = KFAC(m, grad_scaler=scaler)
    scaler.scale(((m(x) - y) ** 2).mean() * 1e3).backward()
    k.step()
    assert k.skipped_factor_updates == 1
    # the factors are still the identity they start from
    assert torch.equal(k.layers["2"].A, torch.eye(5).unsqueeze(0))


def run(model: nn.Module, opt: KFACOptimizer, steps: range) -> None:
    for s in steps:
        x, y = batch(seed=s)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


def test_state_dict_resume_is_bitwise() -> None:
    kw = dict(lr=0.05, momentum=0.9, inv_update_steps=3, factor_update_steps=2, inv_dtype=DT)
    a = Mixed().to(DT)
    opt_a = KFACOptimizer(a, **kw)  # type: ignore[arg-type]
    run(a, opt_a, range(4))
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = Mixed().to(DT)
    opt_b = KFACOptimizer(b, **kw)  # type: ignore[arg-type]
    b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    run(a, opt_a, range(4, 9))
    run(b, opt_b, range(4, 9))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_kfac_optimizer_equals_kfac_then_sgd() -> None:
    a, b = Mixed().to(DT), Mixed().to(DT)
    opt_a = KFACOptimizer(a, lr=0.05, momentum=0.9, inv_dtype=DT)
    k = KFAC(b, lr=0.05, inv_dtype=DT)
    sgd = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    for s in range(3):
        x, y = batch(seed=s)
        opt_a.zero_grad()
        sgd.zero_grad()
        loss_of(a, x, y).backward()
        loss_of(b, x, y).backward()
        opt_a.step()
        k.step()
        sgd.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_evaluation_forwards_do_not_touch_the_factors() -> None:
    x, y = batch()
    ref = Mixed().to(DT)
    k_ref = KFAC(ref, inv_dtype=DT)
    loss_of(ref, x, y).backward()
    k_ref.step()
    model = Mixed().to(DT)
    k = KFAC(model, inv_dtype=DT)
    model.eval()
    model(batch(seed=5)[0])  # eval mode, grad enabled
    model.train()
    with torch.no_grad():
        model(batch(seed=6)[0])
    loss_of(model, x, y).backward()
    k.step()
    for name in k.layers:
        assert torch.equal(k.layers[name].A, k_ref.layers[name].A)
        assert torch.equal(k.layers[name].G, k_ref.layers[name].G)
