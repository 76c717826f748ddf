"""The capturable LM step on CUDA: one graph per batch shape, no synchronisation.

References: the capturable step on the CPU in float64 (the same decisions, the
arithmetic of another BLAS), and CUDA's own synchronisation report
(``torch.cuda.set_sync_debug_mode("error")`` raises at any blocking copy or wait).
In CPU mode (``SECONDORDER_TEST_CUDA_DEVICE=cpu``) the graph and sync tests skip and
the others compare the CPU with itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import secondorder as so

pytestmark = pytest.mark.cuda

F64 = torch.float64


def _model(hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(F64)


def _data(points: int, device: torch.device) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1.0, 1.0, points, dtype=F64).unsqueeze(1)
    return x.to(device), torch.sinc(3.0 * x).to(device)


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


@pytest.mark.parametrize("form", ["primal", "dual"])
def test_capturable_steps_on_the_device_match_the_cpu(device: torch.device, form: str) -> None:
    points = 200 if form == "primal" else 24
    x, y = _data(points, device)
    ref_model, model = _model(), _model().to(device)
    options = {"capturable": True, "candidates": 10, "form": form}
    ref = so.LevenbergMarquardt(ref_model, **options)
    opt = so.LevenbergMarquardt(model, **options)
    for _ in range(8):
        info, expected = opt.step(x, y), ref.step(x.cpu(), y.cpu())
        assert bool(info.accepted) == bool(expected.accepted)
        torch.testing.assert_close(_flat(model), _flat(ref_model), rtol=1e-9, atol=1e-12)
    assert info.graph in ("replayed", "eager: not a CUDA device (cpu)")


def test_a_graph_is_captured_once_per_shape_and_replayed(cuda_only: torch.device) -> None:
    small, large = _data(100, cuda_only), _data(160, cuda_only)
    opt = so.LevenbergMarquardt(_model().to(cuda_only), capturable=True, check_every=0)
    graphs = [opt.step(*batch).graph for batch in [small, small, small, large, large, small]]
    assert graphs == [
        "eager: warm-up before capture",
        "captured",
        "replayed",
        "eager: warm-up before capture",
        "captured",
        "replayed",
    ]


def test_a_sliced_step_is_captured_and_equals_the_whole_batch(cuda_only: torch.device) -> None:
    # Slices change only the order of the sums: the same steps to rounding.
    x, y = _data(200, cuda_only)
    model = _model().to(cuda_only)
    twin = copy.deepcopy(model)
    whole = so.LevenbergMarquardt(model, capturable=True, check_every=0)
    sliced = so.LevenbergMarquardt(twin, capturable=True, check_every=0)
    for _ in range(6):
        a, b = whole.step(x, y), sliced.step(x, y, slice_size=50)
        assert bool(a.accepted) == bool(b.accepted)
    assert b.graph == "replayed"
    torch.testing.assert_close(_flat(model), _flat(twin), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("candidates", [1, 3])
def test_steady_state_steps_never_synchronise(cuda_only: torch.device, candidates: int) -> None:
    x, y = _data(256, cuda_only)
    opt = so.LevenbergMarquardt(
        _model().to(cuda_only), capturable=True, candidates=candidates, check_every=0
    )
    for _ in range(3):
        opt.step(x, y)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        infos = [opt.step(x, y) for _ in range(5)]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert {info.graph for info in infos} == {"replayed"}
    assert sum(bool(info.accepted) for info in infos) > 0


def test_the_eager_reason_is_reported(device: torch.device) -> None:
    x, y = _data(200, device)
    opt = so.LevenbergMarquardt(_model().to(device), capturable=True)
    info = opt.step(x, y)
    if device.type == "cuda":
        assert info.graph == "eager: warm-up before capture"
    else:
        assert info.graph == "eager: not a CUDA device (cpu)"
