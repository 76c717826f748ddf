"""K-FAC across processes: COMM-OPT, MEM-OPT and HYBRID-OPT, measured and on paper.

``python -m benchmarks.kfac_scaling [--quick]`` **measures** seconds per step of K-FAC +
SGD on the MNIST-1D CNN (global batch 128 split over the ranks) on 1 and 2 gloo
processes, each rank's bytes counted by :class:`~benchmarks.scaling.CountingReducer`
(the real reducer with a tally), next to :func:`step_traffic`'s prediction.  Each step is
what a data-parallel K-FAC user runs: forward and backward on the rank's shard, the
gradient all-reduce (DDP's; here through the same reducer, so it is counted), then
``KFAC.step()`` and SGD.  It then **models** bytes and seconds per step at 8 and 64 GPUs
with the ring costs of :func:`benchmarks.scaling.comm_seconds`.

What one rank hands to collectives in one step (``k`` = gradient workers per layer,
``W/k`` worker groups; :mod:`secondorder.kfac.assignment`):

* every step: the gradient all-reduce, every parameter (float32);
* on a factor update: one all-reduce of every layer's ``Σ a aᵀ`` and ``Σ g gᵀ``
  (``groups·n²`` each, or the upper triangles ``groups·n(n+1)/2`` with
  ``symmetry_aware=True``) and a ``layers × 2`` float64 table of counts;
* on an inverse update, when ``k > 1``: the decompositions of the layers of this rank's
  worker group, broadcast inside it (eigen: ``Q_A, d_A, Q_G, d_G``; inverse: ``A⁻¹,
  G⁻¹``; float32), one call per source rank that owns some;
* every step, when ``W/k > 1``: the preconditioned gradients of every layer, broadcast
  by their worker group over the receiver groups, one call per worker group that owns
  some;
* every step: two small all-reduces in which the ranks agree to go on
  (:mod:`secondorder.kfac.agreement`), a ``W × (9 + ⌈layers/52⌉)`` float64 table
  before the step's collectives and a ``W × 1`` one before it writes anything.

COMM-OPT (``k = W``) sends every decomposition and no gradient; MEM-OPT (``k = 1``) no
decomposition and every preconditioned gradient; HYBRID-OPT (here ``k = W/2``) between.
On 2 ranks HYBRID-OPT's ``k = 1`` is MEM-OPT: it differs from both only from 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secondorder.distributed import LocalReducer
from secondorder.kfac import KFAC
from secondorder.kfac.assignment import assign_work, factor_cost

from .scaling import CountingReducer, Traffic, comm_seconds, fmt_bytes, measure_worlds, step_summary

__all__ = [
    "STRATEGIES",
    "KFACAssumptions",
    "LayerSpec",
    "ScalingProblem",
    "agreement_traffic",
    "grad_workers",
    "layer_specs",
    "linear_spec",
    "measure",
    "paper_table",
    "rank_job",
    "report",
    "step_traffic",
]

#: The strategies and their ``grad_worker_fraction``.
STRATEGIES: dict[str, float | str] = {
    "COMM-OPT": "comm-opt",
    "MEM-OPT": "mem-opt",
    "HYBRID-OPT": 0.5,
}


def grad_workers(strategy: str, world: int) -> int:
    """``k``, the ranks that precondition each layer, for ``strategy`` on ``world`` ranks."""
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy={strategy!r}; valid choices are {tuple(STRATEGIES)}.")
    f = STRATEGIES[strategy]
    if f == "comm-opt":
        return world
    if f == "mem-opt":
        return 1
    assert isinstance(f, float)
    return max(1, round(world * f))


# -- the layers and the traffic --------------------------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """What one K-FAC layer puts on the wire: factor orders, groups and parameters."""

    name: str
    groups: int
    a_order: int
    g_order: int
    params: int

    def factor_numbers(self, packed: bool) -> int:
        """Numbers of ``Σ a aᵀ`` and ``Σ g gᵀ`` (upper triangles when ``packed``)."""
        if packed:
            tri = self.a_order * (self.a_order + 1) // 2 + self.g_order * (self.g_order + 1) // 2
            return self.groups * tri
        return self.groups * (self.a_order**2 + self.g_order**2)

    def inverse_numbers(self, method: str) -> int:
        """Numbers of the decomposition (eigen: both eigenbases and spectra)."""
        a, g = self.a_order, self.g_order
        extra = a + g if method == "eigen" else 0
        return self.groups * (a * a + g * g + extra)

    def cost(self, strategy: str = "compute") -> float:
        """The assignment cost :func:`~secondorder.kfac.assignment.factor_cost` gives it."""
        return factor_cost([self.a_order, self.g_order], strategy)


def linear_spec(name: str, n_in: int, n_out: int) -> LayerSpec:
    """A Linear layer with bias, as K-FAC sees it (the bias is a last column of A)."""
    return LayerSpec(name, 1, n_in + 1, n_out, n_out * (n_in + 1))


def layer_specs(kfac: KFAC) -> list[LayerSpec]:
    """The specs of every layer a built :class:`~secondorder.KFAC` preconditions."""
    out = []
    for name, layer in kfac.layers.items():
        (ga, a, _), (_, g, _) = layer.factor_shapes()
        params = sum(p.numel() for p in layer.params())
        out.append(LayerSpec(name, ga, a, g, params))
    return out


def step_traffic(
    layers: Sequence[LayerSpec],
    world: int,
    k: int,
    rank: int,
    *,
    factor_update: bool,
    inverse_update: bool,
    method: str = "inverse",
    packed: bool = False,
    total_params: int | None = None,
    assignment: Mapping[str, int] | None = None,
    itemsize: int = 4,
) -> Traffic:
    """The bytes ``rank`` hands to collectives in one step (see the module docstring).

    ``total_params`` is what the gradient all-reduce carries (default: the layers'
    parameters); ``assignment`` maps each layer to its inverse worker (default: the
    library's :func:`~secondorder.kfac.assignment.assign_work` on ``compute`` costs).
    """
    if world <= 1:
        return Traffic()
    if assignment is None:
        costs = {s.name: s.cost() for s in layers}
        assignment = assign_work(costs, world, k).inverse_worker
    params = total_params if total_params is not None else sum(s.params for s in layers)
    t = Traffic(allreduce=params * itemsize, allreduce_calls=1)
    if layers:  # (no layers: the gradient all-reduce alone, for the paper model's parts)
        t += agreement_traffic(len(layers), world)
    if factor_update:
        numbers = sum(s.factor_numbers(packed) for s in layers)
        t += Traffic(allreduce=numbers * itemsize + 16 * len(layers), allreduce_calls=1)
    block = rank // k
    if inverse_update and k > 1:
        mine = [s for s in layers if assignment[s.name] // k == block]
        sources = {assignment[s.name] for s in mine}
        numbers = sum(s.inverse_numbers(method) for s in mine)
        t += Traffic(broadcast=numbers * itemsize, broadcast_calls=len(sources))
    if world // k > 1:
        blocks = {assignment[s.name] // k for s in layers}
        numbers = sum(s.params for s in layers)
        t += Traffic(broadcast=numbers * itemsize, broadcast_calls=len(blocks))
    return t


def agreement_traffic(layers: int, world: int) -> Traffic:
    """The two agreement tables of one K-FAC step (float64, one row per rank)."""
    columns = 9 + -(-layers // 52) + 1
    return Traffic(allreduce=8 * world * columns, allreduce_calls=2)


# -- the measured problem --------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingProblem:
    """The measured run: a model, a global batch split over the ranks, K-FAC's options."""

    network: str = "mnist1d_cnn"
    batch: int = 128
    steps: int = 6
    every: int = 1
    method: str = "inverse"
    packed: bool = True
    lr: float = 0.1
    damping: float = 0.01

    def model(self) -> nn.Module:
        from .workloads import mlp, mnist1d_cnn

        if self.network == "mnist1d_cnn":
            return mnist1d_cnn()()
        if self.network == "tiny_mlp":
            return mlp([6, 5, 4, 3])()
        raise ValueError(f"Unknown network={self.network!r}; use 'mnist1d_cnn' or 'tiny_mlp'.")

    def data(self) -> tuple[Tensor, Tensor]:
        """``steps`` global batches, fixed by a seed (MNIST-1D for the CNN)."""
        n = self.batch * self.steps
        if self.network == "mnist1d_cnn":
            from .workloads import mnist1d

            (x, y), _ = mnist1d()
            return x[:n], y[:n]
        g = torch.Generator().manual_seed(3)
        return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def kfac(self, model: nn.Module, strategy: str, reducer: Any) -> KFAC:
        return KFAC(
            model,
            factor_update_steps=self.every,
            inv_update_steps=self.every,
            damping=self.damping,
            kl_clip=None,
            lr=self.lr,
            compute_method=self.method,
            grad_worker_fraction=STRATEGIES[strategy],
            symmetry_aware=self.packed,
            reducer=reducer,
        )


QUICK = ScalingProblem(steps=6, every=1)
FULL = ScalingProblem(steps=12, every=1)


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def rank_job(
    rank: int, world: int, problem: ScalingProblem, strategies: Sequence[str]
) -> list[dict[str, Any]]:
    """One rank of a measurement (under :func:`~benchmarks.scaling.launch_ranks`)."""
    x, y = problem.data()
    out = []
    for strategy in strategies:
        reducer = CountingReducer()
        model = problem.model()
        kfac = problem.kfac(model, strategy, reducer)
        opt = torch.optim.SGD(model.parameters(), lr=problem.lr, momentum=0.9)
        reducer.take()  # construction (settings check, sub-groups) is not a step
        rec: dict[str, Any] = {
            "strategy": strategy,
            "grad_workers": kfac.assignment.grad_workers,
            "assignment": dict(kfac.assignment.inverse_worker),
            "layers": [asdict(s) for s in layer_specs(kfac)],
            "params": sum(p.numel() for p in model.parameters()),
            "seconds": [],
            "traffic": [],
            "factor_update": [],
            "inverse_update": [],
        }
        for step in range(problem.steps):
            sl = slice(step * problem.batch, (step + 1) * problem.batch)
            xs = torch.tensor_split(x[sl], world)[rank]
            ys = torch.tensor_split(y[sl], world)[rank]
            rec["factor_update"].append(kfac.steps % problem.every == 0)
            rec["inverse_update"].append(kfac.steps % problem.every == 0)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xs), ys).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            reducer.sum_(grads)  # what DDP does: the mean gradient of the global batch
            for g in grads:
                g.div_(world)
            kfac.step()
            opt.step()
            rec["seconds"].append(time.perf_counter() - t0)
            rec["traffic"].append(asdict(reducer.take()))
        rec["final_params"] = _flat(model)
        out.append(rec)
    return out


def measure(
    problem: ScalingProblem,
    worlds: Sequence[int] = (1, 2),
    strategies: Sequence[str] = tuple(STRATEGIES),
    deadline_s: float = 600.0,
) -> tuple[list[dict[str, Any]], dict[int, dict[int, Any]]]:
    """Rows of s/step and bytes/step per world and strategy (rank 0), and the raw results."""
    raw = measure_worlds(rank_job, worlds, (problem, tuple(strategies)), deadline_s=deadline_s)
    rows = []
    for world, by_rank in raw.items():
        for rank0 in by_rank[0]:
            layers = [LayerSpec(**d) for d in rank0["layers"]]
            summary = step_summary(rank0["seconds"], rank0["traffic"])
            model = [
                step_traffic(
                    layers,
                    world,
                    rank0["grad_workers"],
                    0,
                    factor_update=f,
                    inverse_update=i,
                    method=problem.method,
                    packed=problem.packed,
                    total_params=rank0["params"],
                    assignment=rank0["assignment"],
                )
                for f, i in zip(rank0["factor_update"], rank0["inverse_update"], strict=True)
            ]
            bytes_model = sum(t.allreduce + t.broadcast + t.allgather for t in model)
            rows.append(
                {
                    "strategy": rank0["strategy"],
                    "ranks": world,
                    "grad_workers": rank0["grad_workers"],
                    "s_per_step": summary["s_per_step"],
                    "bytes_per_step": summary["bytes_per_step"],
                    "model_bytes_per_step": bytes_model / len(model),
                    "ranks_agree_bitwise": all(
                        torch.equal(r[j]["final_params"], rank0["final_params"])
                        for r in by_rank.values()
                        for j in range(len(r))
                        if r[j]["strategy"] == rank0["strategy"]
                    ),
                }
            )
    return rows, raw


# -- the paper model -----------------------------------------------------------------------


@dataclass(frozen=True)
class KFACAssumptions:
    """The cluster of the paper model.

    One 200 Gb/s InfiniBand link per GPU (25 GB/s, 5 µs per message, as LM's model), a
    GPU sustaining 50 TFLOP/s in float32 (an H100 SXM peaks at 67 without tensor cores),
    float32 factors and decompositions, the inverse method (a Cholesky inverse, ``n³``
    flops per factor), factors and inverses updated every ``every`` steps.
    """

    bandwidth: float = 25e9
    latency: float = 5e-6
    flops: float = 50e12
    every: int = 10


def _bert_ffn() -> list[LayerSpec]:
    out = []
    for b in range(24):
        out.append(linear_spec(f"{b}.up", 1024, 4096))
        out.append(linear_spec(f"{b}.down", 4096, 1024))
    return out


def _cnn_specs() -> list[LayerSpec]:
    from .workloads import mnist1d_cnn

    kfac = KFAC(mnist1d_cnn()(), reducer=LocalReducer())
    kfac.remove_hooks()
    return layer_specs(kfac)


#: The networks of the paper model: (name, layers).
def paper_networks() -> list[tuple[str, list[LayerSpec]]]:
    """The MNIST-1D CNN (measured here) and BERT-Large's 48 feed-forward Linear layers."""
    return [
        ("MNIST-1D CNN (4 layers, 0.34 M parameters)", _cnn_specs()),
        ("BERT-Large FFN layers: 24 x Linear(1024,4096)+Linear(4096,1024), 201 M", _bert_ffn()),
    ]


def paper_table(
    a: KFACAssumptions, worlds: Sequence[int] = (8, 64), method: str = "inverse"
) -> list[dict[str, Any]]:
    """Bytes and seconds per step (averaged over ``a.every`` steps) on the busiest rank."""
    rows = []
    for net, layers in paper_networks():
        for strategy in STRATEGIES:
            for p in worlds:
                k = grad_workers(strategy, p)
                asg = assign_work({s.name: s.cost() for s in layers}, p, k)
                worst: dict[str, float] | None = None
                for rank in range(p):
                    upd = step_traffic(
                        layers, p, k, rank, factor_update=True, inverse_update=True,
                        method=method, packed=True, assignment=asg.inverse_worker,
                    )  # fmt: skip
                    plain = step_traffic(
                        layers, p, k, rank, factor_update=False, inverse_update=False,
                        method=method, packed=True, assignment=asg.inverse_worker,
                    )  # fmt: skip
                    grad = step_traffic(
                        [], p, k, rank, factor_update=False, inverse_update=False,
                        total_params=sum(s.params for s in layers), assignment={},
                    )  # fmt: skip
                    row = _seconds(a, layers, asg.inverse_worker, p, k, rank, upd, plain, grad)
                    if worst is None or row["total_s"] > worst["total_s"]:
                        worst = row
                assert worst is not None
                rows.append({"network": net, "strategy": strategy, "gpus": p, "k": k, **worst})
    return rows


def _seconds(
    a: KFACAssumptions,
    layers: Sequence[LayerSpec],
    assignment: Mapping[str, int],
    p: int,
    k: int,
    rank: int,
    upd: Traffic,
    plain: Traffic,
    grad: Traffic,
) -> dict[str, float]:
    e = a.every
    # the parts of each traffic, each over the group it travels in
    factor = Traffic(
        allreduce=upd.allreduce - plain.allreduce,
        allreduce_calls=upd.allreduce_calls - plain.allreduce_calls,
    )
    agreement = Traffic(
        allreduce=plain.allreduce - grad.allreduce,
        allreduce_calls=plain.allreduce_calls - grad.allreduce_calls,
    )
    inverse = Traffic(
        broadcast=upd.broadcast - plain.broadcast,
        broadcast_calls=upd.broadcast_calls - plain.broadcast_calls,
    )
    pre = Traffic(broadcast=plain.broadcast, broadcast_calls=plain.broadcast_calls)
    comm = comm_seconds(grad, p, a.bandwidth, a.latency)
    comm += comm_seconds(agreement, p, a.bandwidth, a.latency)
    comm += comm_seconds(factor, p, a.bandwidth, a.latency) / e
    comm += comm_seconds(inverse, k, a.bandwidth, a.latency) / e
    comm += comm_seconds(pre, p // k, a.bandwidth, a.latency)
    decomp = sum(
        s.groups * (s.a_order**3 + s.g_order**3) for s in layers if assignment[s.name] == rank
    )
    block = rank // k
    precond = sum(
        2.0 * s.groups * (s.g_order * s.a_order**2 + s.g_order**2 * s.a_order)
        for s in layers
        if assignment[s.name] // k == block
    )
    compute = (decomp / e + precond) / a.flops
    bytes_step = (upd.allreduce + upd.broadcast) / e + (plain.allreduce + plain.broadcast) * (
        e - 1
    ) / e
    return {
        "bytes_per_step": bytes_step,
        "comm_s": comm,
        "compute_s": compute,
        "total_s": comm + compute,
    }


# -- report ----------------------------------------------------------------------------------


def _secs(s: float) -> str:
    if s >= 0.9995:
        return f"{s:.3g} s"
    if s >= 0.9995e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def report(
    problem: ScalingProblem | None,
    worlds: Sequence[int] = (1, 2),
    assumptions: KFACAssumptions | None = None,
) -> tuple[str, dict[str, Any]]:
    """The measured table (none when ``problem`` is None) and the paper model."""
    a = assumptions or KFACAssumptions()
    lines: list[str] = []
    out: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}"}
    if problem is not None:
        rows, _ = measure(problem, worlds)
        lines += [
            f"Measured: {problem.network}, global batch {problem.batch} split over the ranks, "
            f"{problem.steps} steps, factors and inverses every {problem.every} step(s), "
            f"{problem.method} method, symmetry_aware={problem.packed}, gloo on CPU, 1 torch "
            f"thread per rank, {os.cpu_count()} CPUs; median s/step after the first; bytes "
            "per rank per step counted by CountingReducer (gradient all-reduce included).",
            "",
            "| strategy | ranks | k | s/step | bytes/step (counted) | model "
            "| ranks bitwise equal |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['strategy']} | {r['ranks']} | {r['grad_workers']} | "
                f"{r['s_per_step']:.4f} | {fmt_bytes(r['bytes_per_step'])} | "
                f"{fmt_bytes(r['model_bytes_per_step'])} | {r['ranks_agree_bitwise']} |"
            )
        out["measured"] = rows
    table = paper_table(a)
    lines += [
        "",
        f"Model (busiest rank, per step averaged over {a.every} steps with one factor and "
        f"inverse update): β = {a.bandwidth / 1e9:g} GB/s, α = {a.latency * 1e6:g} µs, "
        f"{a.flops / 1e12:g} TFLOP/s float32; triangular factor all-reduce, inverse method "
        "(Cholesky inverse n³ per factor on its inverse worker, preconditioning "
        "2(o·i² + o²·i) on each gradient worker); HYBRID-OPT k = W/2. Forward, backward "
        "and factor statistics (which divide by the GPUs) are left out.",
        "",
        "| network | strategy | GPUs | k | bytes/step | comm | compute | total |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['network']} | {r['strategy']} | {r['gpus']} | {r['k']} | "
            f"{fmt_bytes(r['bytes_per_step'])} | {_secs(r['comm_s'])} | {_secs(r['compute_s'])} "
            f"| {_secs(r['total_s'])} |"
        )
    out["model"] = {"assumptions": asdict(a), "rows": table}
    return "\n".join(lines), out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.kfac_scaling [--quick] [--ranks 1 2] [--no-measure]``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.kfac_scaling", description=__doc__)
    p.add_argument("--quick", action="store_true", help="6 steps instead of 12")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes")
    p.add_argument("--no-measure", action="store_true", help="print the paper model only")
    p.add_argument("--json", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)
    if any(r < 1 for r in args.ranks):
        raise SystemExit(f"--ranks must be >= 1, got {args.ranks}")
    problem = None if args.no_measure else QUICK if args.quick else FULL
    text, out = report(problem, args.ranks)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
