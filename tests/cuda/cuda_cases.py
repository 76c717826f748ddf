"""Models, data and comparisons that the CUDA tests share.

Data are drawn on the CPU from a seeded CPU generator and then moved, so the device
run and its CPU reference see the same numbers; models are built on the CPU from a
seed and moved, for the same reason.  :func:`assert_close_params` reports the
measured difference, the worst entry and its values, so a failure on the GPU machine
says by how much and where.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

import secondorder as so

F64 = torch.float64

#: Relative difference (‖Δ‖/‖p‖) allowed between a float64 run on the device and its
#: CPU reference after a few steps.  The two add in other orders and round ``tanh``
#: and ``exp`` differently (cuBLAS and the CUDA math library against MKL and glibc);
#: each step's rounding is amplified by the conditioning of the damped normal
#: equations.  On one CPU, reordering only the Gram's sums moves these runs by 1e-14
#: to 1e-13 (``test_cuda_lm.test_reordered_sums_stay_well_inside_the_tolerance`` checks
#: 1e-10); the distributed tests use the same bound for the same reason.
RTOL = 1e-9


def sinc_mlp(hidden: int = 8, dtype: torch.dtype = F64, seed: int = 0) -> nn.Module:
    """``Linear(1, hidden)-Tanh-Linear(hidden, 1)``: ``3·hidden + 1`` parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)


def sinc_batch(n: int, dtype: torch.dtype = F64, seed: int = 1234) -> tuple[Tensor, Tensor]:
    """``n`` points of ``sinc(3x)`` on ``[-1, 1]``, drawn on the CPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g, dtype=F64) * 2 - 1
    return x.to(dtype), torch.sinc(3 * x).to(dtype)


def flat(model: nn.Module) -> Tensor:
    """The model's parameters as one float64 vector on the CPU (a copy)."""
    return torch.cat([p.detach().reshape(-1).to("cpu", F64) for p in model.parameters()])


def rel_diff(p: Tensor, q: Tensor) -> float:
    """``‖p - q‖ / ‖q‖``, on the CPU in float64."""
    p, q = p.to("cpu", F64), q.to("cpu", F64)
    return float(torch.linalg.vector_norm(p - q) / torch.linalg.vector_norm(q))


def describe_diff(got: Tensor, want: Tensor) -> str:
    """The relative and largest absolute difference, the worst entry and its values."""
    got, want = got.to("cpu", F64).reshape(-1), want.to("cpu", F64).reshape(-1)
    delta = (got - want).abs()
    worst = int(delta.argmax()) if delta.numel() else 0
    return (
        f"‖Δ‖/‖ref‖={rel_diff(got, want):.3e}, max |Δ|={float(delta.max()):.3e} at entry "
        f"{worst} (got {float(got[worst])!r}, ref {float(want[worst])!r})"
    )


def assert_close_params(got: Tensor, want: Tensor, rtol: float, what: str) -> None:
    """``‖got - want‖ ≤ rtol·‖want‖``, with the measured difference in the message."""
    diff = rel_diff(got, want)
    assert diff <= rtol, f"{what}: {describe_diff(got, want)} > rtol {rtol:.0e}"


def step_record(info: so.StepInfo) -> dict[str, Any]:
    """The fields of a step that two devices must agree on (exactly or to rounding)."""
    return {
        "loss": info.loss,
        "loss_before": info.loss_before,
        "accepted": info.accepted,
        "attempts": info.attempts,
        "damping": info.damping,
        "jacobian": info.jacobian,
        "solver": info.solver,
        "form": info.form,
        "gram_dtype": info.gram_dtype,
    }


def assert_same_steps(
    got: list[dict[str, Any]], want: list[dict[str, Any]], rtol: float, what: str
) -> None:
    """Step records agree: the decisions exactly, the numbers to ``rtol`` relative."""
    assert len(got) == len(want), f"{what}: {len(got)} steps against {len(want)}"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for key in ("accepted", "attempts", "jacobian", "solver", "form"):
            assert a[key] == b[key], f"{what}, step {step}: {key} {a[key]!r} != ref {b[key]!r}"
        for key in ("loss", "loss_before", "damping"):
            scale = max(abs(b[key]), 1e-300)
            assert abs(a[key] - b[key]) <= rtol * scale, (
                f"{what}, step {step}: {key} {a[key]!r} != ref {b[key]!r} "
                f"(relative {abs(a[key] - b[key]) / scale:.3e} > {rtol:.0e})"
            )
