"""Fit y = sinc(10x) with Levenberg-Marquardt on several processes (torch.distributed).

    torchrun --nproc_per_node 2 examples/distributed_sinc.py
    torchrun --nproc_per_node 4 examples/distributed_sinc.py --solver cg
    torchrun --nproc_per_node 2 examples/distributed_sinc.py --compare
    python examples/distributed_sinc.py        # the single-process equivalent
    torchrun --nproc_per_node 2 examples/distributed_sinc.py --quick   # seconds, for CI

Each rank builds the same model, Linear(1, 64) - Tanh - Linear(64, 1), and takes every
``world_size``-th point of the data set, the split a ``DistributedSampler`` makes.
Because ``init_process_group`` has been called, ``LevenbergMarquardt`` finds the
default group by itself: it sums the ranks' losses, ``Jᵀr`` and ``JᵀJ`` (or, with
``--solver cg``, one n-vector per CG iteration), takes the same decisions on every
rank and keeps the parameters bitwise identical.  The result is the fit one process
would make on all the points; ``--compare`` trains that single-process copy on rank 0
alongside and prints how far apart the two end up.  The sums are taken in another
order, so the two agree to rounding at first (about 5e-8 relative after 5 steps in
float64) and then drift apart the way this non-convex fit amplifies any rounding: one
process whose only change is ``slice_size`` (the order of its own sums) drifts by as
much (6e-3 after 20 steps).

Rank 0 plots the loss against steps (with ``--compare``, the single process's too) in
``out/distributed_sinc.png``.

The backend is NCCL when CUDA is available (one GPU per rank, ``LOCAL_RANK``) and
gloo on CPU.  On several machines, use torchrun's ``--nnodes``/``--rdzv-endpoint``
as for any PyTorch job.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import secondorder as so
from secondorder.distributed import LocalReducer


def sinc_data(points: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1.0, 1.0, points, dtype=dtype).unsqueeze(1)
    return x, torch.sinc(10.0 * x)


def sinc_model(hidden: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=2_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--solver", default="auto", choices=["auto", "cholesky", "eigh", "cg"])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--target", type=float, default=1e-7, help="stop at this MSE")
    parser.add_argument("--compare", action="store_true", help="also train one process on rank 0")
    parser.add_argument("--quick", action="store_true", help="500 points, 20 steps (for CI)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the plot")
    args = parser.parse_args(argv)
    if args.quick:
        args.points, args.steps = 500, 20
    dtype = getattr(torch, args.dtype)

    launched = "RANK" in os.environ  # set by torchrun
    device = torch.device("cpu")
    if launched:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=5))
    rank = dist.get_rank() if launched else 0
    world = dist.get_world_size() if launched else 1

    x, y = sinc_data(args.points, dtype)
    xs, ys = x[rank::world].to(device), y[rank::world].to(device)
    model = sinc_model(args.hidden, dtype).to(device)
    # With torch.distributed initialised, the default process group is used.
    opt = so.LevenbergMarquardt(model, solver=args.solver)

    single = None
    if args.compare and rank == 0:
        # One process on the ranks' shards concatenated in rank order.
        xa = torch.cat([x[r::world] for r in range(world)]).to(device)
        ya = torch.cat([y[r::world] for r in range(world)]).to(device)
        single_model = sinc_model(args.hidden, dtype).to(device)
        single = (so.LevenbergMarquardt(single_model, solver=args.solver, reducer=LocalReducer()),)

    if rank == 0:
        print(
            f"{world} process(es), backend {dist.get_backend() if launched else 'none'}, "
            f"{opt.num_parameters} parameters, {len(xs)} of {args.points} points on rank 0"
        )
    t0 = time.perf_counter()
    losses: list[float] = []
    single_losses: list[float] = []
    for step in range(1, args.steps + 1):
        info = opt.step(xs, ys)
        losses.append(info.loss)
        if single is not None:
            single_losses.append(single[0].step(xa, ya).loss)
        if rank == 0 and (step % 10 == 0 or step == 1 or info.loss <= args.target):
            print(
                f"step {step:4d}  mse {info.loss:.3e}  damping {info.damping:.1e}  "
                f"{info.solver}/{info.form}  {time.perf_counter() - t0:6.2f} s"
            )
        # info.loss is the global MSE, the same on every rank, so all ranks stop together.
        if info.loss <= args.target or info.terminated:
            break

    if launched:
        mine = flat(model)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        if rank == 0:
            same = all(torch.equal(mine, other) for other in everyone)
            print(f"parameters bitwise identical on all {world} ranks: {same}")
    if single is not None:
        a, b = flat(model), flat(single_model)
        rel = float((a - b).abs().max() / b.abs().max())
        print(f"max relative difference from one process on the whole batch: {rel:.2e}")
    if rank == 0:
        plot(losses, single_losses, world, args.out)
    if launched:
        dist.destroy_process_group()


def plot(losses: list[float], single: list[float], world: int, out: Path) -> None:
    """The global MSE against steps (and the single process's, with ``--compare``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.semilogy(range(1, len(losses) + 1), losses, label=f"{world} process(es)")
    if single:
        ax.semilogy(range(1, len(single) + 1), single, "--", label="one process, all points")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE (all ranks' points)")
    ax.set_title("sinc(10x), Levenberg-Marquardt over torch.distributed")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "distributed_sinc.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
