"""Distributed Shampoo across processes: measured on gloo ranks, and on paper.

``python -m benchmarks.shampoo_scaling [--quick]`` does two things.

**Measures** the MNIST-1D CNN of the Shampoo issue (data parallel: the global batch of
128 split over the ranks, gradients averaged by an all-reduce as DDP would) on 1 and
2 gloo processes of this machine's CPU, one thread each: seconds per iteration and
per ``step()``, and the bytes each rank hands to the all-gather of directions
(:class:`~benchmarks.scaling.CountingReducer`, the real reducer with a tally), next
to :func:`gather_bytes`, the exact count from the LPT block ownership.

**Models** one step at 8 and 64 GPUs (:func:`paper_table`): each rank contributes the
directions of the blocks it owns, so one all-gather of the directions puts
``(p-1)/p`` of the parameters' bytes (in the communication dtype) on every rank's
link with perfect balance; the real all-gather pads every share to the largest
(``(p-1)·max share``).  The compute is the busiest rank's blocks under the LPT rule
(:func:`secondorder.shampoo.assign_blocks`): per step ``4·numel·Σd`` flops per block
(factor products and preconditioning), plus the root inverses ``11·Σd³`` (an
eigendecomposition ≈ 9d³ and the root's reconstruction 2d³) once per
``precondition_frequency`` steps.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from secondorder.shampoo import AdamGraftingConfig, Shampoo, assign_blocks
from secondorder.shampoo.blocking import block_slices, merge_dims
from secondorder.shampoo.distributor import block_cost

from .scaling import (
    CountingReducer,
    ModelAssumptions,
    Traffic,
    comm_seconds,
    fmt_bytes,
    fmt_seconds,
    measure_worlds,
)
from .workloads import mnist1d, mnist1d_cnn

__all__ = [
    "GPT2_SMALL",
    "Config",
    "blocks_of",
    "cached_report",
    "gather_bytes",
    "measure",
    "paper_table",
    "rank_job",
    "report",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class Config:
    """One measured configuration: the CNN's size, the steps and Shampoo's knobs."""

    channels: int = 32
    hidden: int = 256
    batch: int = 128
    steps: int = 6
    frequency: int = 1
    communication_dtype: str = "float32"
    samples: int = 5000

    @property
    def label(self) -> str:
        """One line for the table."""
        return f"freq {self.frequency}, {self.communication_dtype} directions, {self.steps} steps"


# -- the exact count of the all-gather ------------------------------------------------------


def blocks_of(shapes: Sequence[Sequence[int]], max_dim: int = 1024) -> list[tuple[int, ...]]:
    """The block shapes of parameters of ``shapes``, in :class:`Shampoo`'s order."""
    out: list[tuple[int, ...]] = []
    for shape in shapes:
        if math.prod(shape) == 0:
            continue
        merged = merge_dims(shape, max_dim)
        out += [spec.shape for spec in block_slices(merged, max_dim)]
    return out


def gather_bytes(
    shapes: Sequence[Sequence[int]], world: int, itemsize: int, max_dim: int = 1024
) -> list[int]:
    """Bytes each rank contributes to the all-gather of directions in one step.

    Rank r sends the directions of the blocks it owns (LPT on
    :func:`~secondorder.shampoo.distributor.block_cost`), ``itemsize`` bytes per number;
    the shares sum to the parameters' bytes.
    """
    blocks = blocks_of(shapes, max_dim)
    owners = assign_blocks([block_cost(b) for b in blocks], world)
    share = [0] * world
    for b, r in zip(blocks, owners, strict=True):
        share[r] += math.prod(b) * itemsize
    return share


# -- the measurement -------------------------------------------------------------------------


def _model(c: Config) -> nn.Module:
    return mnist1d_cnn(channels=c.channels, hidden=c.hidden)()


def rank_job(rank: int, world: int, c: Config) -> dict[str, Any]:
    """Train ``c.steps`` data-parallel steps on this rank's share of each batch.

    Returns per step the seconds (iteration, ``step()``), the traffic of the gradient
    all-reduce and of the optimizer step (as ``asdict(Traffic)``) and the final
    parameters.
    """
    (x, y), _ = mnist1d(c.samples)
    model = _model(c)
    reducer = CountingReducer()
    opt = Shampoo(
        model.parameters(),
        lr=3e-3,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-4,
        precondition_frequency=c.frequency,
        grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
        reducer=reducer,
        communication_dtype=_DTYPES[c.communication_dtype],
    )
    g = torch.Generator().manual_seed(0)
    rec: dict[str, Any] = {"iteration_s": [], "step_s": [], "grad_traffic": [], "traffic": []}
    for _ in range(c.steps):
        idx = torch.randint(0, x.shape[0], (c.batch,), generator=g)
        mine = torch.tensor_split(idx, world)[rank]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine]) * (len(mine) / c.batch)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        reducer.sum_(grads)  # what DDP's all-reduce does: the gradient of the global batch
        rec["grad_traffic"].append(asdict(reducer.take()))
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        rec["traffic"].append(asdict(reducer.take()))
        rec["iteration_s"].append(t2 - t0)
        rec["step_s"].append(t2 - t1)
    rec["shapes"] = [tuple(p.shape) for p in model.parameters()]
    rec["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return rec


def _median(v: Sequence[float]) -> float:
    return statistics.median(v[1:] or v)  # the first step builds the blocks


def measure(
    configs: Sequence[Config], worlds: Sequence[int] = (1, 2), deadline_s: float = 600.0
) -> list[dict[str, Any]]:
    """Rank 0's seconds and every rank's counted bytes, for each config and world size."""
    rows = []
    for c in configs:
        for world, by_rank in measure_worlds(rank_job, worlds, (c,), deadline_s=deadline_s).items():
            rec = by_rank[0]
            itemsize = _DTYPES[c.communication_dtype].itemsize
            formula = gather_bytes(rec["shapes"], world, itemsize) if world > 1 else [0]
            counted = [
                statistics.fmean(t["allgather"] for t in by_rank[r]["traffic"])
                for r in range(world)
            ]
            n = sum(math.prod(s) for s in rec["shapes"])
            rows.append(
                {
                    "config": c.label,
                    "ranks": world,
                    "parameters": n,
                    "iteration_s": _median(rec["iteration_s"]),
                    "step_s": _median(rec["step_s"]),
                    "gathered_bytes_per_rank": counted,
                    "formula_bytes_per_rank": formula,
                    "received_bytes_per_rank": [sum(formula) - f for f in formula],
                    "grad_allreduce_bytes": statistics.fmean(
                        t["allreduce"] for t in rec["grad_traffic"]
                    ),
                }
            )
    return rows


# -- the paper model ------------------------------------------------------------------------


def _gpt2_small() -> list[tuple[int, ...]]:
    layer = [(2304, 768), (2304,), (768, 768), (768,), (3072, 768), (3072,), (768, 3072)]
    layer += [(768,)] * 5  # projection bias, two LayerNorms' weight and bias
    return [s for _ in range(12) for s in layer]


#: GPT-2 small's 12 transformer layers (85M parameters; embeddings left out).
GPT2_SMALL = _gpt2_small()


def _flops(block: tuple[int, ...], frequency: int) -> float:
    numel = math.prod(block)
    return 4.0 * numel * sum(block) + 11.0 * sum(d**3 for d in block) / frequency


def paper_table(
    models: Sequence[tuple[str, Sequence[Sequence[int]]]],
    assumptions: ModelAssumptions,
    worlds: Sequence[int] = (1, 8, 64),
    frequencies: Sequence[int] = (1, 100),
    itemsizes: Sequence[int] = (4, 2),
) -> list[dict[str, Any]]:
    """Bytes, communication and compute seconds of one step per model, p, frequency, dtype."""
    a = assumptions
    rows = []
    for name, shapes in models:
        blocks = blocks_of(shapes)
        n = sum(math.prod(b) for b in blocks)
        for f in frequencies:
            for p in worlds:
                owners = assign_blocks([block_cost(b) for b in blocks], p)
                load = [0.0] * p
                for b, r in zip(blocks, owners, strict=True):
                    load[r] += _flops(b, f)
                for itemsize in itemsizes[:1] if p == 1 else itemsizes:
                    share = gather_bytes(shapes, p, itemsize)
                    t = Traffic()
                    if p > 1:
                        t = Traffic(
                            allgather=max(share),
                            allgather_calls=1,
                            allreduce=2 * p * 8,
                            allreduce_calls=1,
                        )
                    rows.append(
                        {
                            "model": name,
                            "parameters": n,
                            "blocks": len(blocks),
                            "frequency": f,
                            "ranks": p,
                            "dtype_bytes": itemsize,
                            "received_balanced": (p - 1) / p * n * itemsize,
                            "received_padded": (p - 1) * max(share),
                            "comm_s": comm_seconds(t, p, a.bandwidth, a.latency),
                            "compute_s": max(load) / a.flops,
                            "balance": sum(load) / (p * max(load)),
                        }
                    )
    return rows


# -- the report ---------------------------------------------------------------------------


def report(
    configs: Sequence[Config], assumptions: ModelAssumptions | None = None
) -> dict[str, Any]:
    """The measured table (no configs: none) and the paper model, as data and markdown."""
    lines: list[str] = []
    out: dict[str, Any] = {}
    if configs:
        rows = measure(configs)
        c = configs[0]
        lines += [
            f"Measured: the MNIST-1D CNN ({rows[0]['parameters']} parameters), global batch "
            f"{c.batch} split over the ranks, gradients all-reduced, gloo on "
            "CPU, 1 thread per rank; median s after the first step (rank 0). Gathered: "
            "bytes each rank hands to the all-gather of directions per step (counted), "
            "next to the LPT formula.",
            "",
            "| config | ranks | s/iteration | s/step() | gathered per rank (counted) "
            "| formula | received per rank | gradient all-reduce |",
            "|---|---:|---:|---:|---|---|---|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['config']} | {r['ranks']} | {r['iteration_s']:.4f} | {r['step_s']:.4f} "
                f"| {' / '.join(fmt_bytes(b) for b in r['gathered_bytes_per_rank'])} "
                f"| {' / '.join(fmt_bytes(b) for b in r['formula_bytes_per_rank'])} "
                f"| {' / '.join(fmt_bytes(b) for b in r['received_bytes_per_rank'])} "
                f"| {fmt_bytes(r['grad_allreduce_bytes'])} |"
            )
        out["measured"] = rows
    a = assumptions or ModelAssumptions()
    models = [("MNIST-1D CNN", [tuple(p.shape) for p in _model(Config()).parameters()])]
    models.append(("GPT-2 small layers", GPT2_SMALL))
    table = paper_table(models, a)
    lines += [
        "",
        f"Model: ring all-gather (p-1)·B/β + (p-1)·α of the largest share B (the gather "
        f"pads to it), β = {a.bandwidth / 1e9:g} GB/s, α = {a.latency * 1e6:g} µs; compute "
        f"of the busiest rank under LPT at {a.flops / 1e12:g} TFLOP/s (4·numel·Σd per step, "
        "11·Σd³ per root refresh); balance = mean load / busiest load. max_preconditioner_dim "
        "1024; the gradient all-reduce (the same for AdamW) is left out.",
        "",
        "| model | blocks | freq | GPUs | dtype | (p-1)/p·bytes | received (padded) "
        "| comm | compute | balance |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['model']} ({r['parameters'] / 1e6:.3g}M) | {r['blocks']} | {r['frequency']} "
            f"| {r['ranks']} | {'fp32' if r['dtype_bytes'] == 4 else 'bf16'} "
            f"| {fmt_bytes(r['received_balanced'])} | {fmt_bytes(r['received_padded'])} "
            f"| {fmt_seconds(r['comm_s'])} | {fmt_seconds(r['compute_s'])} | {r['balance']:.2f} |"
        )
    out["model"] = {"assumptions": asdict(a), "rows": table}
    out["markdown"] = "\n".join(lines)
    return out


QUICK = (
    Config(steps=4, frequency=1),
    Config(steps=6, frequency=100, communication_dtype="bfloat16"),
)
FULL = (
    Config(steps=8, frequency=1),
    Config(steps=12, frequency=100),
    Config(steps=12, frequency=100, communication_dtype="bfloat16"),
)


@functools.lru_cache(maxsize=2)
def cached_report(mode: str) -> dict[str, Any]:
    """:func:`report` for ``mode`` (``"quick"`` or ``"full"``), measured once per process."""
    return report(QUICK if mode == "quick" else FULL)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.shampoo_scaling``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shampoo_scaling", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer steps and configs")
    ap.add_argument("--no-measure", action="store_true", help="print the paper model only")
    args = ap.parse_args(argv)
    configs: Sequence[Config] = () if args.no_measure else QUICK if args.quick else FULL
    print(report(configs)["markdown"])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
