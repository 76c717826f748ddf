"""Levenberg-Marquardt on the device equals the same run on the CPU.

The reference is the same optimizer, on the same float64 model and data, stepping on
the CPU; the device run must match it step for step (the decisions exactly, the
parameters and losses to :data:`~cuda_cases.RTOL`).  Covered: each Jacobian strategy,
solver and form on a tanh MLP fitting sinc data, a float32 run with the defaults, the
classifier defaults on mini-batches, the training loop ``so.fit``, and checkpoints
that cross between the devices.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from cuda_cases import (
    F64,
    RTOL,
    assert_close_params,
    assert_same_steps,
    flat,
    rel_diff,
    sinc_batch,
    sinc_mlp,
    step_record,
)
from torch import nn

import secondorder as so
from tests.lm.test_checkpoint import roundtrip

pytestmark = pytest.mark.cuda

STEPS = 5
PRIMAL = 48  # points: m = 48 > n = 25
DUAL = 12  # points: m = 12 < n = 25

#: name -> (options, points).  Every strategy with the Cholesky solver in the primal
#: form, every solver with reverse mode, both forms, and the defaults ("auto").
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "primal-cholesky-reverse": ({"form": "primal", "solver": "cholesky"}, PRIMAL),
    "primal-cholesky-forward": ({"form": "primal", "jacobian": "forward"}, PRIMAL),
    "primal-cholesky-batch_reverse": ({"form": "primal", "jacobian": "batch_reverse"}, PRIMAL),
    "primal-cholesky-batch_forward": ({"form": "primal", "jacobian": "batch_forward"}, PRIMAL),
    "primal-cholesky-geodesic": ({"form": "primal", "geodesic": True}, PRIMAL),
    "primal-eigh": ({"form": "primal", "solver": "eigh"}, PRIMAL),
    "primal-qr": ({"form": "primal", "solver": "qr"}, PRIMAL),
    "primal-cg": ({"solver": "cg", "cg_rtol": 1e-12}, PRIMAL),
    "dual-cholesky-reverse": ({"form": "dual", "solver": "cholesky"}, DUAL),
    "dual-cholesky-forward": ({"form": "dual", "jacobian": "forward"}, DUAL),
    "dual-eigh": ({"form": "dual", "solver": "eigh"}, DUAL),
    "dual-qr": ({"form": "dual", "solver": "qr"}, DUAL),
    "auto-primal": ({}, PRIMAL),
    "auto-dual": ({}, DUAL),
}


def run(
    device: torch.device | str,
    options: dict[str, Any],
    points: int,
    dtype: torch.dtype = F64,
    steps: int = STEPS,
) -> dict[str, Any]:
    """``steps`` LM steps on ``device``: parameters (on the CPU) and records per step."""
    model = sinc_mlp(dtype=dtype).to(device)
    x, y = (t.to(device) for t in sinc_batch(points, dtype))
    opt = so.LevenbergMarquardt(model, **options)
    params, records = [], []
    for _ in range(steps):
        records.append(step_record(opt.step(x, y)))
        params.append(flat(model))
    return {"params": params, "records": records}


@pytest.mark.parametrize("name", list(CASES))
def test_lm_on_the_device_equals_the_cpu(name: str, device: torch.device) -> None:
    options, points = CASES[name]
    ref = run("cpu", options, points)
    got = run(device, options, points)
    assert any(r["accepted"] for r in ref["records"]), ref["records"]
    assert_same_steps(got["records"], ref["records"], RTOL, f"{name} on {device}")
    for step, (p, q) in enumerate(zip(got["params"], ref["params"], strict=True)):
        assert_close_params(p, q, RTOL, f"{name} on {device}, parameters after step {step}")


def test_reordered_sums_stay_well_inside_the_tolerance() -> None:
    """What rounding alone does to these runs: the Gram summed over other slices (CPU)."""
    options, points = CASES["primal-cholesky-geodesic"]
    whole = run("cpu", options, points)["params"][-1]
    sliced = run("cpu", {**options, "slice_size": 5}, points)["params"][-1]
    diff = rel_diff(sliced, whole)
    assert 0 < diff <= RTOL / 10, f"reordering the Gram's sums moved the parameters by {diff:.3e}"


def test_float32_defaults_follow_the_cpu_trajectory(device: torch.device) -> None:
    """float32 under ``gram_dtype="auto"``: each step accepted, losses within 1e-3.

    float32 rounding differs between cuBLAS and the CPU's BLAS by about 1e-7
    relative; ``"auto"`` lets a float32 normal matrix move a step by up to
    ``gram_auto_tol`` of its length, so only the trajectory is compared, loosely.
    """
    if device.type == "cuda":
        # TF32 (off by default) would round the float32 products to 10-bit mantissas.
        assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls are enabled"
    ref = run("cpu", {}, PRIMAL, dtype=torch.float32)
    got = run(device, {}, PRIMAL, dtype=torch.float32)
    for step, (a, b) in enumerate(zip(got["records"], ref["records"], strict=True)):
        where = f"float32 step {step} on {device}"
        assert a["accepted"] and b["accepted"], f"{where}: accepted {a['accepted']}, ref {b}"
        rel = abs(a["loss"] - b["loss"]) / b["loss"]
        assert rel <= 1e-3, f"{where}: loss {a['loss']!r}, ref {b['loss']!r} (rel {rel:.2e})"
    assert "float32" in {r["gram_dtype"] for r in ref["records"]}, ref["records"]


def test_tf32_makes_auto_form_every_normal_matrix_in_float64(device: torch.device) -> None:
    """TF32 rounds a CUDA float32 product's inputs to 10 bits: nothing ``"auto"`` can
    certify, so every Gram is float64 there.  The model's own layers run in TF32 too
    (the user's choice), so the trajectory is compared only loosely: every step is
    accepted and the loss falls as the CPU's does.  On the CPU the switch changes
    nothing."""
    ref = run("cpu", {}, PRIMAL, dtype=torch.float32)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        got = run(device, {}, PRIMAL, dtype=torch.float32)
    finally:
        torch.set_float32_matmul_precision(before)
    dtypes = {r["gram_dtype"] for r in got["records"]}
    expected = {"float64"} if device.type == "cuda" else {r["gram_dtype"] for r in ref["records"]}
    assert "float32" in {r["gram_dtype"] for r in ref["records"]}
    assert dtypes == expected, dtypes
    for step, (a, b) in enumerate(zip(got["records"], ref["records"], strict=True)):
        rel = abs(a["loss"] - b["loss"]) / b["loss"]
        assert a["accepted"] and rel <= 5e-2, f"step {step}: {a!r} against {b!r}"
    assert got["records"][-1]["loss"] < 0.5 * got["records"][0]["loss"]


# -- the classifier defaults on mini-batches --------------------------------------------


def classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def class_batches(count: int = 4, size: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(size, 8, generator=g, dtype=F64), torch.randint(0, 4, (size,), generator=g))
        for _ in range(count)
    ]


def run_classifier(device: torch.device | str) -> dict[str, Any]:
    model = classifier().to(device)
    opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy)
    params, records = [], []
    for x, y in class_batches():
        records.append(step_record(opt.step(x.to(device), y.to(device))))
        params.append(flat(model))
    return {"params": params, "records": records}


def test_classifier_minibatches_equal_the_cpu(device: torch.device) -> None:
    """Cross-entropy, 12 samples a batch, n = 212: the dual form with D = I."""
    ref = run_classifier("cpu")
    got = run_classifier(device)
    assert {r["form"] for r in ref["records"]} == {"dual"}, ref["records"]
    assert_same_steps(got["records"], ref["records"], RTOL, f"classifier on {device}")
    for step, (p, q) in enumerate(zip(got["params"], ref["params"], strict=True)):
        assert_close_params(p, q, RTOL, f"classifier on {device}, parameters after batch {step}")


# -- the training loop ------------------------------------------------------------------


def fit_on(device: torch.device | str) -> tuple[torch.Tensor, list[float]]:
    model = sinc_mlp().to(device)
    x, y = (t.to(device) for t in sinc_batch(PRIMAL))
    xv, yv = (t.to(device) for t in sinc_batch(16, seed=99))
    opt = so.LevenbergMarquardt(model)
    history = so.fit(opt, (x, y), epochs=STEPS, validation=(xv, yv), progress=False)
    return flat(model), [*history.loss, *history.validation]


def test_fit_on_the_device_equals_the_cpu_loop(device: torch.device) -> None:
    want, ref_losses = fit_on("cpu")
    got, losses = fit_on(device)
    assert_close_params(got, want, RTOL, f"so.fit on {device}")
    assert len(losses) == len(ref_losses) == 2 * STEPS, (losses, ref_losses)
    assert losses == pytest.approx(ref_losses, rel=RTOL), (losses, ref_losses)


# -- checkpoints between the devices ----------------------------------------------------


@pytest.mark.parametrize("direction", ["device-to-cpu", "cpu-to-device"])
def test_a_checkpoint_resumes_on_the_other_device(direction: str, device: torch.device) -> None:
    """Save after 3 steps, load into an optimizer on the other device: the next steps agree.

    Moré's scaling keeps a tensor in the state (the running column norms), so the
    checkpoint carries one from the saving device.
    """
    source, target = (device, "cpu") if direction == "device-to-cpu" else ("cpu", device)
    options = {"damping_matrix": "more", "form": "primal"}
    x, y = sinc_batch(PRIMAL)
    model = sinc_mlp().to(source)
    opt = so.LevenbergMarquardt(model, **options)
    for _ in range(3):
        opt.step(x.to(source), y.to(source))
    state = roundtrip(opt.state_dict())
    twin = copy.deepcopy(model).to(target)
    resumed = so.LevenbergMarquardt(twin, **options)
    resumed.load_state_dict(state)
    assert resumed.damping == opt.damping
    for step in range(3):
        a = step_record(resumed.step(x.to(target), y.to(target)))
        b = step_record(opt.step(x.to(source), y.to(source)))
        assert_same_steps([a], [b], RTOL, f"{direction}, step {step} after the load")
        assert_close_params(flat(twin), flat(model), RTOL, f"{direction}, step {step}")
