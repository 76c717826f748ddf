"""Kronecker factors against exact oracles: torch.func per-sample gradients, explicit patches."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from secondorder.kfac import KFAC
from secondorder.kfac.layers import conv_patches

DT = torch.float64


def vec(m: torch.Tensor) -> torch.Tensor:
    """Column-stacking vec, the order in which vec(g aᵀ) = a ⊗ g."""
    return m.T.reshape(-1)


def linear_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(DT)


def per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return 0.5 * ((out - yi.unsqueeze(0)) ** 2).sum()

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def kfac_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: object) -> KFAC:
    k = KFAC(model, factor_decay=0.0, inv_dtype=DT, kl_clip=None, **kw)  # type: ignore[arg-type]
    model.zero_grad()
    loss = 0.5 * ((model(x) - y) ** 2).sum(dim=1).mean()
    loss.backward()
    k.step()
    return k


def extended(gw: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
    return torch.cat([gw, gb.unsqueeze(-1)], dim=-1)


def test_one_sample_kron_equals_exact_fisher_block() -> None:
    model = linear_net()
    x, y = torch.randn(1, 3, dtype=DT), torch.randn(1, 2, dtype=DT)
    ps = per_sample_grads(model, x, y)
    k = kfac_step(model, x, y)
    for i in ("0", "1"):
        gext = extended(ps[f"{i}.weight"][0], ps[f"{i}.bias"][0])
        fisher = torch.outer(vec(gext), vec(gext))  # exact block of ∇ℓ ∇ℓᵀ
        layer = k.layers[i]
        assert layer.A is not None and layer.G is not None
        torch.testing.assert_close(
            torch.kron(layer.A[0], layer.G[0]), fisher, rtol=1e-12, atol=1e-14
        )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_factors_are_per_sample_means_and_expand_the_fisher(reduction: str) -> None:
    model = linear_net()
    n = 6
    x, y = torch.randn(n, 3, dtype=DT), torch.randn(n, 2, dtype=DT)
    ps = per_sample_grads(model, x, y)
    k = KFAC(model, factor_decay=0.0, inv_dtype=DT, kl_clip=None, loss_reduction=reduction)
    per = 0.5 * ((model(x) - y) ** 2).sum(dim=1)
    (per.mean() if reduction == "mean" else per.sum()).backward()
    k.step()
    inputs = {"0": x, "1": model[0](x).detach()}
    for i in ("0", "1"):
        a = torch.cat([inputs[i], torch.ones(n, 1, dtype=DT)], dim=1)
        g = ps[f"{i}.bias"]  # per-sample output gradient = per-sample bias gradient
        layer = k.layers[i]
        assert layer.A is not None and layer.G is not None
        torch.testing.assert_close(layer.A[0], a.T @ a / n, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(layer.G[0], g.T @ g / n, rtol=1e-12, atol=1e-14)
        # the documented expansion: the exact empirical Fisher block is the mean of
        # per-sample Kronecker products; K-FAC replaces it by the product of the means
        gext = extended(ps[f"{i}.weight"], ps[f"{i}.bias"])
        fisher = sum(torch.outer(vec(gext[j]), vec(gext[j])) for j in range(n)) / n
        expansion = (
            sum(torch.kron(torch.outer(a[j], a[j]), torch.outer(g[j], g[j])) for j in range(n)) / n
        )
        torch.testing.assert_close(fisher, expansion, rtol=1e-12, atol=1e-14)


def test_factors_do_not_depend_on_batch_size() -> None:
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    k1 = kfac_step(linear_net(), x, y)
    k2 = kfac_step(linear_net(), x.repeat(3, 1), y.repeat(3, 1))
    for i in ("0", "1"):
        torch.testing.assert_close(k1.layers[i].G, k2.layers[i].G, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(k1.layers[i].A, k2.layers[i].A, rtol=1e-12, atol=1e-14)


def test_accumulation_equals_one_big_batch() -> None:
    x, y = torch.randn(8, 3, dtype=DT), torch.randn(8, 2, dtype=DT)
    big = kfac_step(linear_net(), x, y)
    model = linear_net()
    k = KFAC(model, factor_decay=0.0, inv_dtype=DT, kl_clip=None, accumulation_steps=2)
    for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
        (0.5 * ((model(xs) - ys) ** 2).sum(dim=1).mean() / 2).backward()
    k.step()
    for i in ("0", "1"):
        torch.testing.assert_close(k.layers[i].G, big.layers[i].G, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(k.layers[i].A, big.layers[i].A, rtol=1e-12, atol=1e-14)
    # and the preconditioned gradient is the same too
    torch.testing.assert_close(model[0].weight.grad, big_grad(x, y), rtol=1e-10, atol=1e-12)


def big_grad(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model = linear_net()
    kfac_step(model, x, y)
    assert model[0].weight.grad is not None
    return model[0].weight.grad


def test_running_average_starts_at_identity() -> None:
    model = linear_net()
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)
    k = KFAC(model, factor_decay=0.75, inv_dtype=DT)
    (0.5 * ((model(x) - y) ** 2).sum(dim=1).mean()).backward()
    k.step()
    a = torch.cat([x, torch.ones(4, 1, dtype=DT)], 1)
    expect = 0.75 * torch.eye(4, dtype=DT) + 0.25 * a.T @ a / 4
    torch.testing.assert_close(k.layers["0"].A[0], expect, rtol=1e-12, atol=1e-14)


# -- convolutions ---------------------------------------------------------------------
def reference_patches(conv: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(N, positions, C·k) by explicit slicing of the padded input, no unfold."""
    nd = x.ndim - 2
    ks, st, dl = conv.kernel_size, conv.stride, conv.dilation
    if conv.padding == "same":
        pads = []
        for d in range(nd):
            total = dl[d] * (ks[d] - 1)
            pads.append((total // 2, total - total // 2))
    else:
        pads = [(p, p) for p in conv.padding]  # type: ignore[union-attr]
    flat = [v for pr in reversed(pads) for v in pr]
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, flat, mode=mode)
    span = [dl[d] * (ks[d] - 1) + 1 for d in range(nd)]
    outs = [(xp.shape[2 + d] - span[d]) // st[d] + 1 for d in range(nd)]
    rows = []
    for pos in itertools.product(*[range(o) for o in outs]):
        sl = [slice(pos[d] * st[d], pos[d] * st[d] + span[d], dl[d]) for d in range(nd)]
        rows.append(xp[(slice(None), slice(None), *sl)].reshape(x.shape[0], -1))
    return torch.stack(rows, dim=1)


CONV_CASES = [
    (1, dict(kernel_size=3)),
    (1, dict(kernel_size=4, stride=2, padding=1)),
    (1, dict(kernel_size=3, dilation=2, padding="same", padding_mode="reflect")),
    (1, dict(kernel_size=4, padding="same")),  # even kernel: asymmetric "same" padding
    (1, dict(kernel_size=3, groups=2, padding=2, padding_mode="circular", bias=False)),
    (2, dict(kernel_size=3)),
    (2, dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2))),
    (2, dict(kernel_size=3, padding="same", padding_mode="reflect", dilation=2)),
    (2, dict(kernel_size=3, groups=2, stride=2, padding=1, padding_mode="replicate")),
    (2, dict(kernel_size=2, padding="same", groups=4)),
]


# torch warns that an even "same" kernel copies the input; the copy is what we test
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize(("nd", "kw"), CONV_CASES)
def test_conv_factors_equal_explicit_patch_reference(nd: int, kw: dict[str, object]) -> None:
    torch.manual_seed(1)
    conv = (nn.Conv1d if nd == 1 else nn.Conv2d)(4, 4, **kw).to(DT)  # type: ignore[arg-type]
    n = 3
    x = torch.randn(n, 4, *([9] * nd), dtype=DT)
    out = conv(x)
    head = nn.Linear(out[0].numel(), 2).to(DT)
    y = torch.randn(n, 2, dtype=DT)
    model = nn.Sequential(conv, nn.Flatten(), head)

    # (1) the patches reproduce the convolution exactly
    g = conv.groups
    p = conv_patches(conv, x)  # (N, C·k, L)
    w = conv.weight.reshape(g, 4 // g, -1)
    pg = p.reshape(n, g, -1, p.shape[-1])
    recon = torch.einsum("gok,ngkl->ngol", w, pg).reshape(n, 4, -1)
    if conv.bias is not None:
        recon = recon + conv.bias.view(1, -1, 1)
    torch.testing.assert_close(recon, out.reshape(n, 4, -1), rtol=1e-12, atol=1e-12)

    k = KFAC(model, factor_decay=0.0, inv_dtype=DT, kl_clip=None, modules=["0"])
    loss = 0.5 * ((model(x) - y) ** 2).sum(dim=1).mean()
    loss.backward()
    gw = conv.weight.grad.clone()  # type: ignore[union-attr]
    k.step()

    # (2) A against patches cut by explicit slicing
    ref = reference_patches(conv, x)  # (N, L, C·k)
    length = ref.shape[1]
    ref = ref.reshape(n, length, g, -1).permute(2, 0, 1, 3).reshape(g, n * length, -1)
    if conv.bias is not None:
        ref = torch.cat([ref, torch.ones(g, n * length, 1, dtype=DT)], dim=2)
    layer = k.layers["0"]
    assert layer.A is not None and layer.G is not None
    torch.testing.assert_close(layer.A, ref.mT @ ref / (n * length), rtol=1e-12, atol=1e-12)

    # (3) G against per-sample output gradients from torch.func
    def loss_one(o: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((head(o.reshape(1, -1)) - yi) ** 2).sum()

    go = vmap(grad(loss_one))(out.detach(), y).reshape(n, g, 4 // g, -1)
    rows = go.permute(1, 0, 3, 2).reshape(g, -1, 4 // g)
    torch.testing.assert_close(layer.G, rows.mT @ rows / n, rtol=1e-12, atol=1e-12)
    # (4) the layout is the gradient's: Σ g aᵀ / N is the mean-loss weight gradient
    a_rows = ref[..., : ref.shape[-1] - int(conv.bias is not None)]
    recon_grad = (rows.mT @ a_rows) / n
    torch.testing.assert_close(recon_grad.reshape(gw.shape), gw, rtol=1e-10, atol=1e-12)


def test_embedding_factor_is_the_token_frequency_diagonal() -> None:
    torch.manual_seed(2)
    emb = nn.Embedding(5, 3).to(DT)
    head = nn.Linear(3, 1).to(DT)
    idx = torch.tensor([[0, 1, 1], [4, 4, 4]])
    y = torch.randn(2, 1, dtype=DT)
    k = KFAC(nn.ModuleDict({"e": emb, "h": head}), factor_decay=0.0, inv_dtype=DT, kl_clip=None)
    out = emb(idx)
    (0.5 * ((head(out.sum(1)) - y) ** 2).sum(1).mean()).backward()
    k.step()
    counts = torch.tensor([1, 2, 0, 0, 3], dtype=DT) / 6
    torch.testing.assert_close(k.layers["e"].A[0], counts, rtol=1e-12, atol=1e-14)

    def loss_one(o: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((head(o.sum(0, keepdim=True)) - yi) ** 2).sum()

    go = vmap(grad(loss_one))(out.detach(), y).reshape(-1, 3)
    torch.testing.assert_close(k.layers["e"].G[0], go.T @ go / 2, rtol=1e-12, atol=1e-14)


def test_porting_rule_from_kaisas_scaling() -> None:
    """The documented rule: KAISA's (λ, kl_clip c) is our (B²λ, B²c) for Linear layers.

    KAISA's G is built from the mean-loss output gradient ∂L/∂s (one row per sample):
    G_K = 1/B Σ (∂L/∂s_n)(∂L/∂s_n)ᵀ.  Its eigen-method step, clipped, is computed here
    from that definition and must equal ours with the ported settings.
    """
    torch.manual_seed(4)
    b, lam_k, clip_k, lr = 8, 1e-3, 1e-6, 0.1
    layer = nn.Linear(3, 2).to(DT)
    x, y = torch.randn(b, 3, dtype=DT), torch.randn(b, 2, dtype=DT)
    out = layer(x)
    out.retain_grad()
    (0.5 * ((out - y) ** 2).sum(1).mean()).backward()
    ds = out.grad
    assert ds is not None and layer.weight.grad is not None and layer.bias.grad is not None
    a = torch.cat([x, torch.ones(b, 1, dtype=DT)], 1)
    A, G_k = a.T @ a / b, ds.T @ ds / b
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    P = torch.linalg.solve(torch.kron(A, G_k) + lam_k * torch.eye(8, dtype=DT), vec(grad))
    nu = min(1.0, (clip_k / abs(lr**2 * float(P @ vec(grad)))) ** 0.5)
    # our ν is B²·ν_K: the rule covers runs where our clip is active too
    assert nu * b**2 < 1
    kaisa_step = (nu * P).reshape(4, 2).T

    k = KFAC(
        layer, factor_decay=0.0, damping=b**2 * lam_k, kl_clip=b**2 * clip_k, lr=lr, inv_dtype=DT
    )
    layer.zero_grad()
    (0.5 * ((layer(x) - y) ** 2).sum(1).mean()).backward()
    k.step()
    ours = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    torch.testing.assert_close(ours, kaisa_step, rtol=1e-10, atol=1e-14)


def test_factor_dtype_and_inv_dtype_are_kept_apart_from_the_gradient_dtype() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))  # float32
    k = KFAC(model, factor_dtype=torch.float64, inv_dtype=torch.float64)
    model(torch.randn(5, 3)).pow(2).mean().backward()
    k.step()
    assert k.layers["0"].A.dtype == torch.float64  # type: ignore[union-attr]
    assert k.layers["0"].inv["QA"].dtype == torch.float64
    assert model[0].weight.grad.dtype == torch.float32  # type: ignore[union-attr]
