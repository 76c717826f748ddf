"""Several devices in one process, with CUDA among them, equal one device.

``devices=[cuda, cuda]``, ``[cuda, cpu]``, ``[cpu, cuda]`` and a CPU ``solver_device``
run the multi-device path with the CUDA copy streams and pinned host memory, with
the inputs arriving on the host or on the GPU and a ``slice_size`` that makes the
slices alternate between the devices.  The reference is the same optimizer with
``devices=None`` on the device under test, same slices, float64, same weights.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from cuda_cases import F64, RTOL, assert_close_params, assert_same_steps, flat, step_record
from torch import nn

import secondorder as so

pytestmark = pytest.mark.cuda

STEPS = 5
#: Every slice computed and solved on the device: only the order in which the
#: per-device Grams are added differs, and tests/distributed/test_devices.py's bounds
#: hold (there, 2 or 3 CPU devices move these parameters by at most 1.1e-11).
PARAM_RTOL = 1e-10
INFO_RTOL = 1e-9
#: Some slices computed, or the system solved, on the CPU: its kernels round unlike
#: the GPU's, as in the single-device comparisons (``cuda_cases.RTOL``).  Perturbing
#: the inputs by 2e-16 relative moves these runs' parameters by up to 6e-12.
MIXED_RTOL = RTOL
#: name -> (options, batch size, slice size): slices of 8 leave a last slice of 5,
#: slices of 3 a last slice of 2.
SCENARIOS: dict[str, tuple[dict[str, Any], int, int]] = {
    "primal-cholesky": ({"form": "primal", "solver": "cholesky"}, 61, 8),
    "dual-cholesky": ({"form": "dual", "solver": "cholesky"}, 11, 3),
    "primal-qr": ({"form": "primal", "solver": "qr"}, 61, 8),
    "primal-cg": ({"solver": "cg", "cg_rtol": 1e-12}, 61, 8),
}
#: name -> (where the model lives, devices, solver_device); "dev" is the device under test.
LAYOUTS: dict[str, tuple[str, list[str], str | None]] = {
    "dev+dev": ("dev", ["dev", "dev"], None),
    "dev+cpu": ("dev", ["dev", "cpu"], None),
    "cpu+dev": ("cpu", ["cpu", "dev"], None),
    "dev+dev-solve-on-cpu": ("dev", ["dev", "dev"], "cpu"),
}
CASES = [
    (layout, scenario, inputs)
    for layout in LAYOUTS
    for scenario in ("primal-cholesky", "dual-cholesky")
    for inputs in ("cpu", "dev")
] + [("dev+cpu", "primal-qr", "cpu"), ("dev+cpu", "primal-cg", "dev")]


def model_for(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 1)).double()


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.rand(n, 1, generator=g, dtype=F64) * 2 - 1
    return x, torch.sin(2 * x)


def train(
    scenario: str,
    home: torch.device,
    inputs: torch.device,
    devices: list[torch.device] | None = None,
    solver_device: torch.device | None = None,
) -> dict[str, Any]:
    options, n, slice_size = SCENARIOS[scenario]
    model = model_for().to(home)
    opt = so.LevenbergMarquardt(
        model, devices=devices, solver_device=solver_device, slice_size=slice_size, **options
    )
    x, y = (t.to(inputs) for t in batch(n))
    params, records = [], []
    for _ in range(STEPS):
        records.append(step_record(opt.step(x, y)))
        params.append(flat(model))
    return {"params": params, "records": records, "opt": opt, "model": model}


@functools.cache
def reference(scenario: str, device: torch.device) -> dict[str, Any]:
    """One device, ``devices=None``: the model and the inputs on the device under test."""
    return train(scenario, device, device)


@pytest.mark.parametrize(("layout", "scenario", "inputs"), CASES)
def test_several_devices_equal_one_device(
    layout: str, scenario: str, inputs: str, device: torch.device
) -> None:
    def resolve(name: str) -> torch.device:
        return device if name == "dev" else torch.device(name)

    home, entries, solver = LAYOUTS[layout]
    devices = [resolve(d) for d in entries]
    solver_device = None if solver is None else resolve(solver)
    got = train(scenario, resolve(home), resolve(inputs), devices, solver_device)
    ref = reference(scenario, device)
    what = f"{scenario}, devices={[str(d) for d in devices]}, solver_device={solver_device}"
    what += f", inputs on {resolve(inputs)}"

    opt = got["opt"]
    assert opt.devices == tuple(devices), what
    assert opt.solver_device == (devices[0] if solver_device is None else solver_device), what
    assert any(r["accepted"] for r in ref["records"]), ref["records"]
    on_device = all(d == device for d in (*devices, opt.solver_device))
    param_rtol, info_rtol = (PARAM_RTOL, INFO_RTOL) if on_device else (MIXED_RTOL, MIXED_RTOL)
    assert_same_steps(got["records"], ref["records"], info_rtol, what)
    for step, (p, q) in enumerate(zip(got["params"], ref["params"], strict=True)):
        assert_close_params(p, q, param_rtol, f"{what}: parameters after step {step}")
    # An accepted step is written to the model and to every replica, the same numbers.
    for k, replica in enumerate(opt.replicas):
        assert next(replica.parameters()).device == devices[k], (what, k)
        assert torch.equal(flat(replica), flat(got["model"])), f"{what}: replica {k} differs"
