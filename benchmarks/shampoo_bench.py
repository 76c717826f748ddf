"""Shampoo's step cost against AdamW's, and steps/time to a test accuracy, on MNIST-1D.

The network of the Shampoo issue: Conv1d(1,32,5)-ReLU-Conv1d(32,32,3)-ReLU-
Linear(1280,256)-ReLU-Linear(256,10) (333,802 parameters) on MNIST-1D (4,000 train /
1,000 test sequences of length 40, generated offline with ``mnist1d``), batches of 128.

Two measurements, never asserted anywhere:

1. ``timing``: median wall time of ``optimizer.step()`` alone and of the whole
   iteration (forward, backward, step) over ``--timing-steps`` steps after warm-up,
   as ratios to AdamW's; plus where Shampoo's step spends its time (factor update,
   root inverses, the rest) at precondition_frequency 1.
2. ``accuracy``: steps and wall time until the test accuracy (evaluated every epoch)
   first reaches ``--target``, within ``--max-epochs``.

Usage::

    python benchmarks/shampoo_bench.py --threads 2 [--quick]

Requires ``pip install mnist1d``; the peers (``pytorch-optimizer``, ``heavyball``) run
if installed and are reported as skipped otherwise.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from secondorder.shampoo import AdamGraftingConfig, Shampoo


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()  # 5,000 samples, 80% train, seed 42, length 40
    data = make_dataset(args)
    x = torch.tensor(data["x"], dtype=torch.float32).unsqueeze(1)
    xt = torch.tensor(data["x_test"], dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(data["y"]), xt, torch.tensor(data["y_test"])


def make_model(seed: int = 0) -> nn.Module:
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


Factory = Callable[[Any], torch.optim.Optimizer]


def shampoo(freq: int, lr: float, **kw: Any) -> Factory:
    return lambda ps: Shampoo(
        ps,
        lr=lr,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-4,
        precondition_frequency=freq,
        grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
        **kw,
    )


def peers() -> dict[str, Factory | str]:
    out: dict[str, Factory | str] = {}
    try:
        import pytorch_optimizer as po

        out["pytorch-optimizer Shampoo (freq 1)"] = lambda ps: po.Shampoo(ps, lr=1e-3)
        out["pytorch-optimizer SOAP (freq 10)"] = lambda ps: po.SOAP(
            ps, lr=3e-3, precondition_frequency=10
        )
    except Exception as exc:  # report, do not fail
        out["pytorch-optimizer"] = f"skipped: {type(exc).__name__}: {exc}"
    try:
        import heavyball
        import heavyball.utils

        # Eager, like every other contender here: heavyball's default torch.compile
        # (max-autotune) spends minutes autotuning on CPU and is not what is measured.
        heavyball.utils.compile_mode = None
        out["heavyball SOAP (freq 10)"] = lambda ps: heavyball.SOAP(
            ps, lr=3e-3, precondition_frequency=10
        )
    except Exception as exc:
        out["heavyball"] = f"skipped: {type(exc).__name__}: {exc}"
    return out


def time_steps(make: Factory, data: Any, steps: int, warmup: int) -> tuple[float, float]:
    """Median seconds of step() alone and of a whole iteration."""
    x, y, _, _ = data
    model = make_model()
    opt = make(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    step_t, iter_t = [], []
    for i in range(warmup + steps):
        idx = torch.randint(0, x.shape[0], (128,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= warmup:
            step_t.append(t2 - t1)
            iter_t.append(t2 - t0)
    return statistics.median(step_t), statistics.median(iter_t)


def profile_shampoo(data: Any, steps: int) -> dict[str, float]:
    """Seconds per step in each stage of Shampoo at precondition_frequency 1."""
    from secondorder.shampoo import preconditioner as pc

    spent: dict[str, float] = {"update_factors": 0.0, "amortize": 0.0, "precondition": 0.0}
    originals = {}
    for name in spent:
        originals[name] = getattr(pc.Preconditioner, name, None)
    orig_pre = pc.RootInversePreconditioner.precondition

    def wrap(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            r = fn(*a, **k)
            spent[key] += time.perf_counter() - t0
            return r

        return inner

    pc.Preconditioner.update_factors = wrap(originals["update_factors"], "update_factors")  # type: ignore[method-assign]
    pc.Preconditioner.amortize = wrap(originals["amortize"], "amortize")  # type: ignore[method-assign]
    pc.RootInversePreconditioner.precondition = wrap(orig_pre, "precondition")  # type: ignore[method-assign]
    try:
        total, _ = time_steps(shampoo(1, 1e-3), data, steps, 0)
    finally:
        pc.Preconditioner.update_factors = originals["update_factors"]  # type: ignore[method-assign]
        pc.Preconditioner.amortize = originals["amortize"]  # type: ignore[method-assign]
        pc.RootInversePreconditioner.precondition = orig_pre  # type: ignore[method-assign]
    out = {k: v / steps for k, v in spent.items()}
    out["median step"] = total
    return out


def accuracy_run(
    make: Factory, data: Any, target: float, max_epochs: int
) -> tuple[int | None, float | None, float]:
    """Steps and optimizer+model seconds to reach ``target`` test accuracy; best accuracy."""
    x, y, xt, yt = data
    model = make_model()
    opt = make(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    steps, train_s, best = 0, 0.0, 0.0
    for _ in range(max_epochs):
        perm = torch.randperm(x.shape[0], generator=g)
        t0 = time.perf_counter()
        for i in range(0, x.shape[0], 128):
            idx = perm[i : i + 128]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
            steps += 1
        train_s += time.perf_counter() - t0
        with torch.no_grad():
            acc = float((model(xt).argmax(1) == yt).float().mean())
        best = max(best, acc)
        if acc >= target:
            return steps, train_s, best
    return None, None, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # One thread by default: on a shared 2-core machine, OpenMP's spinning threads make
    # a multi-threaded eigh up to 100x slower whenever another process holds a core.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timing-steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--max-epochs", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="timing only, fewer steps")
    ap.add_argument("--skip-peers", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    data = make_data()
    print(f"# MNIST-1D train {tuple(data[0].shape)} test {tuple(data[2].shape)}")
    print(f"# parameters: {sum(p.numel() for p in make_model().parameters())}")

    adamw: Factory = lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=1e-4)  # noqa: E731
    contenders: dict[str, Factory | str] = {
        "AdamW lr 3e-3": adamw,
        "Shampoo freq 1": shampoo(1, 1e-3),
        "Shampoo freq 100": shampoo(100, 1e-3),
        "SOAP (eigenvalue_corrected) freq 10": shampoo(
            10, 3e-3, preconditioner="eigenvalue_corrected"
        ),
        # Not the setting: smaller blocks trade preconditioner quality for time.
        "Shampoo freq 1, max dim 256": shampoo(1, 1e-3, max_preconditioner_dim=256),
        "Shampoo freq 100, max dim 256": shampoo(100, 1e-3, max_preconditioner_dim=256),
    }
    if not args.skip_peers:
        contenders.update(peers())
    steps = 10 if args.quick else args.timing_steps
    print("\n## step time (median), ratios to AdamW")
    print(f"{'optimizer':40s} {'step ms':>9s} {'x AdamW':>8s} {'iter ms':>9s} {'x AdamW':>8s}")
    base: tuple[float, float] | None = None
    for name, make in contenders.items():
        if isinstance(make, str):
            print(f"{name:40s} {make}")
            continue
        n = (
            min(steps, 10)
            if "freq 1)" in name or "freq 1," in name or name.endswith("freq 1")
            else steps
        )
        try:
            s, it = time_steps(make, data, n, args.warmup)
        except Exception as exc:
            print(f"{name:40s} failed: {type(exc).__name__}: {exc}")
            continue
        if base is None:
            base = (s, it)
        print(f"{name:40s} {1e3 * s:9.2f} {s / base[0]:8.1f} {1e3 * it:9.2f} {it / base[1]:8.2f}")

    print("\n## where Shampoo's step goes (precondition_frequency 1, ms per step)")
    for k, v in profile_shampoo(data, 10 if args.quick else 20).items():
        print(f"{k:20s} {1e3 * v:9.2f}")

    if args.quick:
        return
    print(f"\n## steps and training seconds to {args.target:.0%} test accuracy")
    print("(AdamW lr grid 1e-3, 3e-3, 1e-2; the clock counts only training epochs)")
    runs: dict[str, Factory | str] = {
        "AdamW lr 1e-3": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-4),
        "AdamW lr 3e-3": adamw,
        "AdamW lr 1e-2": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-4),
        "Shampoo freq 100 lr 1e-3": shampoo(100, 1e-3),
        "Shampoo freq 100 lr 3e-3": shampoo(100, 3e-3),
        "Shampoo freq 10 lr 1e-3": shampoo(10, 1e-3),
        "SOAP freq 10 lr 3e-3": shampoo(10, 3e-3, preconditioner="eigenvalue_corrected"),
    }
    if not args.skip_peers:
        for name, make in peers().items():
            if "freq 1)" not in name:
                runs[name] = make
    for name, make in runs.items():
        if isinstance(make, str):
            print(f"{name:40s} {make}")
            continue
        try:
            n, secs, best = accuracy_run(make, data, args.target, args.max_epochs)
        except Exception as exc:
            print(f"{name:40s} failed: {type(exc).__name__}: {exc}")
            continue
        if n is None:
            print(f"{name:40s} not reached in {args.max_epochs} epochs (best {best:.3f})")
        else:
            print(f"{name:40s} {n:6d} steps {secs:8.1f} s (best {best:.3f})")


if __name__ == "__main__":
    main()
