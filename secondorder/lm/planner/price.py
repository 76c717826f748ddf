"""The plan of one configuration: its stages priced, its slice size chosen."""

from __future__ import annotations

from ..stages import StepShape, estimate
from .plan import MemoryPlan
from .rules import SliceChoice

__all__ = ["fit"]


def fit(
    shape: StepShape,
    solver: str,
    dual: bool,
    slices: SliceChoice,
    available: int | None,
    source: str,
    peaks: list[int] | None = None,
) -> MemoryPlan:
    """The plan of one configuration, its slice size chosen by ``slices``.

    Appends to ``peaks`` every peak compared with ``available`` (see :func:`plan_memory`).
    """
    per_sample = not shape.jacobian.startswith("batch")
    chunk = slices.size if not per_sample else None

    def build(s: int, pooled: bool = False) -> MemoryPlan:
        stages, lin, sol = estimate(shape, solver, dual, s, chunk, pooled)
        peak = max(lin, sol)
        ok = available is None or peak <= available
        if peaks is not None and available is not None:
            peaks.append(peak)
        return MemoryPlan(
            parameters=shape.n,
            samples=shape.samples,
            rows=shape.rows,
            rows_total=shape.rows_total,
            jacobian=shape.jacobian,
            solver=solver,
            form="dual" if dual else "primal",
            slice_size=s if per_sample else shape.samples,
            stages=stages,
            linearize_bytes=lin,
            solve_bytes=sol,
            peak_bytes=peak,
            available_bytes=available,
            available_source=source,
            fits=ok,
            pooled_rows=pooled,
        )

    # Keep J's buffer for the next step only where it fits beside the chosen plan.
    s = slices.choose(shape.samples, build) if per_sample else shape.samples
    plan = build(s)
    if plan.fits:
        with_pool = build(s, pooled=True)
        if with_pool.fits:
            return with_pool
    return plan
