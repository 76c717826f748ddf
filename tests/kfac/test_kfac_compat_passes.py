"""KAISA's drop-in on the passes where it differs from KAISA on purpose (as documented).

Micro-batches of different sizes weigh by their samples: with ``factor_decay=0`` the
factors after one step equal ``Σ a aᵀ / N`` and ``Σ g gᵀ / N`` over every sample of
every micro-batch, ``g`` the output gradient as backpropagated (KAISA's scale),
computed by hand from the inputs and output gradients that autograd keeps (not
KAISA's mean of the micro-batches' factors).  A training-mode forward under
``torch.no_grad()`` leaves the factors bitwise as a run without it (KAISA folds its
input into A).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from secondorder.compat.kfac import KAISAConventionWarning, KFACPreconditioner
from tests.kfac.faults import same, state_of

DT = torch.float64


def build(**kw: float) -> tuple[nn.Sequential, KFACPreconditioner]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KAISAConventionWarning)
        pre = KFACPreconditioner(net, inv_dtype=DT, factor_dtype=DT, damping=0.1, **kw)
    return net, pre


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g, dtype=DT), torch.randn(8, 3, generator=g, dtype=DT)


def test_unequal_micro_batches_weigh_by_their_samples() -> None:
    net, pre = build(factor_decay=0.0, accumulation_steps=2)
    x, y = data(0)
    rows_a: list[torch.Tensor] = []
    rows_g: list[torch.Tensor] = []
    for part in (slice(0, 6), slice(6, 8)):
        h = net[1](net[0](x[part]))
        h.retain_grad()
        out = net[2](h)
        out.retain_grad()
        (0.5 * (out - y[part]).pow(2).sum(1).mean() / 2).backward()
        ones = torch.ones(out.shape[0], 1, dtype=DT)
        rows_a.append(torch.cat([h.detach(), ones], 1))
        rows_g.append(out.grad)  # type: ignore[arg-type]
    pre.step()
    a, g = torch.cat(rows_a), torch.cat(rows_g)
    layer = pre.kfac.layers["2"]
    assert layer.A is not None and layer.G is not None
    torch.testing.assert_close(layer.A[0], a.T @ a / 8, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(layer.G[0], g.T @ g / 8, rtol=1e-12, atol=1e-14)
    # KAISA's rule, the mean of the two micro-batches' factors, is another matrix
    kaisa_g = (rows_g[0].T @ rows_g[0] / 6 + rows_g[1].T @ rows_g[1] / 2) / 2
    assert not torch.allclose(layer.G[0], kaisa_g, rtol=1e-3)


def test_a_no_grad_forward_in_training_mode_leaves_the_factors_alone() -> None:
    runs = []
    for metric in (False, True):
        net, pre = build()
        for i in range(3):
            x, y = data(i)
            net.zero_grad()
            (0.5 * (net(x) - y).pow(2).sum(1).mean()).backward()
            if metric:
                with torch.no_grad():
                    net(3 * data(10 + i)[0])
            pre.step()
        runs.append(state_of(pre.kfac, net))
    assert same(runs[0], runs[1])
