"""Running a batch: chunks that fit in memory, steps on the device, a read every few.

The host's part of a batched fit is small: split the fits into chunks sized from the
memory available (:func:`chunk_size`), call :func:`~.engine.step` ``check_every``
times, read the ``done`` mask once, and when enough fits have finished, write their
results out and drop them from the working set (*compaction*), so a few slow fits
do not keep the finished ones computing.  Compaction moves the unfinished fits within
the working tensors.  Every operation of a step is per fit, so no fit ever reads
another's values; a fit that moves is computed by the same operations, though a few
CPU kernels (``pow``, for one) round a value's last bit differently at another
position in a tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .covariance import batch_covariance, finish_covariance
from .engine import BatchState, start, step
from .problem import BatchProblem
from .rule import BatchTrustRegion

__all__ = ["Outputs", "RunOptions", "chunk_size", "max_steps", "run"]

#: The CPU memory a chunk may use when no ``memory_budget`` is given (bytes).
CPU_BUDGET = 1 << 30
#: The share of a GPU's free memory a chunk may use.
GPU_SHARE = 0.5


@dataclass(frozen=True)
class RunOptions:
    """How the driver runs (validated by the public functions)."""

    budget: int
    damping: float
    check_every: int
    chunk: int
    progress: Callable[[int, int], Any] | None
    xtol_in_x: float
    covariance: bool
    absolute_sigma: bool
    compiled: bool = False


@dataclass
class Outputs:
    """Per-fit results of a whole batch (the public functions name them)."""

    y: Tensor
    x: Tensor
    f: Tensor
    cost2: Tensor
    status: Tensor
    nfev: Tensor
    njev: Tensor
    nit: Tensor
    pcov: Tensor | None


def chunk_size(
    batch: int, m: int, n: int, dtype: torch.dtype, device: torch.device, budget: int | None
) -> int:
    """How many fits one chunk holds: memory per fit against the memory allowed.

    A fit's step holds its residuals and Jacobian several times over (forward-mode
    tangents of each intermediate of the model, the trial point, the normal
    matrices): about ``24·m·(n+1) + 40·n²`` numbers, a generous estimate.  The memory
    allowed is ``budget`` bytes, else half the device's free memory on a GPU, else
    :data:`CPU_BUDGET`.
    """
    item = torch.finfo(dtype).bits // 8
    per_fit = item * (24 * m * (n + 1) + 40 * n * n)
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_SHARE)
        else:
            budget = CPU_BUDGET
    return max(1, min(batch, budget // per_fit))


def _tqdm_progress(total: int) -> Callable[[int, int], Any]:
    """A progress bar from tqdm when it is installed, else a line on stderr per update."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="fit")

        def update(done: int, _: int) -> None:
            bar.update(done - bar.n)
            if done >= total:
                bar.close()

        return update

    def line(done: int, total: int) -> None:
        print(f"\rfits done: {done}/{total}", end="\n" if done >= total else "", file=sys.stderr)

    return line


def make_progress(progress: Any, total: int) -> Callable[[int, int], Any] | None:
    """``progress`` as a callback ``(done, total)``: ``True`` a bar, a callable itself."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return _tqdm_progress(total)
    return progress


def run(problem: BatchProblem, y0: Tensor, rule: BatchTrustRegion, opts: RunOptions) -> Outputs:
    """Fit every fit of ``problem`` from ``y0``, chunk by chunk."""
    total, n = y0.shape
    out = Outputs(
        y=torch.empty_like(y0),
        x=torch.empty_like(y0),
        f=y0.new_empty(total, problem.m),
        cost2=y0.new_empty(total),
        status=torch.empty(total, dtype=torch.int64, device=y0.device),
        nfev=torch.empty(total, dtype=torch.int64, device=y0.device),
        njev=torch.empty(total, dtype=torch.int64, device=y0.device),
        nit=torch.empty(total, dtype=torch.int64, device=y0.device),
        pcov=y0.new_empty(total, n, n) if opts.covariance else None,
    )
    if opts.compiled and total:
        from .compiled import run_slots

        def write(state: BatchState, work: BatchProblem, slots: Tensor, at: Tensor) -> None:
            _write(state, work, at, out, slots)

        run_slots(
            problem,
            y0,
            rule,
            width=opts.chunk,
            budget=opts.budget,
            damping=opts.damping,
            check_every=opts.check_every,
            xtol_in_x=opts.xtol_in_x,
            max_steps=max_steps(opts.budget),
            write=write,
            progress=opts.progress,
        )
        if opts.covariance:
            _slots_covariance(problem, opts, out)
        return out
    finished = 0
    for lo in range(0, total, opts.chunk):
        hi = min(total, lo + opts.chunk)
        whole = lo == 0 and hi == total
        index = torch.arange(lo, hi, device=y0.device)
        sub = problem if whole else problem.take(index)
        finished = _run_chunk(sub, y0[lo:hi], index, rule, opts, out, finished, total)
        if opts.covariance:
            _chunk_covariance(sub, index, opts, out)
    return out


def max_steps(budget: int) -> int:
    """Attempts after which a fit is written out as it stands.

    Every attempt costs an evaluation or raises λ tenfold (at most ~60 times before the
    cap ends the iteration), so a fit that follows the rule never reaches this bound;
    it only guarantees the loop ends.
    """
    return 2 * budget + 100


def _run_chunk(
    problem: BatchProblem,
    y0: Tensor,
    positions: Tensor,
    rule: BatchTrustRegion,
    opts: RunOptions,
    out: Outputs,
    finished_before: int,
    total: int,
) -> int:
    """Step one chunk until every fit is done; write results as fits finish."""
    state = start(problem, y0, opts.damping)
    limit = max_steps(opts.budget)
    steps = 0
    finished = finished_before
    while True:
        for _ in range(opts.check_every):
            step(state, problem, rule, budget=opts.budget, xtol_in_x=opts.xtol_in_x)
        steps += opts.check_every
        done = np.asarray(state.done.tolist(), dtype=bool)  # the one host read
        if steps >= limit:
            done[:] = True
        count = int(done.sum())
        if count == done.size:
            _write(state, problem, positions, out)
            finished += count
            if opts.progress is not None:
                opts.progress(finished, total)
            return finished
        if count and count >= max(1, done.size // 8):
            # Compaction: write the finished fits out and keep the others.
            gone = torch.from_numpy(np.flatnonzero(done)).to(positions.device)
            keep = torch.from_numpy(np.flatnonzero(~done)).to(positions.device)
            _write(state.take(gone), problem.take(gone), positions[gone], out)
            state, problem, positions = state.take(keep), problem.take(keep), positions[keep]
            finished += count
            if opts.progress is not None:
                opts.progress(finished, total)


def _write(
    state: BatchState,
    problem: BatchProblem,
    positions: Tensor,
    out: Outputs,
    index: Tensor | None = None,
) -> None:
    """Store the results of the fits in ``state`` (those at ``index``) at ``positions``."""

    def pick(t: Tensor) -> Tensor:
        return t if index is None else t[index]

    y = pick(state.y)
    out.y[positions] = y
    if problem.bounded or problem.scale is not None:
        sub = problem if index is None else problem.take(index)
        out.x[positions] = sub.transform.to_x(y)
    else:
        out.x[positions] = y
    out.f[positions] = pick(state.f)
    out.cost2[positions] = pick(state.cost2)
    out.status[positions] = pick(state.status).to(out.status.dtype)
    out.nfev[positions] = pick(state.nfev).to(out.nfev.dtype)
    out.njev[positions] = pick(state.njev).to(out.njev.dtype)
    out.nit[positions] = pick(state.nit).to(out.nit.dtype)


def _chunk_covariance(
    problem: BatchProblem, positions: Tensor, opts: RunOptions, out: Outputs
) -> None:
    """The covariance of each fit of a chunk, from the Jacobian at its solution."""
    assert out.pcov is not None
    y, f = out.y[positions], out.f[positions]
    J = problem.report_jacobian(y, f)
    scale2 = None if opts.absolute_sigma else out.cost2[positions]
    cov = batch_covariance(J, scale2, eps=torch.finfo(y.dtype).eps)
    out.pcov[positions] = cov.to(out.pcov.dtype)


def _slots_covariance(problem: BatchProblem, opts: RunOptions, out: Outputs) -> None:
    """:func:`_chunk_covariance` for a compiled run: its fast path compiled, in chunks.

    Every chunk has the slots' width, the last one padded with copies of its last fit,
    so the compiled part sees one shape.
    """
    from .compiled import compiled_report

    assert out.pcov is not None
    total = out.y.shape[0]
    width = max(1, min(opts.chunk, total))
    report = compiled_report()
    eps = torch.finfo(out.y.dtype).eps
    for lo in range(0, total, width):
        count = min(width, total - lo)
        index = torch.arange(lo, lo + width, device=out.y.device).clamp(max=total - 1)
        J, fast_part = report(problem.take(index), out.y[index], out.f[index])
        part = tuple(t[:count] for t in fast_part)
        scale2 = None if opts.absolute_sigma else out.cost2[lo : lo + count]
        cov = finish_covariance(J[:count], part, scale2, eps=eps)
        out.pcov[lo : lo + count] = cov.to(out.pcov.dtype)
