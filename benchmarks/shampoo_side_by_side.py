"""Ours against DistributedShampoo in one process: ``python -m benchmarks.shampoo_side_by_side``.

Run it from the benchmark venv that ``make bench-peers`` builds (it holds
facebookresearch/optimizers at f606606 beside this checkout)::

    out/peers/venv/bin/python -m benchmarks.shampoo_side_by_side            # every configuration
    out/peers/venv/bin/python -m benchmarks.shampoo_side_by_side --quick    # 3 rounds each
    out/peers/venv/bin/python -m benchmarks.shampoo_side_by_side --configs cnn_soap_f10 --rounds 7
    python -m benchmarks.shampoo_side_by_side --device cuda --rounds 3      # on a GPU
    out/peers/venv/bin/python -m benchmarks.shampoo_side_by_side --ops      # ops per step

Each configuration is built twice from the same keyword arguments: once with
DistributedShampoo's own classes, once with :mod:`secondorder.compat.distributed_shampoo`'s
(which maps them onto :class:`secondorder.Shampoo`), on two copies of one model that
see the same batches.  Rounds alternate between the two (ours first in even rounds,
theirs first in odd ones; with AdamW the order rotates), each side taking the same
number of steps per round; only ``optimizer.step()`` is timed, in CPU time of the
(single) thread that runs it, which the other processes of a shared machine disturb far
less than wall time (also reported).  A round's length is a multiple of the
preconditioning frequency, so every round holds the same share of root (or eigenbasis)
refreshes.  Reported: the median over rounds of ours' step time, theirs, and of the
per-round ratio ours/theirs (CPU, and wall); the loss of both models on a fixed batch
after the run (they must agree); the torch thread count (1 unless ``--threads``) and the
load average.  Without DistributedShampoo, ours is timed alone and the table says so.

Overhead (configurations at precondition_frequency 100): ``torch.optim.AdamW`` with the
same learning rate, betas, epsilon and weight decay trains a third copy of the model on
the same batches, in the same interleaved rounds.  Reported: ours/AdamW and
DistributedShampoo/AdamW for the step alone and for the whole iteration (forward,
backward and step); the iteration's is the ratio DistributedShampoo's paper bounds by
1.1 against diagonal methods at scale.  ``block1024_f100``, a larger model for the GPU,
runs only when named.

``--device cuda`` puts models and batches on the GPU and times by the wall clock between
``torch.cuda.synchronize()`` calls (a thread's CPU time does not see the GPU's work): the
step alone with a synchronisation before and after every step, the whole iterations on a
second chunk of the round synchronised only at its ends, since the first chunk's
synchronisations stall the pipeline.  ``--tiny`` shrinks models, batches, rounds and the
frequency so that every path runs in seconds (``make gpu-check --dry-run``): its numbers
measure nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .device_timing import Clock, device_words, to_device, warm_up
from .shampoo_overhead import adamw_like, ops_rows, overhead_table

__all__ = ["CONFIGS", "DEFAULT_CONFIGS", "PeerConfig", "main", "run_config"]

Batches = list[tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class PeerConfig:
    """One side-by-side configuration: a model, its batches, DistributedShampoo's options."""

    key: str
    title: str
    model: Callable[[], nn.Module]
    batches: Callable[[int], Batches]
    loss: Callable[[Tensor, Tensor], Tensor]
    options: Callable[[ModuleType], dict[str, Any]]
    steps_per_round: int
    rounds: int
    #: Also time ``torch.optim.AdamW``: the per-step overhead against a diagonal method.
    overhead: bool = False


def _mnist1d_batches(n: int, batch: int = 128) -> Batches:
    from .workloads import mnist1d

    (x, y), _ = mnist1d(5000)
    out = []
    for i in range(n):
        j = (i * batch) % (x.shape[0] - batch + 1)
        out.append((x[j : j + batch], y[j : j + batch]))
    return out


def _cnn() -> nn.Module:
    from .workloads import mnist1d_cnn

    return mnist1d_cnn()()


def _shampoo(ds: ModuleType, frequency: int) -> dict[str, Any]:
    """The issue's Shampoo row: Adam grafting, AdamW-like betas, decoupled weight decay."""
    return dict(
        lr=3e-3,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-4,
        max_preconditioner_dim=1024,
        precondition_frequency=frequency,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        distributed_config=ds.SingleDeviceDistributedConfig(),
    )


def _soap(ds: ModuleType, frequency: int) -> dict[str, Any]:
    """SOAP with eigh (DistributedShampoo's DefaultEigenvalueCorrectedShampooConfig)."""
    return {
        **_shampoo(ds, frequency),
        "epsilon": 1e-8,
        "preconditioner_config": ds.DefaultEigenvalueCorrectedShampooConfig,
    }


class LinearLayers(nn.Module):
    """A transformer block's Linear layers (no attention): qkv, out, MLP up and down."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + self.out(torch.tanh(q) * k + v)
        return h + self.down(F.gelu(self.up(h)))


def _tokens(d_model: int, rows: int = 256, distinct: int = 0) -> Callable[[int], Batches]:
    """Batches of ``rows`` random tokens; ``distinct`` > 0 cycles that many (memory)."""

    def batches(n: int) -> Batches:
        g = torch.Generator().manual_seed(3)
        target = torch.randn(d_model, d_model, generator=g) / d_model**0.5
        out = []
        for _ in range(min(n, distinct) if distinct else n):
            x = torch.randn(rows, d_model, generator=g)
            out.append((x, torch.tanh(x @ target)))
        return [out[i % len(out)] for i in range(n)]

    return batches


def _signals(n: int) -> Batches:
    """Random 40-point signals and labels, 16 a batch: ``--tiny``'s stand-in for MNIST-1D."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 40, generator=g), torch.randint(0, 10, (16,), generator=g))] * n


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


def _transformer(ds: ModuleType, max_dim: int, frequency: int = 10) -> dict[str, Any]:
    return {**_shampoo(ds, frequency), "max_preconditioner_dim": max_dim}


CONFIGS = {
    c.key: c
    for c in (
        PeerConfig(
            "cnn_shampoo_f100",
            "MNIST-1D CNN, Shampoo (Adam grafting), precondition_frequency 100",
            _cnn, _mnist1d_batches, F.cross_entropy, lambda ds: _shampoo(ds, 100), 100, 5,
            overhead=True,
        ),
        PeerConfig(
            "cnn_shampoo_f1",
            "MNIST-1D CNN, Shampoo (Adam grafting), precondition_frequency 1",
            _cnn, _mnist1d_batches, F.cross_entropy, lambda ds: _shampoo(ds, 1), 4, 5,
        ),
        PeerConfig(
            "cnn_soap_f10",
            "MNIST-1D CNN, SOAP (eigh, Adam grafting), precondition_frequency 10",
            _cnn, _mnist1d_batches, F.cross_entropy, lambda ds: _soap(ds, 10), 10, 5,
        ),
        PeerConfig(
            "block512_dim1024",
            "Transformer block Linear layers (d 512, MLP 2048), blocks <= 1024, freq 10",
            lambda: LinearLayers(512, 2048), _tokens(512), _mse,
            lambda ds: _transformer(ds, 1024), 10, 5,
        ),
        PeerConfig(
            "block512_dim2048",
            "Transformer block Linear layers (d 512, MLP 2048), blocks <= 2048, freq 10",
            lambda: LinearLayers(512, 2048), _tokens(512), _mse,
            lambda ds: _transformer(ds, 2048), 10, 5,
        ),
        PeerConfig(
            "block1024_f100",
            "Transformer block Linear layers (d 1024, MLP 4096), 4096 tokens, Shampoo, "
            "blocks <= 1024, precondition_frequency 100",
            lambda: LinearLayers(1024, 4096), _tokens(1024, rows=4096, distinct=8), _mse,
            lambda ds: _transformer(ds, 1024, frequency=100), 100, 5, overhead=True,
        ),
    )
}  # fmt: skip
#: What runs without ``--configs``: all but the model sized for a GPU.
DEFAULT_CONFIGS = [k for k in CONFIGS if k != "block1024_f100"]


def tiny(config: PeerConfig) -> PeerConfig:
    """``config`` at toy sizes, its frequency at most 2: every path in seconds."""
    from .workloads import mnist1d_cnn

    cnn = config.key.startswith("cnn")

    def options(ds: ModuleType) -> dict[str, Any]:
        opts = config.options(ds)
        return {**opts, "precondition_frequency": min(opts["precondition_frequency"], 2)}

    return replace(
        config,
        model=mnist1d_cnn(channels=4, hidden=16) if cnn else (lambda: LinearLayers(16, 32)),
        batches=_signals if cnn else _tokens(16, rows=16),
        options=options,
        steps_per_round=2,
    )


def _nothing() -> None:
    pass


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Batches,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    clock: Clock,
    per_step: bool = True,
) -> tuple[float, float, float, float]:
    """Train on ``batches``: CPU and wall seconds in ``opt.step()``, then in all of it.

    ``per_step`` synchronises the device before and after every step, so that the step's
    wall time is its own; the whole (forward, backward, step) is synchronised at its ends.
    """
    step_sync = clock.sync if per_step else _nothing
    cpu = wall = 0.0
    clock.sync()
    c_all, t_all = time.thread_time(), time.perf_counter()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        step_sync()
        c0, t0 = time.thread_time(), time.perf_counter()
        opt.step()
        step_sync()
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - t0
    clock.sync()
    return cpu, wall, time.thread_time() - c_all, time.perf_counter() - t_all


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def run_config(
    config: PeerConfig,
    rounds: int,
    steps: int,
    warmup: int,
    device: torch.device | None = None,
    theirs_ds: ModuleType | None = None,
) -> dict[str, Any]:
    """Interleaved rounds of ``steps`` steps per side; medians and the losses after.

    ``theirs_ds`` is DistributedShampoo's module (None: ours, and AdamW, alone).  The
    step's figures are CPU seconds on the CPU and wall seconds on CUDA (``clock``).
    """
    import secondorder.compat.distributed_shampoo as ours_ds

    device = device or torch.device("cpu")
    clock = Clock(device)
    # On CUDA the iterations run on a second chunk, free of the per-step synchronisations.
    chunks = 2 if clock.cuda and config.overhead else 1
    batches = to_device(config.batches(warmup + rounds * steps * chunks + 1), device)
    sides: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for name, ds in (("ours", ours_ds), ("theirs", theirs_ds)):
        if ds is not None:
            model = config.model().to(device)
            sides[name] = model, ds.DistributedShampoo(model.parameters(), **config.options(ds))
    if config.overhead:
        model = config.model().to(device)
        sides["adamw"] = model, adamw_like(config.options(ours_ds), model)
    for name, (model, _) in sides.items():
        if name != "ours":
            model.load_state_dict(sides["ours"][0].state_dict())
    for model, opt in sides.values():
        _train(model, opt, batches[:warmup], config.loss, clock)
    names = list(sides)
    step: dict[str, list[float]] = {n: [] for n in names}  # the step's clock: CPU or wall
    walls: dict[str, list[float]] = {n: [] for n in names}
    iteration: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        start = warmup + r * steps * chunks
        first, second = batches[start : start + steps], batches[start + steps : start + 2 * steps]
        k = r % len(names)  # the order rotates: each side goes first in its share of rounds
        for name in names[k:] + names[:k]:
            model, opt = sides[name]
            cpu, wall, it_cpu, it_wall = _train(model, opt, first, config.loss, clock)
            if chunks == 2:
                it_wall = _train(model, opt, second, config.loss, clock, per_step=False)[3]
            step[name].append((wall if clock.cuda else cpu) / steps)
            walls[name].append(wall / steps)
            iteration[name].append((it_wall if clock.cuda else it_cpu) / steps)
    x, y = batches[-1]
    with torch.no_grad():
        losses = {n: float(config.loss(m(x), y)) for n, (m, _) in sides.items()}
    res: dict[str, Any] = {
        "key": config.key,
        "title": config.title,
        "rounds": rounds,
        "steps_per_round": steps,
        "device": str(device),
        "clock": clock.name,
        "ours_s": statistics.median(step["ours"]),
        "wall_ours_s": statistics.median(walls["ours"]),
        "loss_ours": losses["ours"],
        "peer": "theirs" in sides,
    }
    if "theirs" in sides:
        ratios = _ratios(step["ours"], step["theirs"])
        res |= {
            "theirs_s": statistics.median(step["theirs"]),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "wall_theirs_s": statistics.median(walls["theirs"]),
            "wall_ratio": statistics.median(_ratios(walls["ours"], walls["theirs"])),
            "loss_theirs": losses["theirs"],
        }
    if "adamw" in sides:
        res["overhead"] = {
            "adamw_step_s": statistics.median(step["adamw"]),
            "adamw_iteration_s": statistics.median(iteration["adamw"]),
            **{
                f"{n}_{what}": _ratios(times[n], times["adamw"])
                for n in ("ours", "theirs")
                if n in sides
                for what, times in (("step", step), ("iteration", iteration))
            },
        }
    return res


def _row(res: dict[str, Any], cuda: bool) -> str:
    ours = f"| {res['title']} | {res['rounds']} x {res['steps_per_round']} | "
    ours += f"{res['ours_s'] * 1e3:.1f} ms | "
    if not res["peer"]:
        cells = ["not installed", "-"] + ([] if cuda else ["-"])
        return ours + " | ".join(cells) + f" | {res['loss_ours']:.4f}, - |"
    spread = f"{min(res['ratios']):.2f}-{max(res['ratios']):.2f}"
    wall = "" if cuda else f" {res['wall_ratio']:.2f} |"
    return (
        f"{ours}{res['theirs_s'] * 1e3:.1f} ms | **{res['ratio']:.2f}** ({spread}) |{wall} "
        f"{res['loss_ours']:.4f}, {res['loss_theirs']:.4f} |"
    )


def _import_theirs() -> tuple[ModuleType | None, str]:
    try:
        import distributed_shampoo
    except Exception as exc:  # a peer that does not import is reported, whatever the cause
        return None, f"{type(exc).__name__}: {exc}"
    return distributed_shampoo, ""


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and print the table (and ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=None, help="rounds per configuration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="3 rounds per configuration")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a check, not a measurement")
    ap.add_argument("--budget-s", type=float, default=None, help="start no config after this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ops", action="store_true", help="count each side's ops per step; no timing")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("Invalid --device=cuda: torch sees no CUDA device; pass --device cpu")
    device = torch.device(args.device)
    warm_up(device)
    started = time.perf_counter()
    theirs_ds, why = _import_theirs()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(
        f"# torch {torch.__version__}, {args.threads} thread(s), Python "
        f"{platform.python_version()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; load average before {load_before[0]:.1f}"
        + (
            f"; {device_words(device)}, wall time between synchronisations"
            if device.type == "cuda"
            else ""
        ),
        flush=True,
    )
    if theirs_ds is None:
        print(
            f"# DistributedShampoo is not installed ({why}): ours timed alone. Build the "
            "peer venv with `make bench-peers` (or `make gpu-wheels` for `make gpu-check`)."
        )
    if args.tiny:
        print("# --tiny: toy models and frequencies, a check of the script; nothing measured")
    if args.ops:
        import secondorder.compat.distributed_shampoo as ours_ds

        configs = [tiny(CONFIGS[k]) if args.tiny else CONFIGS[k] for k in args.configs]
        print("\n".join(ops_rows(configs, ours_ds, theirs_ds, device)))
        return 0
    cuda, clock = device.type == "cuda", Clock(device).name
    wall = "" if cuda else " ours / theirs wall |"
    print(f"| configuration | rounds x steps | ours step ({clock}) | theirs step ({clock}) | "
          f"ours / theirs {clock} (range) |{wall} loss after (ours, theirs) |")  # fmt: skip
    print("|---|---|---:|---:|---:|" + ("" if cuda else "---:|") + "---|", flush=True)
    results, failed = [], False
    for key in args.configs:
        c = tiny(CONFIGS[key]) if args.tiny else CONFIGS[key]
        rounds = args.rounds or (1 if args.tiny else 3 if args.quick else c.rounds)
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            print(f"| {c.title} | skipped: --budget-s {args.budget_s:g} spent |", flush=True)
            continue
        try:
            res = run_config(c, rounds, c.steps_per_round, 1 if args.tiny else 2, device, theirs_ds)
        except ModuleNotFoundError as exc:
            if exc.name != "mnist1d":
                raise
            print(f"| {c.title} | skipped: mnist1d is not installed |", flush=True)
            continue
        except Exception as exc:  # the next configurations still run; the exit code says it
            print(f"| {c.title} | failed: {type(exc).__name__}: {exc} |", flush=True)
            failed = True
            continue
        results.append(res)
        print(_row(res, cuda), flush=True)
    overhead = overhead_table(results, clock)
    if overhead:
        print("\n".join(overhead))
    load_after = os.getloadavg()
    print(f"# load average after {load_after[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "threads": args.threads,
                    "device": str(device),
                    "load": [load_before, load_after],
                    "results": results,
                },
                f,
                indent=2,
            )
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
