"""Ours against DistributedShampoo in one process: ``python -m benchmarks.shampoo_side_by_side``.

Run it from the benchmark venv that ``make bench-peers`` builds (it holds
facebookresearch/optimizers at f606606 beside this checkout)::

    out/peers/venv/bin/python -m benchmarks.shampoo_side_by_side            # every configuration
    out/peers/venv/bin/python -m benchmarks.shampoo_side_by_side --quick    # 3 rounds each
    out/peers/venv/bin/python -m benchmarks.shampoo_side_by_side --configs cnn_soap_f10 --rounds 7

Each configuration is built twice from the same keyword arguments: once with
DistributedShampoo's own classes, once with :mod:`secondorder.compat.distributed_shampoo`'s
(which maps them onto :class:`secondorder.Shampoo`), on two copies of one model that
see the same batches.  Rounds alternate between the two (ours first in even rounds,
theirs first in odd ones), each side taking the same number of steps per round; only
``optimizer.step()`` is timed, in CPU time of the (single) thread that runs it, which
the other processes of a shared machine disturb far less than wall time (also
reported).  A round's length is a multiple of the preconditioning
frequency, so every round holds the same share of root (or eigenbasis) refreshes.
Reported: the median over rounds of ours' step time, theirs, and of the per-round
ratio ours/theirs (CPU, and wall); the loss of both models on a fixed batch after the run (they must
agree); the torch thread count (1 unless ``--threads``) and the load average.
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
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CONFIGS", "PeerConfig", "main", "run_config"]


@dataclass(frozen=True)
class PeerConfig:
    """One side-by-side configuration: a model, its batches, DistributedShampoo's options."""

    key: str
    title: str
    model: Callable[[], nn.Module]
    batches: Callable[[int], list[tuple[Tensor, Tensor]]]
    loss: Callable[[Tensor, Tensor], Tensor]
    options: Callable[[ModuleType], dict[str, Any]]
    steps_per_round: int
    rounds: int


def _mnist1d_batches(n: int, batch: int = 128) -> list[tuple[Tensor, Tensor]]:
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


def _tokens(d_model: int) -> Callable[[int], list[tuple[Tensor, Tensor]]]:
    def batches(n: int) -> list[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(3)
        target = torch.randn(d_model, d_model, generator=g) / d_model**0.5
        out = []
        for _ in range(n):
            x = torch.randn(256, d_model, generator=g)
            out.append((x, torch.tanh(x @ target)))
        return out

    return batches


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


def _transformer(ds: ModuleType, max_dim: int) -> dict[str, Any]:
    return {**_shampoo(ds, 10), "max_preconditioner_dim": max_dim}


CONFIGS = {
    c.key: c
    for c in (
        PeerConfig(
            "cnn_shampoo_f100",
            "MNIST-1D CNN, Shampoo (Adam grafting), precondition_frequency 100",
            _cnn, _mnist1d_batches, F.cross_entropy, lambda ds: _shampoo(ds, 100), 100, 5,
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
    )
}  # fmt: skip


def _side(ds: ModuleType, config: PeerConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = config.model()
    return model, ds.DistributedShampoo(model.parameters(), **config.options(ds))


def _steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[Tensor, Tensor]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> tuple[float, float]:
    """Train on ``batches``; the CPU and wall seconds spent in ``opt.step()``."""
    cpu = wall = 0.0
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        c0, t0 = time.thread_time(), time.perf_counter()
        opt.step()
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - t0
    return cpu, wall


def run_config(config: PeerConfig, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Interleaved rounds of ``steps`` steps per side; medians and the losses after."""
    import distributed_shampoo as theirs_ds

    import secondorder.compat.distributed_shampoo as ours_ds

    batches = config.batches(warmup + rounds * steps + 1)
    sides = {"ours": _side(ours_ds, config), "theirs": _side(theirs_ds, config)}
    sides["theirs"][0].load_state_dict(sides["ours"][0].state_dict())
    for model, opt in sides.values():
        _steps(model, opt, batches[:warmup], config.loss)
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    walls: dict[str, list[float]] = {"ours": [], "theirs": []}
    for r in range(rounds):
        chunk = batches[warmup + r * steps : warmup + (r + 1) * steps]
        order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
        for name in order:
            model, opt = sides[name]
            cpu, wall = _steps(model, opt, chunk, config.loss)
            times[name].append(cpu / steps)
            walls[name].append(wall / steps)
    x, y = batches[-1]
    with torch.no_grad():
        losses = {name: float(config.loss(m(x), y)) for name, (m, _) in sides.items()}
    ratios = [o / t for o, t in zip(times["ours"], times["theirs"], strict=True)]
    wall_ratios = [o / t for o, t in zip(walls["ours"], walls["theirs"], strict=True)]
    return {
        "key": config.key,
        "title": config.title,
        "rounds": rounds,
        "steps_per_round": steps,
        "ours_s": statistics.median(times["ours"]),
        "theirs_s": statistics.median(times["theirs"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "wall_ours_s": statistics.median(walls["ours"]),
        "wall_theirs_s": statistics.median(walls["theirs"]),
        "wall_ratio": statistics.median(wall_ratios),
        "loss_ours": losses["ours"],
        "loss_theirs": losses["theirs"],
    }


def _row(res: dict[str, Any]) -> str:
    spread = f"{min(res['ratios']):.2f}-{max(res['ratios']):.2f}"
    return (
        f"| {res['title']} | {res['rounds']} x {res['steps_per_round']} | "
        f"{res['ours_s'] * 1e3:.1f} ms | {res['theirs_s'] * 1e3:.1f} ms | "
        f"**{res['ratio']:.2f}** ({spread}) | {res['wall_ratio']:.2f} | "
        f"{res['loss_ours']:.4f}, {res['loss_theirs']:.4f} |"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and print the table (and ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=None, help="rounds per configuration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="3 rounds per configuration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import distributed_shampoo  # noqa: F401
    except ImportError as exc:
        print(
            f"distributed_shampoo does not import ({exc}); build the peer venv with "
            "`make bench-peers` and run this with out/peers/venv/bin/python.",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    print(
        f"# torch {torch.__version__}, {args.threads} thread(s), Python "
        f"{platform.python_version()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; load average before {load_before[0]:.1f}",
        flush=True,
    )
    print("| configuration | rounds x steps | ours step (CPU) | theirs step (CPU) | ours / theirs "
          "CPU (range) | ours / theirs wall | loss after (ours, theirs) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---|", flush=True)
    results = []
    for key in args.configs:
        c = CONFIGS[key]
        rounds = args.rounds or (3 if args.quick else c.rounds)
        res = run_config(c, rounds, c.steps_per_round, warmup=2)
        results.append(res)
        print(_row(res), flush=True)
    load_after = os.getloadavg()
    print(f"# load average after {load_after[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": args.threads, "load": [load_before, load_after], "results": results},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
