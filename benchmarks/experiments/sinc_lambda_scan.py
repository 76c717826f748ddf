"""What each λ would have gained at a point of an LM run on sinc, in float64.

    python -m benchmarks.experiments.sinc_lambda_scan SEED STEP [STEP ...]

Runs ``LevenbergMarquardt(model, mse)`` (defaults, 1 thread) on the sinc problem of
``benchmarks.experiments.sinc_steps`` from ``mlp([1, 64, 1], SEED)`` to each STEP, then, at that
point, with J from ``torch.func.jacfwd`` in float64 and ``D = diag(JᵀJ)`` (floored as
the library floors it, at 1e-9 of its largest entry), for λ from 10x to 1/100x the
optimizer's λ: the gain ratio ρ and the fraction of the loss a full step removes;
the same with geodesic acceleration (``r_vv`` by ``jvp`` of ``jvp``, ``δ = v + a/2``)
and its ratio ``2‖D^½a‖/‖D^½v‖``; and the best of seven scales t of the plain step.
Read in ``benchmarks/notes/NOTES.md``, "Fewer steps on sinc".
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch.func import functional_call, jacfwd, jvp

from secondorder.lm import LevenbergMarquardt
from secondorder.lm.residuals import mse

from ..workloads import mlp, sinc_data


def main(argv: list[str]) -> int:
    """Print one table per requested step."""
    torch.set_num_threads(1)
    seed, steps = int(argv[0]), [int(a) for a in argv[1:]]
    x, y = sinc_data(20_000)
    model = mlp([1, 64, 1], seed=seed)()
    opt = LevenbergMarquardt(model, mse)
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    twin = mlp([1, 64, 1], seed=seed)().double()
    x64, y64 = x.double(), y.double()

    def unflatten(t: Tensor) -> dict[str, Tensor]:
        out, i = {}, 0
        for k, s in zip(names, shapes, strict=True):
            out[k] = t[i : i + s.numel()].reshape(s)
            i += s.numel()
        return out

    def residuals(t: Tensor) -> Tensor:
        out: Tensor = functional_call(twin, unflatten(t), (x64,))
        return (out - y64).reshape(-1)

    def sq(t: Tensor) -> float:
        r = residuals(t)
        return float(r @ r)

    done = 0
    for target in steps:
        while done < target:
            opt.step(x, y)
            done += 1
        th = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        J = jacfwd(residuals)(th)
        r0 = residuals(th)
        loss0 = float(r0 @ r0)
        A, g = J.T @ J, J.T @ r0
        d = A.diagonal().clamp_min(1e-9 * float(A.diagonal().max()))
        print(f"seed {seed} step {done}: MSE {loss0 / r0.numel():.3e}, λ {opt.damping:.2e}")
        for factor in (10, 3, 1, 1 / 3, 1 / 10, 1 / 30, 1 / 100):
            lam = factor * opt.damping
            M = A + lam * torch.diag(d)
            v = torch.linalg.solve(M, -g)
            Jv = J @ v
            pred = float(-2 * g @ v - Jv @ Jv)
            gain = loss0 - sq(th + v)
            rvv = jvp(lambda t, v=v: jvp(residuals, (t,), (v,))[1], (th,), (v,))[1]
            a = torch.linalg.solve(M, -J.T @ rvv)
            ratio = 2 * float((d.sqrt() * a).norm() / (d.sqrt() * v).norm())
            geo = loss0 - sq(th + v + 0.5 * a)
            best_loss, best_t = min(
                (sq(th + t * v), t) for t in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
            )
            print(
                f"  λ {lam:8.2e} ρ {gain / pred:9.3f} gain {gain / loss0:10.4f} | "
                f"geodesic 2|a|/|v| {ratio:7.2f} gain {geo / loss0:11.4f} | "
                f"best t {best_t:4} gain {(loss0 - best_loss) / loss0:8.4f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
