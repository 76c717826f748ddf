"""K-FAC, Shampoo and SOAP on the device equal the same runs on the CPU, in float64.

Each run trains a small model (``Conv2d``, then ``Linear`` layers) with SGD under the
optimizer for a few steps from the same weights on the same batches.  Factors and
their inverses or eigenbases are float64, so the device and the CPU differ only by
the rounding of their kernels (cuBLAS and cuSOLVER against the CPU's LAPACK),
amplified by the damped factors' conditioning: 1e-8 relative (1e-6 for SOAP, see
:data:`SOAP_RTOL`) would still catch any error in the mathematics (a missing factor
of the batch size, a transposed factor), which changes the parameters at the percent
level.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cuda_cases import F64, assert_close_params, flat
from torch import nn

import secondorder as so

pytestmark = pytest.mark.cuda

STEPS = 5
RTOL = 1e-8


class Net(nn.Module):
    """Conv2d(2→3, 3×3, padding 1) → tanh → Linear(3·4·4 → 6) → tanh → Linear(6 → 2)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc1 = nn.Linear(3 * 4 * 4, 6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h)))


def batches(count: int = STEPS, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randn(size, 2, 4, 4, generator=g, dtype=F64),
            torch.randint(0, 2, (size,), generator=g),
        )
        for _ in range(count)
    ]


def train_kfac(device: torch.device | str, compute_method: str) -> torch.Tensor:
    model = Net().to(F64).to(device)
    kfac = so.KFAC(
        model,
        damping=0.05,
        kl_clip=1e-2,
        lr=0.1,
        compute_method=compute_method,
        factor_dtype=F64,
        inv_dtype=F64,
    )
    assert sorted(kfac.layers) == ["conv", "fc1", "fc2"], kfac.summary()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        sgd.zero_grad()
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        kfac.step()
        sgd.step()
    return flat(model)


@pytest.mark.parametrize("compute_method", ["eigen", "inverse"])
def test_kfac_on_the_device_equals_the_cpu(compute_method: str, device: torch.device) -> None:
    want = train_kfac("cpu", compute_method)
    got = train_kfac(device, compute_method)
    assert_close_params(got, want, RTOL, f"K-FAC ({compute_method}) + SGD on {device}")
    # The preconditioner did act: plain SGD from the same weights ends elsewhere.
    sgd_only = Net().to(F64)
    sgd = torch.optim.SGD(sgd_only.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        sgd.zero_grad()
        nn.functional.cross_entropy(sgd_only(x), y).backward()
        sgd.step()
    assert (flat(sgd_only) - want).norm() > 1e3 * RTOL * want.norm()


def train_shampoo(device: torch.device | str, options: dict[str, Any]) -> torch.Tensor:
    model = Net().to(F64).to(device)
    settings: dict[str, Any] = {
        "lr": 0.01,
        "betas": (0.9, 0.999),
        "epsilon": 1e-8,
        "precondition_frequency": 1,
        "start_preconditioning_step": 1,
        "factor_dtype": F64,
    }
    opt = so.Shampoo(model.parameters(), **{**settings, **options})
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return flat(model)


#: SOAP keeps Adam's second moment in the factors' eigenbasis, elementwise, so unlike
#: Shampoo's inverse roots its step depends on which eigenbasis ``eigh`` returns, and
#: a factor that is still singular (the bias of ``fc1`` gains rank one per step) has
#: no unique one: where the factor is zero the choice is arbitrary, and CPU and CUDA
#: choose differently.  On the CPU, an ``eigh`` computed in a rotated basis (an
#: equally valid decomposition) moves SOAP's parameters by 1.1e-9 (1.1e-8 on fc1's
#: bias), Shampoo's by 4e-13 and K-FAC's by 2e-16; hence SOAP's looser bound.
SOAP_RTOL = 1e-6
#: name -> (options, relative tolerance).
SHAMPOO_CASES: dict[str, tuple[dict[str, Any], float]] = {
    "shampoo": ({}, RTOL),
    "shampoo-adam-grafting": (
        {"grafting_config": so.AdamGraftingConfig(beta2=0.999, epsilon=1e-8)},
        RTOL,
    ),
    "soap": ({"preconditioner": "eigenvalue_corrected"}, SOAP_RTOL),
}


@pytest.mark.parametrize("name", list(SHAMPOO_CASES))
def test_shampoo_on_the_device_equals_the_cpu(name: str, device: torch.device) -> None:
    options, rtol = SHAMPOO_CASES[name]
    want = train_shampoo("cpu", options)
    got = train_shampoo(device, options)
    assert_close_params(got, want, rtol, f"{name} on {device}")
    # Preconditioning did happen from step 1: never preconditioning ends elsewhere.
    late = train_shampoo("cpu", {**options, "start_preconditioning_step": 10**9})
    assert (late - want).norm() > 1e3 * rtol * want.norm(), name
