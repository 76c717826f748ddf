"""The byte model of one LM step, stage by stage (see :mod:`secondorder.lm.planner`).

:func:`estimate` turns a fully resolved configuration (solver, form, slice size) of a
:class:`StepShape` into the bytes of each :class:`Stage` and the peaks of the two
phases, *linearise* and *solve*.  It is integer arithmetic on shapes: nothing is
allocated.  The planner searches over configurations with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Stage", "StepShape", "estimate"]


@dataclass(frozen=True)
class Stage:
    """The bytes one stage of a step allocates, and how they were counted."""

    name: str
    bytes: int
    detail: str


@dataclass(frozen=True)
class StepShape:
    """The shapes and dtypes a step's memory follows from."""

    n: int
    samples: int
    rows: int
    rows_total: int
    b: int  # bytes per entry of J (the parameters' dtype)
    g: int  # bytes per entry of the Gram / factorisations
    converts: bool  # J is copied into the Gram's dtype
    jacobian: str
    activations: int  # entries a sample saves for backward


@dataclass(frozen=True)
class _Slice:
    """One Jacobian slice: its samples, rows and bytes (``work + extra`` at its peak)."""

    s: int  # samples
    rows: int
    several: bool  # the batch takes more than one slice
    j1: int  # bytes of the slice's J
    copy: int  # bytes of its copy in the Gram's dtype
    work: int  # J, its flattened copy (and the previous slice)
    extra: int  # the strategy's own tangents or cotangents


def _jacobian_slice(
    shape: StepShape, gram: bool, slice_size: int, chunk: int | None
) -> tuple[_Slice, Stage]:
    n, b, g, a = shape.n, shape.b, shape.g, shape.activations
    k = max(1, math.ceil(shape.rows / max(1, shape.samples)))
    per_sample = not shape.jacobian.startswith("batch")
    s = min(slice_size, shape.samples) if per_sample else shape.samples
    slice_rows = min(s * k, shape.rows) if per_sample else shape.rows
    several = per_sample and s < shape.samples
    j1 = slice_rows * n * b
    copy = slice_rows * n * g if gram and shape.converts else 0
    work = max(2 * j1, j1 + copy)  # the strategy's blocks and their flattened copy
    detail = f"{slice_rows:,} rows × {n:,} × {b} B, ×2 while flattened"
    if shape.jacobian == "reverse":
        extra = s * (1 + k) * a * b
        if a:
            detail += ", + activations and their cotangents"
    elif shape.jacobian == "forward":
        # vmap over samples of forward mode: the n×n basis of tangents and its
        # per-parameter copies (6·n², measured), every parameter's tangent expanded to
        # each sample of the slice (s·n·n), and the activations' tangents (s·n·a).
        extra = 6 * n * n * b + s * n * (n + a) * b
        detail += ", + n×n tangent basis and s·n·(n + activations) tangents"
    elif shape.jacobian == "batch_reverse":
        c = min(chunk or shape.rows, shape.rows)
        extra = c * shape.rows * b + c * shape.samples * a * b
        detail += f", + {c:,} cotangents through the whole batch's activations"
    else:  # batch_forward
        extra = n * n * b + n * shape.samples * a * b
        detail += ", + n tangents through the whole batch's activations"
    part = _Slice(s=s, rows=slice_rows, several=several, j1=j1, copy=copy, work=work, extra=extra)
    return part, Stage("jacobian slice", work + extra, detail)


def _factorisation(shape: StepShape, solver: str, dual: bool, mm: int) -> Stage:
    """The factorisation's bytes: ``mm`` rows of J, ``dual`` (Cholesky or eigh) or not."""
    n, g = shape.n, shape.g
    if solver == "cg":
        return Stage("factorisation", 0, "matrix-free")
    if dual:  # Cholesky or eigh of the m×m matrix
        return Stage("factorisation", 3 * mm * mm * g, f"3 × {mm:,}² × {g} B per λ")
    if solver == "cholesky":
        detail = f"3 × {n:,}² × {g} B: damped copy, LAPACK's copy, factor"
        return Stage("factorisation", 3 * n * n * g, detail)
    if solver == "eigh":
        detail = f"4 × {n:,}² × {g} B: scaled matrix, eigenvectors, workspace"
        return Stage("factorisation", 4 * n * n * g, detail)
    # qr
    p = min(mm, n)
    conv = mm * n * g if shape.converts else 0
    per_lam = 3 * (p + n) * n * g + n * n * g
    if mm > n:
        # J = Q0 R0 (LAPACK copies J first), then a QR of [R0; √λD^½] per λ.
        resident = mm * n * g + n * n * g
        factor = conv + max(resident + mm * n * g, resident + per_lam)
    else:
        factor = conv + per_lam
    return Stage("factorisation", factor, f"Q0, R0 and the ({p:,} + {n:,}) × {n:,} stack per λ")


def estimate(
    shape: StepShape,
    solver: str,
    dual: bool,
    slice_size: int,
    chunk: int | None,
    pooled: bool = False,
) -> tuple[tuple[Stage, ...], int, int]:
    """Stages and the two phase peaks (linearise, solve) of one resolved configuration.

    ``pooled``: J's rows are kept in a pooled buffer from one step to the next.
    """
    n, b, g = shape.n, shape.b, shape.g
    store = dual or solver in ("qr", "cg")
    gram = not store
    part, jac_stage = _jacobian_slice(shape, gram, slice_size, chunk)
    stages = [jac_stage]

    # -- Gram, stored rows ----------------------------------------------------------
    gram_bytes = n * n * g if gram else 0
    stages.append(Stage("gram", gram_bytes, f"{n:,}² × {g} B" if gram else "not formed"))
    # Other processes hold the rest of the batch's rows (each holds at least one):
    # every solver but CG gathers them all.
    gathered = store and solver != "cg" and shape.rows_total > shape.rows
    rows_here = shape.rows_total if gathered else shape.rows
    local_rows = shape.rows * n * b if store else 0
    rows_bytes = rows_here * (n + (1 if gathered else 0)) * b if store else 0
    why = "gathered from every rank" if gathered else "this rank's rows"
    rows_detail = f"{rows_here:,} × {n:,} × {b} B ({why}), ×2 while concatenated"
    stages.append(Stage("stored rows", rows_bytes, rows_detail if store else "not kept"))

    # -- dual matrix, factorisation, CG ---------------------------------------------
    mm = rows_here
    # QR factors J itself in either form; only Cholesky and eigh build J D⁻¹Jᵀ.
    dual = dual and solver in ("cholesky", "eigh")
    dual_bytes = mm * n * g + mm * mm * g if dual else 0
    dual_detail = f"J D^-½ ({mm:,} × {n:,}) and {mm:,}² × {g} B" if dual else "primal form"
    stages.append(Stage("dual matrix", dual_bytes, dual_detail))
    factor = _factorisation(shape, solver, dual, mm)
    stages.append(factor)
    cg_bytes = (9 * n + mm) * b if solver == "cg" else 0
    stages.append(Stage("cg vectors", cg_bytes, "9 n-vectors and an m-vector" if cg_bytes else "-"))

    # -- vectors, trial ---------------------------------------------------------------
    vectors = 8 * n * b + 2 * n * g
    stages.append(Stage("vectors", vectors, "x, Jᵀr, diag(JᵀJ), D, δ, trial x"))
    trial = part.rows * b + part.s * shape.activations * b
    stages.append(Stage("trial", trial, "residuals and activations of one slice"))
    # The outer-product rule ("reverse") writes a slice's rows into a pooled buffer that
    # outlives the linearisation; stored rows of one slice are that buffer itself.
    kept = part.j1 if pooled and shape.jacobian == "reverse" and (gram or part.several) else 0
    detail = "the last slice's J, kept for the next step" if kept else "none kept"
    stages.append(Stage("pooled rows", kept, detail))

    # After linearising, the step checks J (or the Gram) for non-finite entries:
    # |x| and three boolean masks, measured at itemsize + 3 bytes per entry.
    checked = max(gram_bytes // g * (g + 3), rows_here * n * (b + 3) if store else 0)
    stages.append(Stage("finite check", checked, "|x| and three masks over the Gram or J"))

    slice_peak = part.work + part.extra
    if store:
        # Rows already stored when the last slice is computed, then the concatenation.
        before_last = max(0, local_rows - part.j1)
        concat = 2 * local_rows + (rows_bytes + local_rows if gathered else 0)
        linearize = max(before_last + slice_peak, concat)
    else:
        # The Gram is allocated after the first slice.
        linearize = max(2 * part.j1 + part.extra, gram_bytes + part.j1 + part.copy)
        if part.several:
            linearize = max(linearize, gram_bytes + slice_peak)
    linearize = vectors + max(linearize, gram_bytes + rows_bytes + checked)
    solve = vectors + gram_bytes + rows_bytes + dual_bytes + factor.bytes + cg_bytes + trial
    solve += kept
    return tuple(stages), linearize, solve
