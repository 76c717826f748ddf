"""Running the attempts through ``torch.compile``: a fixed set of slots, refilled.

The eager driver (:mod:`.driver`) shrinks its working set as fits finish.  A compiled
step is specialised to its batch size (forward mode's broadcasting rules read the
sizes), so here the working set keeps one size: ``width`` slots, each holding one fit.
Every ``check_every`` attempts the host reads the ``done`` mask (the one read), writes
the finished fits out and puts the next fits of the queue in their slots: their data,
their starts and the ``new`` mark, nothing else; the next compiled step evaluates and
linearises them there, with the model call and Jacobian it makes for every slot
anyway, and gives them the rest of :func:`~.engine.waiting`'s state.  The state is
kept column by column (:func:`~.small_linalg.parameter_major`).  A slot
with no fit left to take stays done, and its values are never written again.  Every
operation of the step is per fit, so a fit's numbers do not depend on the slot it
runs in or on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from .covariance import fast_inverse
from .engine import BatchState, waiting
from .problem import BatchProblem
from .rule import BatchTrustRegion

__all__ = ["CPU_SLOTS", "compiled_report", "compiled_step", "run_slots", "solution_report"]

#: Slots of a compiled run on a CPU when ``chunk_size`` is not given: the working set
#: of an attempt then stays in the caches, and few slots idle while the last fits run.
CPU_SLOTS = 4096

_COMPILED_STEP: Callable[..., None] | None = None
_COMPILED_REPORT: Callable[..., tuple[Tensor, tuple[Tensor, ...]]] | None = None


def compiled_step() -> Callable[..., None]:
    """:func:`~.engine.step` through ``torch.compile``, made once per process.

    The step has no host read and no data-dependent branch, so each batch size, model
    and dtype compiles to one graph, its few thousand elementwise operations fused
    into a few loops over the fits.  torch keeps the compiled code in its on-disk
    cache, so a later process with the same model skips most of the compile time.
    """
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        from . import engine

        _COMPILED_STEP = torch.compile(engine.step, dynamic=False)
    return _COMPILED_STEP


Report = tuple[Tensor, tuple[Tensor, ...]]


def solution_report(problem: BatchProblem, y: Tensor, f: Tensor) -> Report:
    """The Jacobian at the solutions ``(B, m, n)`` and :func:`~.covariance.fast_inverse` of it."""
    J = problem.report_jacobian(y, f)
    return J, fast_inverse(J, eps=torch.finfo(y.dtype).eps)


def compiled_report() -> Callable[..., Report]:
    """The covariance's fast path through ``torch.compile``, made once per process.

    The Jacobian at each solution, its float64 Gram, the unrolled inverse and the
    rank bound, fused as the step is; the fits it does not settle (and the scaling by
    ``s²``) are finished eagerly (:func:`~.covariance.finish_covariance`).
    """
    global _COMPILED_REPORT
    if _COMPILED_REPORT is None:
        _COMPILED_REPORT = torch.compile(solution_report, dynamic=False)
    return _COMPILED_REPORT


def run_slots(
    problem: BatchProblem,
    y0: Tensor,
    rule: BatchTrustRegion,
    *,
    width: int,
    budget: int,
    damping: float,
    check_every: int,
    xtol_in_x: float,
    max_steps: int,
    write: Callable[[BatchState, BatchProblem, Tensor, Tensor], None],
    progress: Callable[[int, int], object] | None,
) -> None:
    """Fit every fit of ``problem`` from ``y0`` in ``width`` slots; ``write`` stores results.

    ``write(state, work, slots, positions)`` stores the results of the fits in
    ``slots`` of the slots' ``state`` and per-fit data ``work`` at ``positions`` of the
    whole batch.
    """
    total = y0.shape[0]
    device = y0.device
    width = max(1, min(width, total))
    first = torch.arange(width, device=device)
    # The slots' own copy of the per-fit data (contiguous, written as fits move in).
    work = problem.take(first)
    state = waiting(y0[:width], problem.m, damping)
    work, state = _parameter_major(work), _parameter_major_state(state)
    held = np.arange(width)  # the fit each slot holds; -1: none
    steps = np.zeros(width, dtype=np.int64)  # attempts since the slot's fit started
    queue = width
    finished = 0
    advance = compiled_step()
    while True:
        for _ in range(check_every):
            advance(state, work, rule, budget=budget, xtol_in_x=xtol_in_x, restart=damping)
        steps += check_every
        done = state.done.cpu().numpy().copy()  # the one host read
        done |= steps >= max_steps
        leaving = np.flatnonzero(done & (held >= 0))
        if leaving.size:
            slots = torch.from_numpy(leaving).to(device)
            positions = torch.from_numpy(held[leaving]).to(device)
            write(state, work, slots, positions)
            finished += leaving.size
            held[leaving] = -1
            if progress is not None:
                progress(finished, total)
            count = min(leaving.size, total - queue)
            if count:
                new = torch.arange(queue, queue + count, device=device)
                target = slots[:count]
                work.put(target, problem.take(new))
                # The next step evaluates them at y and gives them the rest of their
                # starting state (the step's ``restart``).
                state.y[target] = y0[new]
                state.new[target] = True
                held[leaving[:count]] = np.arange(queue, queue + count)
                steps[leaving[:count]] = 0
                queue += count
        if finished == total:
            return


def _columns(t: Tensor) -> Tensor:
    """``t`` with the layout :func:`~.small_linalg.parameter_major` gives (2-D ``(B, k)``)."""
    return t.mT.contiguous().mT if t.ndim == 2 else t


def _parameter_major(work: BatchProblem) -> BatchProblem:
    """The slots' per-fit data stored as a compiled step writes its state (in place later)."""
    return replace(
        work,
        rows=tuple(_columns(r) for r in work.rows),
        counts=None if work.counts is None else _columns(work.counts),
        lb=_columns(work.lb),
        ub=_columns(work.ub),
        scale=None if work.scale is None else _columns(work.scale),
    )


def _parameter_major_state(state: BatchState) -> BatchState:
    """The slots' state in the layout the compiled step returns, so it compiles once."""
    for name in ("y", "f", "g", "col", "dcol", "sqrt_d", "last_try"):
        setattr(state, name, _columns(getattr(state, name)))
    state.rule.scale = _columns(state.rule.scale)
    return state
