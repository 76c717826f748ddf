"""How each form of the LM step scales across processes: measured, and on paper.

``python -m benchmarks.scaling`` does two things.

**Measures** seconds per step of one fixed problem (strong scaling: the global batch
is split over the ranks) on 1, 2 and 4 gloo processes on this machine's CPU, for
the three ways an LM step meets the ranks (:mod:`secondorder.lm.linalg`):

* ``primal``: the n×n Gram is all-reduced, every rank factors it (cholesky);
* ``dual``: the m rows of J are all-gathered, every rank factors ``J D⁻¹Jᵀ``;
* ``cg``: J stays where it was computed, each CG iteration all-reduces an n-vector.

Every rank counts the bytes it hands to the collectives (:class:`CountingReducer`,
the real :class:`~secondorder.distributed.ProcessGroupReducer` with a tally), and
the table shows them next to the model's prediction.

**Models** the traffic of one step (:func:`step_traffic`, exact for this library's
collectives) and its time on a cluster (:func:`comm_seconds`) with the standard
costs of ring algorithms: an all-reduce of B bytes over p ranks takes
``2(p-1)/p · B/β + 2(p-1)·α``, an all-gather of B bytes from each rank
``(p-1)·B/β + (p-1)·α``, a pipelined broadcast ``B/β + ⌈log₂ p⌉·α`` (β the link
bandwidth, α the latency per message).  Next to it, the arithmetic each rank does
(:func:`step_flops`) at an assumed device throughput, so that the tables show where
each form stops scaling: the primal form's n² all-reduce and its n³ factorisation
do not shrink with p; the dual form gathers all of J and factors an m×m matrix on
every rank; CG divides the products by p but pays one all-reduce latency per
iteration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from secondorder import LevenbergMarquardt
from secondorder.distributed import LocalReducer, ProcessGroupReducer
from secondorder.testing import run_ranks

__all__ = [
    "FORMS",
    "CountingReducer",
    "ModelAssumptions",
    "Traffic",
    "add_scaling_parser",
    "comm_seconds",
    "fmt_bytes",
    "fmt_seconds",
    "launch_ranks",
    "measure",
    "measure_worlds",
    "paper_table",
    "run_scaling",
    "step_flops",
    "step_summary",
    "step_traffic",
]

#: The forms compared, and the optimizer options that select them.
FORMS: dict[str, dict[str, Any]] = {
    "primal": {"form": "primal", "solver": "cholesky"},
    "dual": {"form": "dual", "solver": "cholesky"},
    "cg": {"form": "primal", "solver": "cg"},
}


# -- the traffic of one step -------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank hands to collectives in one step, and how many calls.

    Attributes:
        allreduce: bytes summed by all-reduce (each rank's contribution).
        broadcast: bytes broadcast from rank 0.
        allgather: bytes this rank contributes to all-gathers.
        allreduce_calls, broadcast_calls, allgather_calls: calls of each kind
            (each costs at least one latency).
    """

    allreduce: int = 0
    broadcast: int = 0
    allgather: int = 0
    allreduce_calls: int = 0
    broadcast_calls: int = 0
    allgather_calls: int = 0

    def __add__(self, other: Traffic) -> Traffic:
        pairs = zip(asdict(self).values(), asdict(other).values(), strict=True)
        return Traffic(*(a + b for a, b in pairs))


def step_traffic(
    form: str,
    n: int,
    rows: int,
    world: int,
    *,
    attempts: int = 1,
    cg_iterations: int = 0,
    itemsize: int = 8,
    gram_itemsize: int = 8,
    plan_candidates: int = 1,
) -> Traffic:
    """The collectives of one :meth:`~secondorder.LevenbergMarquardt.step` on one rank.

    Args:
        form: ``"primal"`` (cholesky or eigh on the Gram), ``"dual"`` (cholesky or
            eigh on gathered rows) or ``"cg"``.
        n: parameters.
        rows: residuals (rows of J) on this rank; every rank has as many (the
            gather pads to the largest share).
        world: ranks.
        attempts: λ values tried, each solved and evaluated at its trial point.
        cg_iterations: CG iterations of the whole step (``StepInfo.cg_iterations``).
        itemsize: bytes per number of the parameters' dtype.
        gram_itemsize: bytes per number of ``gram_dtype`` (primal form).
        plan_candidates: (solver, form) pairs the memory planner weighs; one for a
            fixed solver and form, up to three under ``solver="auto"``.

    Per step, whatever the form: the batch check, each rank's failure flag, residual
    count and ``lr`` (``3·world`` float64), the memory plan's agreement on which
    candidates fit (``world`` float64 each), the reduced loss, residual count, a
    failure flag, ``Jᵀr`` and ``diag(JᵀJ)`` (one call), and the agreement on whether
    the factorisation succeeded (2 float64).  Per attempt: the step broadcast from
    rank 0 (``n + 1`` numbers), ``‖Jδ‖²`` (broadcast, or summed over the rows of each
    rank for CG) and the loss at the trial point with its residual-count check and a
    failure flag (5 float64).  Then the form's own: the Gram (``n²``, primal); the row
    counts (``2·world`` int64) and the rows of J with their residuals
    (``rows·(n + 1)``, dual); ``n`` numbers per CG iteration.
    """
    if form not in FORMS:
        raise ValueError(f"Unknown form={form!r}; valid choices are {tuple(FORMS)}.")
    if world <= 1:
        return Traffic()
    f64 = 8
    t = Traffic(allreduce=3 * world * f64, allreduce_calls=1)  # the batch check, lr
    t += Traffic(allreduce=world * plan_candidates * f64, allreduce_calls=1)  # the memory plan
    # loss, residual count, failure flag, Jᵀr, diag(JᵀJ)
    t += Traffic(allreduce=3 * f64 + 2 * n * itemsize, allreduce_calls=1)
    if form == "primal":
        t += Traffic(allreduce=n * n * gram_itemsize)  # travels in the same call
    if form == "dual":
        t += Traffic(allreduce=2 * world * f64, allreduce_calls=1)
        t += Traffic(allgather=rows * (n + 1) * itemsize, allgather_calls=1)
    t += Traffic(allreduce=2 * f64, allreduce_calls=1)  # factorisation flags
    # The trial loss travels with the residual-count check: the loss, a mismatch flag,
    # the counts at the trial point and at the linearisation, and a failure flag (5
    # float64).
    per_attempt = Traffic(
        broadcast=(n + 1) * itemsize, broadcast_calls=1, allreduce=5 * f64, allreduce_calls=1
    )
    if form == "cg":
        per_attempt += Traffic(allreduce=itemsize, allreduce_calls=1)  # Σ_k ‖J_k δ‖²
    else:
        size = gram_itemsize if form == "primal" else itemsize
        per_attempt += Traffic(broadcast=size, broadcast_calls=1)
    for _ in range(attempts):
        t += per_attempt
    if form == "cg":
        t += Traffic(allreduce=cg_iterations * n * itemsize, allreduce_calls=cg_iterations)
    return t


def comm_seconds(traffic: Traffic, world: int, bandwidth: float, latency: float) -> float:
    """Time of ``traffic`` over ``world`` ranks with ring all-reduce and all-gather.

    All-reduce ``2(p-1)/p·B/β + 2(p-1)·α`` per call, all-gather ``(p-1)·B/β +
    (p-1)·α`` (B the bytes each rank contributes), pipelined broadcast
    ``B/β + ⌈log₂ p⌉·α``.
    """
    p = world
    if p <= 1:
        return 0.0
    ring = 2.0 * (p - 1) / p * traffic.allreduce / bandwidth
    ring += 2.0 * (p - 1) * latency * traffic.allreduce_calls
    gather = (p - 1) * traffic.allgather / bandwidth + (p - 1) * latency * traffic.allgather_calls
    bcast = traffic.broadcast / bandwidth + math.ceil(math.log2(p)) * latency * (
        traffic.broadcast_calls
    )
    return ring + gather + bcast


def step_flops(
    form: str, n: int, m: int, world: int, *, attempts: int = 1, cg_iterations: int = 0
) -> float:
    """Floating-point operations of one step on one rank, beyond the Jacobian itself.

    ``m`` is the global number of residuals, split evenly.  Primal: the local Gram
    ``2(m/p)n²`` and a Cholesky ``n³/3`` plus two triangular solves per attempt
    (every rank factors the same matrix).  Dual: ``Js Jsᵀ`` of all gathered rows
    ``2m²n``, a Cholesky ``m³/3`` per attempt and ``Jsᵀy``.  CG: ``Jᵀr`` and two
    products with the local rows per iteration, ``4(m/p)n``.
    """
    rows = m / world
    grad = 2.0 * rows * n
    if form == "primal":
        return grad + 2.0 * rows * n * n + attempts * (n**3 / 3.0 + 4.0 * n * n)
    if form == "dual":
        return grad + 2.0 * m * m * n + attempts * (m**3 / 3.0 + 4.0 * m * m + 2.0 * m * n)
    if form == "cg":
        return grad + cg_iterations * (4.0 * rows * n + 10.0 * n)
    raise ValueError(f"Unknown form={form!r}; valid choices are {tuple(FORMS)}.")


@dataclass(frozen=True)
class ModelAssumptions:
    """The cluster the paper model assumes (override them on the command line).

    Defaults: one 200 Gb/s InfiniBand link per GPU (25 GB/s, 5 µs per message), the
    inter-node bottleneck of a multi-node job; a GPU that sustains 30 TFLOP/s in
    float64 matrix products (an H100 peaks at 67); float64 throughout; 2 attempts per
    step and 50 CG iterations per step.
    """

    bandwidth: float = 25e9
    latency: float = 5e-6
    flops: float = 30e12
    attempts: int = 2
    cg_iterations: int = 50


#: The two problems of the paper model: (name, parameters n, residuals m, forms).
PAPER_PROBLEMS = (
    ("tall: n = 1e4 parameters, m = 1e6 residuals", 10_000, 1_000_000, ("primal", "cg")),
    ("wide: n = 1e6 parameters, m = 1e4 residuals", 1_000_000, 10_000, ("dual", "cg")),
)


def paper_table(
    assumptions: ModelAssumptions, worlds: Sequence[int] = (1, 8, 64)
) -> list[dict[str, Any]]:
    """Rows of the paper model: bytes and seconds per step for each problem, form, p."""
    a = assumptions
    rows = []
    for problem, n, m, forms in PAPER_PROBLEMS:
        for form in forms:
            for p in worlds:
                iters = a.cg_iterations if form == "cg" else 0
                t = step_traffic(
                    form, n, math.ceil(m / p), p, attempts=a.attempts, cg_iterations=iters
                )
                comm = comm_seconds(t, p, a.bandwidth, a.latency)
                comp = step_flops(form, n, m, p, attempts=a.attempts, cg_iterations=iters)
                comp /= a.flops
                rows.append(
                    {
                        "problem": problem,
                        "form": form,
                        "ranks": p,
                        "allreduce_bytes": t.allreduce,
                        "allgather_bytes": t.allgather * p,
                        "comm_s": comm,
                        "compute_s": comp,
                        "total_s": comm + comp,
                    }
                )
    return rows


# -- counting what the reducer sends ---------------------------------------------------------


class CountingReducer(ProcessGroupReducer):
    """A :class:`ProcessGroupReducer` that tallies the bytes it hands to collectives.

    Counts the tensors passed to :meth:`sum_`, :meth:`broadcast_` and
    :meth:`broadcast_from_` (reducers made by :meth:`split` count into the same tally) and, for
    :meth:`gather_rows`, the row-count exchange (``2·world`` int64) and this rank's
    rows (the all-gather pads every rank's share to the largest; with equal shares
    that is exactly what travels).  Nothing is counted on a single rank, where no
    collective runs.  :meth:`take` returns the tally and starts a new one.
    """

    def __init__(self, group: Any = None, **kwargs: Any) -> None:
        super().__init__(group, **kwargs)
        self._tally = Traffic()
        #: the reducer whose tally this one adds to (itself, or the parent it was split from)
        self._owner: CountingReducer = self

    def take(self) -> Traffic:
        """The traffic since the last call, and reset."""
        owner = self._owner
        out, owner._tally = owner._tally, Traffic()
        return out

    def _count(self, traffic: Traffic) -> None:
        self._owner._tally += traffic

    def broadcast_from_(self, tensors: Sequence[Tensor], src: int) -> None:
        """Counted as a broadcast (K-FAC shares decompositions and gradients this way)."""
        if self.world_size > 1:
            size = sum(t.numel() * t.element_size() for t in tensors)
            self._count(Traffic(broadcast=size, broadcast_calls=1))
        super().broadcast_from_(tensors, src)

    def split(self, groups: Sequence[Sequence[int]]) -> Any:
        """The sub-group's reducer, counting into this reducer's tally."""
        sub = super().split(groups)
        if sub is self:
            return self
        child = CountingReducer.__new__(CountingReducer)
        child.__dict__.update(sub.__dict__)
        child._tally = Traffic()
        child._owner = self._owner
        return child

    def sum_(self, tensors: Sequence[Tensor]) -> None:
        if self.world_size > 1:
            size = sum(t.numel() * t.element_size() for t in tensors)
            self._count(Traffic(allreduce=size, allreduce_calls=1))
        super().sum_(tensors)

    def broadcast_(self, tensors: Sequence[Tensor]) -> None:
        if self.world_size > 1:
            size = sum(t.numel() * t.element_size() for t in tensors)
            self._count(Traffic(broadcast=size, broadcast_calls=1))
        super().broadcast_(tensors)

    def gather_rows(self, tensor: Tensor) -> Tensor:
        if self.world_size > 1:
            self._count(Traffic(allreduce=2 * self.world_size * 8, allreduce_calls=1))
            self._count(
                Traffic(allgather=tensor.numel() * tensor.element_size(), allgather_calls=1)
            )
        return super().gather_rows(tensor)

    def check_agree(self, settings: Mapping[str, Any], what: str) -> None:
        super().check_agree(settings, what)  # construction only: not a step's traffic


# -- the measured problem ------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """The fixed problem of the measurement: an MLP regression in float64."""

    inputs: int = 8
    hidden: int = 32
    primal_samples: int = 4096
    dual_samples: int = 512
    steps: int = 5
    cg_max_iter: int = 100

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        h = self.hidden
        return nn.Sequential(
            nn.Linear(self.inputs, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1)
        ).double()

    def data(self, samples: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1)
        x = torch.rand(samples, self.inputs, generator=g, dtype=torch.float64) * 2 - 1
        y = torch.sin(3 * x[:, :1]) * torch.cos(2 * x[:, 1:2]) + 0.1 * x.sum(1, keepdim=True)
        return x, y

    def samples(self, form: str) -> int:
        return self.dual_samples if form == "dual" else self.primal_samples


QUICK = Problem(hidden=16, primal_samples=2048, dual_samples=256, steps=3, cg_max_iter=50)
FULL = Problem()


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def run_form(
    problem: Problem,
    form: str,
    rank: int,
    world: int,
    reducer: CountingReducer | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``problem`` for its steps in ``form`` on this rank's shard; time and count."""
    options: dict[str, Any] = {"jacobian": "reverse", **FORMS[form]}
    if form == "cg":
        options["cg_max_iter"] = problem.cg_max_iter
    options.update(extra or {})
    model = problem.model()
    opt = LevenbergMarquardt(
        model, reducer=reducer if reducer is not None else LocalReducer(), **options
    )
    x, y = problem.data(problem.samples(form))
    xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
    if reducer is not None:
        reducer.take()  # construction's broadcast of the parameters is not a step
    record: dict[str, Any] = {
        "form": form,
        "n": opt.num_parameters,
        "rows": int(xs.shape[0]),
        "samples": int(x.shape[0]),
        "solver": f"{opt.config.solver} on {opt.config.linalg_backend}",
        "seconds": [],
        "attempts": [],
        "cg_iterations": [],
        "traffic": [],
        "loss": [],
        "params": [],
    }
    for _ in range(problem.steps):
        t0 = time.perf_counter()
        info = opt.step(xs, ys)
        record["seconds"].append(time.perf_counter() - t0)
        record["attempts"].append(info.attempts)
        record["cg_iterations"].append(info.cg_iterations)
        record["loss"].append(info.loss)
        record["params"].append(_flat(model))
        traffic = reducer.take() if reducer is not None else Traffic()
        record["traffic"].append(asdict(traffic))
    return record


def rank_job(
    rank: int,
    world: int,
    problem: Problem,
    forms: Sequence[str],
    extra: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """What one rank of a measurement runs (under :func:`secondorder.testing.run_ranks`)."""
    reducer = CountingReducer()
    return [run_form(problem, form, rank, world, reducer, extra.get(form)) for form in forms]


def launch_ranks(
    job: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    deadline_s: float = 600.0,
) -> dict[int, Any]:
    """``job(rank, world, *args)`` on ``world`` gloo ranks (new processes); values by rank.

    Each rank runs one torch thread, as one rank per core or per GPU would.  ``job``
    must be a module-level function (spawned processes import it by name); any
    family's per-rank job fits, typically one that builds its optimizer on a
    :class:`CountingReducer` and returns each step's seconds and ``asdict(reducer.take())``
    for :func:`step_summary`.
    """
    results = run_ranks(
        job, world, args=tuple(args), timeout_s=120.0, deadline_s=deadline_s, threads=1
    )
    return {r: res.value for r, res in results.items()}


def measure_worlds(
    job: Callable[..., Any],
    worlds: Sequence[int] = (1, 2, 4),
    args: Sequence[Any] = (),
    *,
    deadline_s: float = 600.0,
) -> dict[int, dict[int, Any]]:
    """:func:`launch_ranks` for each world size; values by world size, then by rank."""
    return {world: launch_ranks(job, world, args, deadline_s=deadline_s) for world in worlds}


def step_summary(
    seconds: Sequence[float], traffic: Sequence[Mapping[str, int]]
) -> dict[str, float]:
    """Median seconds per step after the first, and mean counted bytes per step.

    The first step is left out of the timing when there are others (it includes one-off
    work such as building the Jacobian program); ``traffic`` holds one
    ``asdict(Traffic)`` per step, as :meth:`CountingReducer.take` gives them.
    """
    steps = len(seconds)
    secs = seconds[1:] or seconds
    bytes_ = [t["allreduce"] + t["broadcast"] + t["allgather"] for t in traffic]
    return {"s_per_step": statistics.median(secs), "bytes_per_step": sum(bytes_) / steps}


def launch(
    world: int,
    problem: Problem,
    forms: Sequence[str],
    *,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
    deadline_s: float = 600.0,
) -> dict[int, list[dict[str, Any]]]:
    """Run ``forms`` of ``problem`` on ``world`` gloo ranks (new processes); results by rank."""
    return launch_ranks(
        rank_job, world, (problem, tuple(forms), dict(extra or {})), deadline_s=deadline_s
    )


def measure(
    problem: Problem, worlds: Sequence[int] = (1, 2, 4), forms: Sequence[str] = tuple(FORMS)
) -> list[dict[str, Any]]:
    """Seconds per step and bytes per step for each world size and form (rank 0's).

    The first step of each run is left out of the timing (:func:`step_summary`).
    """
    rows = []
    for world, results in measure_worlds(rank_job, worlds, (problem, tuple(forms), {})).items():
        for rec in results[0]:
            steps = len(rec["seconds"])
            summary = step_summary(rec["seconds"], rec["traffic"])
            model = [
                step_traffic(rec["form"], rec["n"], rec["rows"], world, attempts=a, cg_iterations=k)
                for a, k in zip(rec["attempts"], rec["cg_iterations"], strict=True)
            ]
            rows.append(
                {
                    "form": rec["form"],
                    "ranks": world,
                    "n": rec["n"],
                    "m": rec["samples"],
                    "s_per_step": summary["s_per_step"],
                    "attempts_per_step": sum(rec["attempts"]) / steps,
                    "cg_iterations_per_step": sum(rec["cg_iterations"]) / steps,
                    "bytes_per_step": summary["bytes_per_step"],
                    "model_bytes_per_step": sum(
                        t.allreduce + t.broadcast + t.allgather for t in model
                    )
                    / steps,
                    "final_loss": rec["loss"][-1],
                }
            )
    return rows


# -- command line ------------------------------------------------------------------------


def fmt_bytes(b: float) -> str:
    """Bytes in GB, MB or kB to three significant digits (decimal units)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_seconds(s: float) -> str:
    """Seconds in s, ms or µs to three significant digits."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def add_scaling_parser(sub: Any) -> None:
    """Register ``scaling`` on the CLI's sub-parsers."""
    s = sub.add_parser(
        "scaling",
        help="seconds per step on 1, 2, 4 gloo processes, and a communication model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--quick", action="store_true", help="a smaller problem, 3 steps")
    s.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    s.add_argument("--no-measure", action="store_true", help="print the paper model only")
    s.add_argument("--bandwidth", type=float, default=ModelAssumptions.bandwidth, help="B/s")
    s.add_argument("--latency", type=float, default=ModelAssumptions.latency, help="s/message")
    s.add_argument("--flops", type=float, default=ModelAssumptions.flops, help="flop/s")
    s.add_argument("--cg-iterations", type=int, default=ModelAssumptions.cg_iterations)
    s.add_argument("--json", default=None, help="also write the tables to this file")


def report(
    problem: Problem | None,
    ranks: Sequence[int],
    assumptions: ModelAssumptions,
) -> tuple[str, dict[str, Any]]:
    """The measured table (``problem`` None: none) and the paper model, as markdown and data."""
    lines: list[str] = []
    out: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}"}
    if problem is not None:
        lines.append(
            f"Measured: MLP {problem.inputs}-{problem.hidden}-{problem.hidden}-1 in float64, "
            f"{problem.primal_samples} samples (dual: {problem.dual_samples}) split over the "
            f"ranks, {problem.steps} steps, gloo on CPU, 1 thread per rank, "
            f"{os.cpu_count()} CPUs, median s/step after the first"
        )
        rows = measure(problem, ranks)
        lines += [
            "",
            "| form | ranks | n | m | s/step | attempts | CG its | bytes/step (counted) | model |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['form']} | {r['ranks']} | {r['n']} | {r['m']} | {r['s_per_step']:.4f} "
                f"| {r['attempts_per_step']:.2g} | {r['cg_iterations_per_step']:.3g} "
                f"| {fmt_bytes(r['bytes_per_step'])} | {fmt_bytes(r['model_bytes_per_step'])} |"
            )
        out["measured"] = rows
    a = assumptions
    lines += [
        "",
        f"Model: ring all-reduce 2(p-1)/p·B/β + 2(p-1)·α, all-gather (p-1)·B/β + (p-1)·α; "
        f"β = {a.bandwidth / 1e9:g} GB/s, α = {a.latency * 1e6:g} µs, {a.flops / 1e12:g} "
        f"TFLOP/s per GPU, float64, {a.attempts} attempts/step, {a.cg_iterations} CG "
        "iterations/step; the Jacobian's own cost (which divides by p) is left out.",
        "",
        "| problem | form | GPUs | all-reduced/step | all-gathered/step | comm | compute | total |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    table = paper_table(a)
    for r in table:
        lines.append(
            f"| {r['problem']} | {r['form']} | {r['ranks']} | {fmt_bytes(r['allreduce_bytes'])} "
            f"| {fmt_bytes(r['allgather_bytes'])} | {fmt_seconds(r['comm_s'])} "
            f"| {fmt_seconds(r['compute_s'])} | {fmt_seconds(r['total_s'])} |"
        )
    out["model"] = {"assumptions": asdict(a), "rows": table}
    return "\n".join(lines), out


def run_scaling(args: argparse.Namespace) -> int:
    """Print the measured table and the paper model; return the exit status."""
    for name in ("bandwidth", "latency", "flops"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise SystemExit(f"--{name} must be a finite number > 0, got {value}")
    if args.cg_iterations < 0 or any(r < 1 for r in args.ranks):
        raise SystemExit("--cg-iterations must be >= 0 and --ranks >= 1")
    a = ModelAssumptions(
        bandwidth=args.bandwidth,
        latency=args.latency,
        flops=args.flops,
        cg_iterations=args.cg_iterations,
    )
    problem = None if args.no_measure else QUICK if args.quick else FULL
    text, out = report(problem, args.ranks, a)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.scaling`` (from the repository's root)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    add_scaling_parser(sub)
    args = parser.parse_args(["scaling", *(sys.argv[1:] if argv is None else argv)])
    return run_scaling(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
