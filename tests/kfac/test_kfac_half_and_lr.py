"""Learning rates that reach 0 and half-precision models.

References: ``KFAC`` followed by ``torch.optim.SGD`` under the same scheduler (what
``KFACOptimizer`` promises to equal), and the factors computed in float32 from the
same half-precision inputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from secondorder.kfac import KFAC, KFACOptimizer


def _cosine_run(combined: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    if combined:
        opt: torch.optim.Optimizer = KFACOptimizer(net, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        kfac = KFAC(net, lr=lambda _: opt.param_groups[0]["lr"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2, eta_min=0.0)
    out = []
    for i in range(4):  # lr: 0.1, 0.05, 0.0, 0.05
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        net(torch.randn(6, 3, generator=g)).pow(2).sum(1).mean().backward()
        if not combined:
            kfac.step()
        opt.step()
        sched.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return out


def test_scheduler_bringing_lr_to_zero_steps_like_kfac_then_sgd() -> None:
    # KFACOptimizer raised "Invalid lr=0.0" where torch.optim.SGD steps on
    got, want = _cosine_run(True), _cosine_run(False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[2], got[1])  # the lr = 0 step moves nothing


def test_negative_lr_is_still_refused() -> None:
    with pytest.raises(ValueError, match=r"Invalid lr=-0.1: must be a finite number >= 0"):
        KFAC(nn.Linear(2, 2), lr=-0.1)


def _half_run(dtype: torch.dtype, factor_dtype: torch.dtype | None) -> tuple[KFAC, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4)).to(dtype)
    k = KFAC(net, factor_decay=0.0, factor_dtype=factor_dtype)
    xs = []
    for _ in range(3):
        net.zero_grad()
        x = (torch.randn(256, 8) * 30).to(dtype)  # |a| ≈ 30: Σ a² ≈ 2e5 > float16's 65504
        net(x).float().pow(2).sum(1).mean().backward()
        k.step()
        xs.append(x)
    return k, xs[-1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_parameters_get_float32_factors_that_update(dtype: torch.dtype) -> None:
    # the float16 factor updates overflowed and were skipped, silently, 3 of 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k, x = _half_run(dtype, None)
    layer = k.layers["0"]
    assert layer.A is not None and layer.A.dtype == torch.float32
    assert k.skipped_factor_updates == 0
    a = torch.cat([x.float(), torch.ones(256, 1)], 1)
    torch.testing.assert_close(layer.A[0], a.T @ a / 256, rtol=1e-5, atol=1e-3)


def test_explicit_float16_factors_that_overflow_warn_and_are_counted() -> None:
    with pytest.warns(
        RuntimeWarning,
        match=r"K-FAC skipped the factor update of step [0-2]: the statistics of layers \['0'\] "
        r"are not finite \(factor_dtype torch.float16\).*factor_dtype=torch.float32",
    ):
        k, _ = _half_run(torch.float16, torch.float16)
    assert k.skipped_factor_updates == 3
