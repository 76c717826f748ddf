"""Stage-by-stage profile of one LM step on the bench's problem 1, all in one process.

    python -m benchmarks.experiments.profile_step [--reps 20] [--threads 2] [--hidden 64]

sinc(10x) on 20,000 points, Linear(1,64)-Tanh-Linear(64,1) (193 parameters), float32,
full batch.  Every timed call runs once per round, round-robin over ``--reps`` rounds,
so a burst of load on a shared machine hits all of them alike; medians are printed
with their ratios to the same-run GEMM, forward+backward and peer step.

With ``--base DIR``, ``DIR/secondorder_base`` is an older copy of the package (made
with ``git archive <commit> secondorder | tar -x -C DIR`` and renamed) whose step is
timed in the same rounds: before and after, side by side.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.jacobian.program import _VmapReverse
from secondorder.lm.linalg import gram_update


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def stepper(pkg: Any, x: Tensor, y: Tensor, hidden: int, warm: int, **options: Any) -> Any:
    """A warmed-up optimizer and a function timing one step from the same point."""
    model = make_model(hidden)
    opt = pkg.LevenbergMarquardt(model, pkg.residuals.mse, **options)
    for _ in range(warm):
        opt.step(x, y)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    damping_state = opt.internals().damping_state
    damping = (damping_state.damping, damping_state.nu)

    def step() -> float:
        t0 = time.perf_counter()
        info = opt.step(x, y)
        dt = time.perf_counter() - t0
        model.load_state_dict(state)
        current = opt.internals().damping_state  # every timed step starts from one λ
        current.damping, current.nu = damping
        attempts.append(info.attempts)
        return dt

    attempts: list[int] = []
    step.attempts = attempts  # type: ignore[attr-defined]
    return opt, step


def stages(
    opt: so.LevenbergMarquardt, label: str, x: Tensor, y: Tensor
) -> dict[str, Callable[[], float]]:
    """The stages of ``opt``'s step, each alone, at its current point."""
    inner = opt.internals()
    prob = inner.problem
    with torch.no_grad():
        xv = torch.cat([p.detach().reshape(-1) for p in prob.params])
    system = prob.linearize(xv)
    d = inner.damping_matrix.diagonal(system.col_sq, inner.damping_state)
    lam, gdt = opt.damping, prob.gram_dtype
    params = prob.unflatten(xv)
    J, _ = prob.strategy(prob.program, params, x, y)
    out = {
        f"new {label}: linearize": timed(lambda: prob.linearize(xv)),
        f"new {label}: factor+solve": timed(
            lambda: prob.solver.factor(system, d).solve_unchecked(lam, -system.grad, None)
        ),
        f"new {label}: gram (gram_update)": timed(lambda: gram_update(None, J, gdt)),
        f"old {label}: gram (cast, J.T@J)": timed(lambda: (lambda a: a.T @ a)(J.to(gdt))),
    }
    if label == "defaults":
        out["new jacobian (reverse, outer-product rule)"] = timed(
            lambda: prob.strategy(prob.program, params, x, y)
        )
        out["old jacobian (reverse, vmap over jacrev)"] = timed(
            lambda: _VmapReverse()(prob.program, params, x, y)
        )
        out["trial loss_sum"] = timed(lambda: prob.loss_sum(xv))
    return out


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--warm", type=int, default=20, help="LM steps before timing")
    ap.add_argument("--base", default=None, help="folder holding secondorder_base")
    ap.add_argument("--no-tlm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.linspace(-1.0, 1.0, args.points).unsqueeze(1)
    y = torch.sinc(10.0 * x)
    f32 = {"gram_dtype": torch.float32}

    fns: dict[str, Callable[[], float]] = {}
    attempts: dict[str, list[int]] = {}
    packages = {"new": so}
    if args.base:
        sys.path.insert(0, args.base)
        packages["base"] = importlib.import_module("secondorder_base")
    for tag, pkg in packages.items():
        for label, opts in (("defaults", {}), ("fastest", f32)):
            opt, step = stepper(pkg, x, y, args.hidden, args.warm, **opts)
            fns[f"{tag} {label}: step()"] = step
            attempts[f"{tag} {label}"] = step.attempts
            if tag == "new":
                fns.update(stages(opt, label, x, y))
    J32 = torch.randn(args.points, 3 * args.hidden + 1)
    J64 = J32.double()
    fns["GEMM f32 J.T@J"] = timed(lambda: J32.T @ J32)
    fns["GEMM f64 J.T@J"] = timed(lambda: J64.T @ J64)
    fb_model = make_model(args.hidden)

    def fwd_bwd() -> None:
        fb_model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(fb_model(x), y).backward()

    fns["forward+backward"] = timed(fwd_bwd)
    if not args.no_tlm:
        try:
            from torch_levenberg_marquardt import loss as tlm_loss
            from torch_levenberg_marquardt.training import LevenbergMarquardtModule
        except ImportError:
            print("torch-levenberg-marquardt not installed: no peer step")
        else:
            tmodel = make_model(args.hidden)
            module = LevenbergMarquardtModule(tmodel, loss_fn=tlm_loss.MSELoss())
            for _ in range(args.warm):
                module.training_step(x, y)
            tstate = {k: v.clone() for k, v in tmodel.state_dict().items()}
            tdamp = module.damping_strategy.damping_factor  # type: ignore[attr-defined]

            def tstep() -> float:
                t0 = time.perf_counter()
                module.training_step(x, y)
                dt = time.perf_counter() - t0
                tmodel.load_state_dict(tstate)
                module.backup_parameters()
                module.damping_strategy.damping_factor = tdamp  # type: ignore[attr-defined]
                return dt

            fns["torch-levenberg-marquardt 1.2.3 step"] = tstep

    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(args.reps):
        for k, f in fns.items():
            times[k].append(f())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} rounds")
    for k, v in med.items():
        print(f"{k:46s} {v * 1e3:9.2f} ms   (min {min(times[k]) * 1e3:8.2f})")
    for k, a in attempts.items():
        print(f"{k}: attempts per timed step {sorted(set(a))}")
    fb, g32, g64 = med["forward+backward"], med["GEMM f32 J.T@J"], med["GEMM f64 J.T@J"]
    print("ratios (medians of the same run):")
    new_j = med["new jacobian (reverse, outer-product rule)"]
    old_j = med["old jacobian (reverse, vmap over jacrev)"]
    print(f"  jacobian new / fwd+bwd      {new_j / fb:.2f}")
    print(f"  jacobian old / fwd+bwd      {old_j / fb:.2f}")
    for label, gemm in (("defaults", g64), ("fastest", g32)):
        gs = med[f"new {label}: gram (gram_update)"] + med[f"new {label}: factor+solve"]
        print(f"  {label}: (gram+solve) / GEMM same dtype  {gs / gemm:.2f}")
        print(f"  {label}: (gram+solve) / GEMM f32         {gs / g32:.2f}")
    tlm = med.get("torch-levenberg-marquardt 1.2.3 step")
    for k in med:
        if k.endswith("step()") and tlm is not None:
            print(f"  tlm step / {k[:-8]:14s} step   {tlm / med[k]:.2f}")


if __name__ == "__main__":
    main()
