"""What would fit when a step does not: the advice a :class:`~.plan.PlanError` carries."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..stages import StepShape
from .plan import MemoryPlan, size_text
from .price import fit
from .rules import AutoSlice, slice_choice

__all__ = ["refusal"]


def refusal(
    chosen: MemoryPlan,
    shape: StepShape,
    slice_size: int | None,
    memory_budget: int,
    available: int | None,
    gram_dtype: torch.dtype | None,
    dtype: torch.dtype,
    advise_cg: bool = True,
) -> MemoryPlan:
    """The first candidate, marked as not fitting, with advice on what would fit.

    ``advise_cg``: whether the advice may name CG (not where the caller refuses it).
    """
    if chosen.fits:
        # It fits here, but not on another process, where the error is explained.
        return replace(
            chosen, fits=False, available_source=chosen.available_source + "; not on every rank"
        )
    return replace(
        chosen,
        advice=_advice(
            shape, chosen, slice_size, memory_budget, available, gram_dtype, dtype, advise_cg
        ),
    )


def _advice(
    shape: StepShape,
    plan: MemoryPlan,
    slice_size: int | None,
    budget: int,
    available: int | None,
    gram_dtype: torch.dtype | None,
    dtype: torch.dtype,
    advise_cg: bool,
) -> tuple[str, ...]:
    """Options, each changing one thing, under which the step would fit."""
    if available is None:
        return ()
    out: list[str] = []
    dual = plan.form == "dual"
    per_sample = not shape.jacobian.startswith("batch")
    slices = slice_choice(slice_size if per_sample else None, budget)
    if per_sample and slice_size is not None:
        smaller = fit(shape, plan.solver, dual, AutoSlice(None), available, "")
        if smaller.fits:
            out.append(f"slice_size={smaller.slice_size} (needs {size_text(smaller.peak_bytes)})")
    others: list[tuple[str, str, bool]] = []
    if plan.solver != "cg" and advise_cg:
        others.append(("solver='cg'", "cg", False))
    if plan.solver in ("cholesky", "eigh"):
        others.append((f"form={'primal' if dual else 'dual'!r}", plan.solver, not dual))
    if plan.solver in ("eigh", "qr"):
        others.append(("solver='cholesky'", "cholesky", dual))
    cg_fits = False
    for label, name, in_dual in others:
        option = fit(shape, name, in_dual, slices, available, "")
        if option.fits:
            out.append(f"{label} (needs {size_text(option.peak_bytes)})")
            cg_fits = cg_fits or name == "cg"
    if shape.g > 4 and plan.solver != "cg" and gram_dtype != torch.float32:
        small = replace(shape, g=4, converts=dtype != torch.float32)
        f32 = fit(small, plan.solver, dual, slices, available, "")
        if f32.fits:
            out.append(f"gram_dtype=torch.float32 (needs {size_text(f32.peak_bytes)})")
    # More ranks split the batch; with CG, each keeps only its own rows of J.
    for ranks in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if cg_fits or not advise_cg:
            break
        rows = max(1, math.ceil(shape.rows / ranks))
        samples = max(1, math.ceil(shape.samples / ranks))
        spread = replace(shape, rows=rows, rows_total=shape.rows_total, samples=samples)
        option = fit(spread, "cg", False, slices, available, "")
        if option.fits:
            more = (
                f"{ranks} ranks or devices"
                if shape.rows == shape.rows_total
                else (f"{ranks} times as many ranks or devices")
            )
            out.append(f"solver='cg' over {more} (needs {size_text(option.peak_bytes)} on each)")
            break
    if not per_sample:
        out.append(
            "a per-sample jacobian ('reverse'), which slices the batch: possible when "
            "samples do not interact (call model.eval() for BatchNorm)"
        )
    return tuple(out)
