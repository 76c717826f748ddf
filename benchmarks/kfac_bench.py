"""K-FAC on MNIST-1D: iteration time against SGD, where the time goes, and time to accuracy.

Network (the issue's): Conv1d(1,32,5,pad 2)-ReLU-Conv1d(32,32,3,pad 1)-ReLU-Linear(1280,256)
-ReLU-Linear(256,10), batches of 128, MNIST-1D generated offline by ``mnist1d``'s
``make_dataset`` (4,000 train / 1,000 test).

    PYTHONPATH=. python benchmarks/kfac_bench.py --threads 1 timing
    PYTHONPATH=. python benchmarks/kfac_bench.py --threads 1 train

Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from secondorder.kfac import KFAC
from secondorder.kfac import preconditioner as pre_mod
from secondorder.kfac.layers import base as base_mod


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = 5000  # 4,000 train / 1,000 test
    d = make_dataset(args)
    x = torch.tensor(d["x"], dtype=torch.float32).unsqueeze(1)
    xt = torch.tensor(d["x_test"], dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(d["y"]), xt, torch.tensor(d["y_test"])


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv1d(1, 32, 5, padding=2),
        nn.ReLU(),
        nn.Conv1d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(1280, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def batches(n: int, bs: int, seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - bs + 1, bs):
            yield perm[i : i + bs]


class Method:
    """An optimizer recipe: build(model) -> (step function after backward)."""

    def __init__(self, name: str, build: Callable[[nn.Module], Callable[[], None]]) -> None:
        self.name = name
        self.build = build


def sgd(lr: float) -> Method:
    def build(m: nn.Module) -> Callable[[], None]:
        return torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9).step  # type: ignore[return-value]

    return Method(f"SGD(lr={lr}, momentum=0.9)", build)


def adamw(lr: float) -> Method:
    def build(m: nn.Module) -> Callable[[], None]:
        return torch.optim.AdamW(m.parameters(), lr=lr).step  # type: ignore[return-value]

    return Method(f"AdamW(lr={lr})", build)


def kfac(lr: float, every: int, **kw: Any) -> Method:
    def build(m: nn.Module) -> Callable[[], None]:
        k = KFAC(m, lr=lr, factor_update_steps=every, inv_update_steps=every, **kw)
        opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)

        def step() -> None:
            k.step()
            opt.step()

        step.kfac = k  # type: ignore[attr-defined]
        return step

    extra = ", ".join(f"{a}={b}" for a, b in kw.items())
    return Method(f"K-FAC+SGD(lr={lr}, every {every}{', ' + extra if extra else ''})", build)


# -- timing -------------------------------------------------------------------------------
TIMES: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name].append(time.perf_counter() - t)

    return wrapper


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    saved = []
    targets = [
        (pre_mod.KFAC, "_update_factors", "factor all-reduce + running average"),
        (pre_mod.KFAC, "_update_inverses", "eigendecompositions / inverses"),
        (pre_mod.KFAC, "_precondition", "preconditioning the gradients"),
        (base_mod.KFACLayer, "add_a", "A statistics (forward hooks)"),
        (base_mod.KFACLayer, "add_g", "G statistics (backward hooks)"),
    ]
    for cls, attr, label in targets:
        orig = getattr(cls, attr)
        saved.append((cls, attr, orig))
        setattr(cls, attr, timed(label, orig))
    try:
        yield
    finally:
        for cls, attr, orig in saved:
            setattr(cls, attr, orig)


def iteration_time(method: Method, x: torch.Tensor, y: torch.Tensor, iters: int) -> float:
    model = make_net()
    step = method.build(model)
    idx = batches(len(x), 128, 0)
    times = []
    for i in range(iters + 10):
        b = next(idx)
        t = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(x[b]), y[b]).backward()
        step()
        if i >= 10:
            times.append(time.perf_counter() - t)
    return statistics.mean(times)


def asdl_iteration_time(x: torch.Tensor, y: torch.Tensor, iters: int, every: int) -> float:
    """The PyPI peer ``asdfghjkl`` (module ``asdl``): empirical-Fisher K-FAC + SGD."""
    import types

    import asdl.precondition.natural_gradient as asdl_ng
    from asdl import KfacGradientMaker, PreconditioningConfig

    # asdfghjkl 0.1a5 calls torch.cuda.nvtx.range unconditionally in its preconditioner
    # update, which raises "NVTX functions not installed" on a CPU build of torch.
    asdl_ng.nvtx = types.SimpleNamespace(range=lambda *a, **k: contextlib.nullcontext())

    model = make_net()
    cfg = PreconditioningConfig(
        data_size=128,
        damping=1e-2,
        preconditioner_upd_interval=every,
        curvature_upd_interval=every,
        ema_decay=0.05,
    )
    gm = KfacGradientMaker(model, cfg, fisher_type="fisher_emp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    idx = batches(len(x), 128, 0)
    times = []
    for i in range(iters + 10):
        b = next(idx)
        t = time.perf_counter()
        opt.zero_grad()
        dummy = gm.setup_model_call(model, x[b])
        gm.setup_loss_call(F.cross_entropy, dummy, y[b])
        gm.forward_and_backward()
        opt.step()
        if i >= 10:
            times.append(time.perf_counter() - t)
    return statistics.mean(times)


def timing(args: argparse.Namespace) -> None:
    x, y, _, _ = load_data()
    iters = args.iters
    base = iteration_time(sgd(0.1), x, y, iters)
    print(f"SGD: {1e3 * base:.2f} ms/iteration (mean of {iters})")
    for every in (10, 1):
        for method in ("eigen", "inverse"):
            TIMES.clear()
            with instrumented():
                t = iteration_time(kfac(0.1, every, compute_method=method), x, y, iters)
            print(
                f"K-FAC {method}, factors+inverses every {every}: {1e3 * t:.2f} ms/iteration = "
                f"{t / base:.2f}x SGD"
            )
            total = t * (iters + 10)
            for label, ts in TIMES.items():
                print(
                    f"    {label:<40} {1e3 * sum(ts) / (iters + 10):7.2f} ms/iter "
                    f"({100 * sum(ts) / total:4.1f}%)"
                )
    try:
        import asdl  # noqa: F401
    except ImportError as exc:
        print(f"peer asdfghjkl not importable: {exc}")
        return
    for every in (10, 1):
        t = asdl_iteration_time(x, y, iters, every)
        print(
            f"peer asdfghjkl K-FAC (fisher_emp), every {every}: {1e3 * t:.2f} ms/iteration = "
            f"{t / base:.2f}x SGD"
        )


# -- training race -------------------------------------------------------------------------
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(method: Method, data: Any, epochs: int, target: float, seed: int) -> dict[str, Any]:
    x, y, xt, yt = data
    model = make_net(seed)
    step = method.build(model)
    idx = batches(len(x), 128, seed)
    per_epoch = len(x) // 128
    wall = 0.0
    reached: tuple[int, float] | None = None
    best = 0.0
    curve = []
    for s in range(epochs * per_epoch):
        b = next(idx)
        t = time.perf_counter()
        model.zero_grad()
        loss = F.cross_entropy(model(x[b]), y[b])
        loss.backward()
        step()
        wall += time.perf_counter() - t
        if not np.isfinite(loss.item()):
            break
        if (s + 1) % 25 == 0:
            acc = accuracy(model, xt, yt)
            curve.append((s + 1, wall, acc))
            best = max(best, acc)
            if reached is None and acc >= target:
                reached = (s + 1, wall)
    return {"name": method.name, "reached": reached, "best": best, "curve": curve}


def race(args: argparse.Namespace) -> None:
    data = load_data()
    target = args.target
    grid: list[Method] = []
    for lr in (0.03, 0.1, 0.3):
        grid.append(sgd(lr))
    for lr in (1e-3, 3e-3, 1e-2):
        grid.append(adamw(lr))
    for lr in (0.03, 0.1, 0.3):
        for damping in args.dampings:
            grid.append(
                kfac(lr, 10, damping=damping, kl_clip=args.kl_clip, compute_method=args.method)
            )
    print(
        f"target test accuracy {target:.0%}, {args.epochs} epochs of 31 steps, seed {args.seed}; "
        "test accuracy every 25 steps, time counts training steps only"
    )
    print("| method | steps to target | train time to target (s) | best test acc |")
    print("|---|---|---|---|")
    for m in grid:
        r = train(m, data, args.epochs, target, args.seed)
        steps, secs = r["reached"] if r["reached"] else ("-", "-")
        secs_s = f"{secs:.2f}" if secs != "-" else "-"
        print(f"| {r['name']} | {steps} | {secs_s} | {r['best']:.3f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("part", choices=["timing", "train"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kl-clip", type=float, default=None)
    p.add_argument("--dampings", type=float, nargs="+", default=[1e-2, 1e-1])
    p.add_argument("--method", choices=["eigen", "inverse"], default="inverse")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    if args.part == "timing":
        timing(args)
    else:
        race(args)


if __name__ == "__main__":
    main()
