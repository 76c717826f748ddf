"""What the hooks count: shared weights, extra forwards, padding, torch.func, eval and frozen.

References: the same layer written as one call over positions, factors built by hand
from the output gradients (``torch.autograd.grad`` of the per-sample losses), and a
K-FAC that never saw the extra call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from secondorder.kfac import KFAC

DT = torch.float64


def same_state(a: Any, b: Any) -> bool:
    """Bitwise equality of two (nested) state dicts."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    return bool(a == b)


class Twice(nn.Module):
    """One Linear called on both halves of the input (weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 2).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.l(x[:, 0]) + self.l(x[:, 1])


class Positions(nn.Module):
    """The same computation as one call over 2 positions."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 2).to(DT)

    def forward(self, x: Tensor) -> Tensor:
        return self.l(x).sum(1)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_weight_sharing_equals_one_call_over_positions(micro_batches: int) -> None:
    torch.manual_seed(0)
    m1, m2 = Twice(), Positions()
    m2.load_state_dict(m1.state_dict())
    kw: dict[str, Any] = dict(
        factor_decay=0.0, kl_clip=None, inv_dtype=DT, accumulation_steps=micro_batches
    )
    k1, k2 = KFAC(m1, **kw), KFAC(m2, **kw)
    x = torch.randn(6, 2, 3, dtype=DT)
    for m in (m1, m2):
        for c in x.chunk(micro_batches):
            (m(c).pow(2).sum(1).mean() / micro_batches).backward()
    k1.step()
    k2.step()
    l1, l2 = k1.layers["l"], k2.layers["l"]
    assert l1.A is not None and l2.A is not None and l1.G is not None and l2.G is not None
    torch.testing.assert_close(l1.A, l2.A, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(l1.G, l2.G, rtol=1e-13, atol=1e-13)
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        assert p1.grad is not None and p2.grad is not None
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-12, atol=1e-13)
    # and the reference itself: G = 1/N Σ_{n,p} g gᵀ with g = N ∂L/∂s per position
    s = m2.l(x)
    (gs,) = torch.autograd.grad(s.sum(1).pow(2).sum(1).sum(), s)  # per-sample losses summed
    rows = gs.reshape(-1, 2)
    torch.testing.assert_close(l2.G[0], rows.T @ rows / 6, rtol=1e-13, atol=1e-13)


def test_extra_train_mode_forward_is_left_out_of_the_factors() -> None:
    # A forward that is never backpropagated (a metric in training mode) enters
    # neither factor: the result is bitwise that of a K-FAC that never saw it.
    def run(extra: bool) -> tuple[dict[str, Any], list[Tensor]]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(DT)
        k = KFAC(net, factor_decay=0.5, kl_clip=None)
        for _ in range(2):
            net.zero_grad()
            x = torch.randn(5, 3, dtype=DT)
            net(x).pow(2).sum(1).mean().backward()
            metric = torch.randn(7, 3, dtype=DT) * 100
            if extra:
                net(metric)  # a metric in training mode, no backward
            k.step()
        return k.state_dict(), [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]

    state, grads = run(extra=True)
    ref_state, ref_grads = run(extra=False)
    assert same_state(state, ref_state)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_extra_forwards_in_no_grad_or_eval_mode_leave_factors_alone() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(DT)
    k = KFAC(net, factor_decay=0.0, kl_clip=None)
    x = torch.randn(5, 3, dtype=DT)
    net(x).pow(2).sum(1).mean().backward()
    with torch.no_grad():
        net(torch.randn(7, 3, dtype=DT) * 100)
    net.eval()
    net(torch.randn(7, 3, dtype=DT) * 100)
    net.train()
    k.step()
    a = torch.cat([x, torch.ones(5, 1, dtype=DT)], 1)
    assert k.layers["0"].A is not None
    torch.testing.assert_close(k.layers["0"].A[0], a.T @ a / 5, rtol=1e-14, atol=1e-14)


def test_embedding_padding_positions_are_left_out_of_both_factors() -> None:
    torch.manual_seed(0)
    lam = 1e-2
    emb = nn.Embedding(5, 3, padding_idx=0).to(DT)
    k = KFAC(emb, factor_decay=0.0, kl_clip=None, damping=lam, inv_dtype=DT)
    idx = torch.tensor([[0, 0, 1, 2], [0, 3, 3, 1]])
    out = emb(idx)
    target = torch.randn_like(out)
    ((out - target) ** 2).sum((1, 2)).mean().backward()
    grad = emb.weight.grad.T.clone()  # type: ignore[union-attr]
    k.step()
    keep = idx != 0
    # by hand, on the non-padding positions only: token frequencies, per-sample G
    tokens = idx[keep]
    a_ref = torch.bincount(tokens, minlength=5).to(DT) / tokens.numel()
    g = (2 * (out.detach() - target))[keep]  # ∂ℓ_n/∂out at the kept positions
    g_ref = g.T @ g / 2
    layer = k.layers["<model>"]
    assert layer.A is not None and layer.G is not None
    torch.testing.assert_close(layer.A[0], a_ref, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(layer.G[0], g_ref, rtol=1e-13, atol=1e-13)
    assert float(layer.A[0, 0]) == 0.0
    fisher = torch.kron(torch.diag(a_ref), g_ref) + lam * torch.eye(15, dtype=DT)
    p_ref = torch.linalg.solve(fisher, grad.T.reshape(-1)).reshape(5, 3).T
    torch.testing.assert_close(emb.weight.grad.T, p_ref, rtol=1e-10, atol=1e-12)  # type: ignore[union-attr]


def test_torch_func_transforms_are_not_captured() -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)

    torch.manual_seed(1)
    x = torch.randn(5, 3, dtype=DT)
    used, plain = make(), make()
    k_used = KFAC(used, factor_decay=0.0, kl_clip=None, inv_dtype=DT)
    k_plain = KFAC(plain, factor_decay=0.0, kl_clip=None, inv_dtype=DT)
    params = {n: p.detach() for n, p in used.named_parameters()}

    def f(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(used, p, (xi[None],)).sum()

    # per-sample gradients (logging, clipping) between two training steps
    psg = vmap(grad(f), in_dims=(None, 0))(params, torch.randn(4, 3, dtype=DT))
    assert psg["0.weight"].shape == (4, 4, 3)
    for m, k in ((used, k_used), (plain, k_plain)):
        m(x).pow(2).sum(1).mean().backward()
        k.step()
    for name in ("0", "2"):
        assert same_state(k_used.layers[name].A, k_plain.layers[name].A)
        assert same_state(k_used.layers[name].G, k_plain.layers[name].G)
    for p, q in zip(used.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_eval_mode_model_gets_an_error_that_says_eval_mode() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    k = KFAC(net)
    net.eval()
    net(torch.randn(5, 3)).pow(2).sum().backward()
    with pytest.raises(
        RuntimeError, match=r"layer '0' \(Linear\) has a gradient but is in eval mode"
    ):
        k.step()


def test_detached_output_error_points_to_requires_grad() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    k = KFAC(net)
    x = torch.randn(5, 3)
    h = net[0](x)
    (net[1](h.detach()).sum() + 0.0 * net[0].weight.sum()).backward()
    with pytest.raises(
        RuntimeError,
        match=r"layer '0' \(Linear\) has a gradient and ran forward 1 time\(s\).*no gradient "
        r"reached its output.*set requires_grad=False",
    ):
        k.step()


def test_layer_frozen_mid_run_keeps_its_plain_gradient_with_a_warning() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    k = KFAC(net, kl_clip=None)
    x = torch.randn(5, 3)
    net(x).pow(2).sum().backward()
    k.step()
    net[0].requires_grad_(False)
    for p in net.parameters():
        assert p.grad is not None
        p.grad.zero_()  # zero_grad(set_to_none=False): the frozen layer keeps a zero .grad
    net(x).pow(2).sum().backward()
    frozen = [p.grad.clone() for p in net[0].parameters()]  # type: ignore[union-attr]
    last = net[2].weight.grad.clone()  # type: ignore[union-attr]
    with pytest.warns(RuntimeWarning, match=r"layer '0' has no gradient.*requires_grad=False"):
        k.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(net[0].parameters(), frozen, strict=True))
    assert not torch.equal(net[2].weight.grad, last)  # the other layer is still preconditioned
