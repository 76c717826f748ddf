"""KAISA's drop-in refuses a checkpoint whose factors have another layer's shape.

Its ``state_dict`` holds each factor as KAISA saves it, ``(n, n)``, or ``(groups, n, n)``
for a grouped convolution.  A factor of the same number of values in another shape
(a grouped convolution's 4 blocks of 3 × 3 read as one 6 × 6 matrix, a flattened
factor) belongs to another model: it must be refused, naming the shape, before
anything changes.  Before, only the number of values was compared and the tensor
reshaped silently.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from secondorder.compat.kfac import KAISAConventionWarning, KFACPreconditioner
from tests.kfac.faults import same, state_of

DT = torch.float64


def trained(groups: int, channels: int) -> tuple[nn.Module, KFACPreconditioner]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(channels, channels, 1, groups=groups, bias=False)).to(DT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KAISAConventionWarning)
        pre = KFACPreconditioner(net, damping=0.1, inv_dtype=DT)
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        net.zero_grad()
        net(torch.randn(2, channels, 3, 3, generator=g, dtype=DT)).pow(2).sum().backward()
        pre.step()
    return net, pre


def test_a_grouped_convolutions_factors_are_refused_by_an_ungrouped_one() -> None:
    _, grouped = trained(groups=4, channels=12)  # A, G: (4, 3, 3), 36 values each
    net, plain = trained(groups=1, channels=6)  # A, G: (6, 6), 36 values each
    state = grouped.state_dict()
    assert state["layers"]["0"]["A"].shape == (4, 3, 3)
    before = state_of(plain.kfac, net)
    with pytest.raises(
        ValueError, match=r"factor A must be a tensor of shape \(6, 6\), got \(4, 3, 3\)"
    ):
        plain.load_state_dict(state)
    assert same(state_of(plain.kfac, net), before)


@pytest.mark.parametrize("shape", [(36,), (1, 36), (3, 12)])
def test_a_factor_of_the_right_size_in_another_shape_is_refused(shape: tuple[int, ...]) -> None:
    net, pre = trained(groups=1, channels=6)
    state = copy.deepcopy(pre.state_dict())
    state["layers"]["0"]["G"] = state["layers"]["0"]["G"].reshape(shape)
    before = state_of(pre.kfac, net)
    got = re.escape(str(shape))
    want = rf"factor G must be a tensor of shape \(6, 6\), got {got};"
    with pytest.raises(ValueError, match=want):
        pre.load_state_dict(state)
    assert same(state_of(pre.kfac, net), before)
    # the (n, n) and (1, n, n) forms load
    for form in (state["layers"]["0"]["G"].reshape(6, 6), pre.kfac.layers["0"].G):
        state["layers"]["0"]["G"] = form
        pre.load_state_dict(copy.deepcopy(state))
