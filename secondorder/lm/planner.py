r"""Memory planning: how many bytes one LM step needs, decided before any is allocated.

An LM step goes through stages whose sizes follow from shapes alone.  With ``n``
parameters, ``m`` residual rows, ``s`` samples per Jacobian slice, ``k`` rows per
sample, ``b`` bytes per parameter entry and ``g`` bytes per entry of the Gram's dtype:

========================  ==========================================================
stage                     bytes (what is alive at its peak)
========================  ==========================================================
Jacobian slice            ``2·s·k·n·b`` (the strategy's per-parameter blocks and the
                          flattened copy) plus, with several slices, the previous
                          slice and its copy in the Gram's dtype; forward mode adds
                          its tangents, whole-batch modes their cotangents
Gram ``JᵀJ``              ``n²·g`` (primal form, Cholesky or eigh)
stored rows of J          ``m·n·b``, twice while the slices are concatenated (dual
                          form, QR, CG)
dual matrix               ``J D^-½`` (``m·n·g``) and ``J D⁻¹Jᵀ`` (``m²·g``)
factorisation             Cholesky ``3n²·g`` (damped copy, factor, LAPACK's copy),
                          eigh ``4n²·g`` (scaled matrix, eigenvectors, workspace),
                          dual ``3m²·g``, QR the factors of J and of the per-λ stack
CG vectors                nine n-vectors and an m-vector
trial evaluation          the residuals and activations of one slice
finite check              ``(itemsize + 3)`` bytes per entry of the Gram or of J
                          (``|x|`` and three boolean masks)
========================  ==========================================================

The constants (3 and 4 for the factorisations, 3 bytes for the check) were measured
on CPU (LAPACK through torch); with them the peak resident memory of whole steps
agrees with the estimate to within a few percent (``tests/test_planner.py`` checks
25%).  The whole-step peak is the larger of two phases: *linearise* (vectors, the
Gram, the stored rows, one slice being computed or the rows being concatenated,
then the finiteness check) and *solve* (vectors, the Gram or the rows, the dual
matrix, the factorisation, CG vectors and one trial evaluation).

What is not modelled: memory the framework keeps for itself (the CUDA context, the
caching allocator's fragmentation), the model's own buffers, and the model's
activations, which only :func:`plan_memory`'s ``activations`` argument describes (one
number, the entries a sample saves for backward, from :func:`activation_numel`);
among them the trial's forward pass that :class:`~secondorder.lm.carry.ForwardCarry`
keeps for the next step, with a copy of the inputs (one slice, and only while the plan
pools J's rows).
:class:`~secondorder.lm.LevenbergMarquardt` passes 0: it evaluates the model only
on the schedule of a step.  For per-sample reverse mode, the default, activations
are small next to J (a sample's k rows of J hold k·n numbers; its activations, the
widths of its layers).  Forward mode and the whole-batch modes push n tangents or
m cotangents through the activations, so for them the estimate is a lower bound.
That is also why a measured free memory is used only up to :data:`USABLE_FRACTION`.

Why plan at all: a Gram of ``n = 10⁵`` parameters is 80 GB in float64, and a
per-sample forward-mode Jacobian materialises ``n²`` numbers per sample.  Finding
that out from an out-of-memory error in the middle of a step wastes the work done so
far; the planner finds it from the shapes, picks the largest slice that fits, lets
``solver="auto"`` fall back to matrix-free CG, and otherwise raises
:class:`PlanError` naming the options that would fit.

:func:`plan_memory` is a pure function of shapes, dtypes and options, so a plan can
be computed for a machine you do not have (pass ``available``) and tested without
allocating anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .._validation import check_integer
from .memory import activation_numel, available_memory
from .stages import Stage, StepShape, estimate

__all__ = [
    "DIRECT_SOLVE_LIMIT",
    "USABLE_FRACTION",
    "MemoryPlan",
    "PlanError",
    "Stage",
    "activation_numel",
    "available_memory",
    "available_range",
    "plan_memory",
]

#: Under ``solver="auto"``, the largest normal matrix (n in the primal form, m in the
#: dual) that is factored directly; beyond it the O(size³) factorisation costs more
#: than CG's iterations, whatever the memory.
DIRECT_SOLVE_LIMIT = 8192
#: Share of a *measured* free memory a plan may use; the rest covers what the model
#: does not count (allocator fragmentation, the model's buffers, other processes).
USABLE_FRACTION = 0.9

_SOLVERS = ("auto", "cholesky", "eigh", "qr", "cg")
_FORMS = ("auto", "primal", "dual")
_JACOBIANS = ("reverse", "forward", "batch_reverse", "batch_forward")


class PlanError(MemoryError):
    """A step that cannot fit the memory available, raised before anything is allocated.

    Attributes:
        plan: the :class:`MemoryPlan` that did not fit; ``plan.advice`` lists the
            options that would.
    """

    def __init__(self, plan: MemoryPlan, message: str | None = None) -> None:
        super().__init__(message or plan.explain())
        self.plan = plan


@dataclass(frozen=True)
class MemoryPlan:
    """What one LM step will allocate, stage by stage, and whether it fits.

    Attributes:
        parameters: n, the columns of J.
        samples: samples of the batch on this process.
        rows: residual rows of the batch on this process.
        rows_total: residual rows over every process.
        jacobian: the Jacobian strategy the estimate assumes.
        solver: the solver chosen (``"auto"`` resolved).
        form: ``"primal"`` or ``"dual"`` (``"auto"`` resolved).
        slice_size: samples per Jacobian slice (the batch, for whole-batch modes).
        stages: bytes of every stage.
        linearize_bytes: peak of the linearisation phase.
        solve_bytes: peak of the factorisation, solves and trial evaluations.
        peak_bytes: the larger of the two phases: the estimate of the step's peak.
        available_bytes: what the step may use (``None``: unknown, not checked).
        available_source: where ``available_bytes`` came from.
        fits: ``peak_bytes <= available_bytes`` and the slice respects the budget.
        advice: options that would fit, when this plan does not.
        pooled_rows: whether J's rows stay in a buffer reused by the next step.  The
            pool never costs a smaller slice or another solver: it is planned only
            where its buffer fits beside the chosen configuration.
    """

    parameters: int
    samples: int
    rows: int
    rows_total: int
    jacobian: str
    solver: str
    form: str
    slice_size: int
    stages: tuple[Stage, ...]
    linearize_bytes: int
    solve_bytes: int
    peak_bytes: int
    available_bytes: int | None
    available_source: str
    fits: bool
    advice: tuple[str, ...] = ()
    pooled_rows: bool = False

    def stage(self, name: str) -> int:
        """Bytes of the stage called ``name`` (0 when the step has no such stage)."""
        for s in self.stages:
            if s.name == name:
                return s.bytes
        return 0

    def explain(self) -> str:
        """A one-paragraph account of why the plan does not fit and what would."""
        biggest = sorted(self.stages, key=lambda s: -s.bytes)[:3]
        parts = ", ".join(f"{s.name} {_size(s.bytes)}" for s in biggest if s.bytes)
        avail = (
            "an unknown amount"
            if self.available_bytes is None
            else f"{self.available_bytes:,} bytes ({_size(self.available_bytes)})"
        )
        text = (
            f"solver={self.solver!r}, form={self.form!r}, slice_size={self.slice_size} needs "
            f"about {self.peak_bytes:,} bytes ({_size(self.peak_bytes)}: {parts}) for n="
            f"{self.parameters:,} parameters and m={self.rows_total:,} residuals, but "
            f"{avail} are available ({self.available_source})."
        )
        if self.advice:
            text += " Options that would fit: " + "; ".join(self.advice) + "."
        else:
            text += " No option of this optimizer fits: use a smaller batch or model."
        return text

    def __str__(self) -> str:
        width = max(len(s.name) for s in self.stages)
        lines = [
            f"MemoryPlan: solver={self.solver}, form={self.form}, jacobian={self.jacobian}, "
            f"slice_size={self.slice_size}, n={self.parameters:,}, m={self.rows_total:,}",
        ]
        for s in self.stages:
            lines.append(f"  {s.name:<{width}}  {_size(s.bytes):>10}  {s.detail}")
        lines.append(f"  {'linearize peak':<{width}}  {_size(self.linearize_bytes):>10}")
        lines.append(f"  {'solve peak':<{width}}  {_size(self.solve_bytes):>10}")
        lines.append(f"  {'step peak':<{width}}  {_size(self.peak_bytes):>10}")
        avail = "unknown" if self.available_bytes is None else _size(self.available_bytes)
        lines.append(f"  {'available':<{width}}  {avail:>10}  {self.available_source}")
        lines.append(f"  fits: {self.fits}")
        lines.extend(f"  would fit: {a}" for a in self.advice)
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------
# The plan


def plan_memory(
    *,
    parameters: int,
    samples: int,
    rows: int,
    rows_total: int | None = None,
    dtype: torch.dtype = torch.float32,
    gram_dtype: torch.dtype | None = torch.float64,
    jacobian: str = "reverse",
    solver: str = "auto",
    form: str = "auto",
    slice_size: int | None = None,
    memory_budget: int = 1 << 30,
    available: int | None = None,
    available_source: str = "given",
    activations: int = 0,
    agree: Callable[[list[bool]], list[bool]] | None = None,
    peaks: list[int] | None = None,
) -> MemoryPlan:
    """Plan one LM step: resolve ``"auto"`` choices and the slice size, and check the fit.

    (Over 80 lines only because the docstring describes each argument; the body is
    the argument check, the candidate loop and the refusal, each a named step.)

    Args:
        parameters: n, the trainable scalars.
        samples: samples of this process's batch.
        rows: residual rows of this process's batch.
        rows_total: residual rows over every process (default ``rows``).
        dtype: the parameters' dtype (that of J).
        gram_dtype: dtype of ``JᵀJ``, ``JD⁻¹Jᵀ`` and the factorisations (``None``:
            ``dtype``).
        jacobian: the resolved Jacobian strategy.
        solver: ``"auto"``, ``"cholesky"``, ``"eigh"``, ``"qr"`` or ``"cg"``.
        form: ``"auto"``, ``"primal"`` or ``"dual"``.
        slice_size: samples per Jacobian slice; ``None`` picks the largest that
            keeps the slice within ``memory_budget`` and the step within
            ``available``.  For whole-batch strategies it is the chunk of
            cotangents ``batch_reverse`` pushes at once.
        memory_budget: bytes the Jacobian slice may use when ``slice_size`` is None.
        available: bytes the whole step may use; ``None`` checks nothing.
        available_source: where ``available`` came from, for messages.
        activations: entries one sample's forward pass saves for backward
            (:func:`activation_numel`); 0 leaves activations out.
        agree: with several processes (``rows_total`` above ``rows``: every process
            holds at least one residual), maps this process's list "candidate fits"
            to the list for every process (a candidate fits where it fits on all),
            so that all processes choose alike; called exactly once.
        peaks: a list to which the peak of every configuration compared with
            ``available`` is appended.  The plan depends on ``available`` only
            through those comparisons, so any other ``available`` that lies on the
            same side of each of them gives the same plan (up to the
            ``available_bytes`` it records): a caller may keep the plan while the
            free memory stays within that range (:func:`available_range`).

    Returns:
        The :class:`MemoryPlan`.  Under ``solver="auto"`` the choice is the one the
        optimizer has always made (Cholesky up to :data:`DIRECT_SOLVE_LIMIT` rows or
        columns, in the dual form when residuals are fewer than parameters, CG
        beyond), moved to the other form or to CG only when that choice does not fit.
        A plan with ``fits=False`` carries ``advice``.
    """
    _check_arguments(
        parameters=parameters,
        samples=samples,
        rows=rows,
        rows_total=rows_total,
        slice_size=slice_size,
        memory_budget=memory_budget,
        available=available,
        activations=activations,
        solver=solver,
        form=form,
        jacobian=jacobian,
        dtype=dtype,
    )
    gdt = gram_dtype or dtype
    shape = StepShape(
        n=parameters,
        samples=samples,
        rows=rows,
        rows_total=rows if rows_total is None else rows_total,
        b=dtype.itemsize,
        g=gdt.itemsize,
        converts=gdt != dtype,
        jacobian=jacobian,
        activations=activations,
    )
    candidates = _candidates(shape, solver, form)
    plans = [
        _fit(shape, c_solver, c_dual, slice_size, memory_budget, available, available_source, peaks)
        for c_solver, c_dual in candidates
    ]
    fits = [p.fits for p in plans]
    if agree is not None:
        fits = agree(fits)
    chosen = next((p for p, ok in zip(plans, fits, strict=True) if ok), None)
    if chosen is not None:
        return chosen
    return _refusal(plans[0], shape, slice_size, memory_budget, available, gram_dtype, dtype)


def available_range(peaks: list[int], available: int | None) -> tuple[int, int | None]:
    """The range ``[low, high)`` of free memory over which a plan stays the same.

    ``peaks`` are those :func:`plan_memory` compared with ``available``: ``low`` is
    the largest that fitted (0 if none), ``high`` the smallest that did not (None if
    none).  Any available memory in the range compares alike with every peak, so
    :func:`plan_memory` takes the same decisions with it.
    """
    if available is None:
        return 0, None
    low = max((p for p in peaks if p <= available), default=0)
    high = min((p for p in peaks if p > available), default=None)
    return low, high


def _check_arguments(
    *,
    parameters: int,
    samples: int,
    rows: int,
    rows_total: int | None,
    slice_size: int | None,
    memory_budget: int,
    available: int | None,
    activations: int,
    solver: str,
    form: str,
    jacobian: str,
    dtype: torch.dtype,
) -> None:
    """The arguments of :func:`plan_memory`, checked in order, with the messages users see."""
    check_integer("parameters", parameters)
    check_integer("samples", samples)
    check_integer("rows", rows)
    check_integer("rows_total", rows_total, allow_none=True)
    check_integer("slice_size", slice_size, allow_none=True)
    check_integer("memory_budget", memory_budget)
    check_integer("available", available, minimum=0, allow_none=True)
    check_integer("activations", activations, minimum=0)
    if solver not in _SOLVERS:
        raise ValueError(f"Unknown solver={solver!r}; valid choices are {_SOLVERS}.")
    if form not in _FORMS:
        raise ValueError(f"Unknown form={form!r}; valid choices are {_FORMS}.")
    if jacobian not in _JACOBIANS:
        raise ValueError(f"Unknown jacobian={jacobian!r}; valid choices are {_JACOBIANS}.")
    if not dtype.is_floating_point:
        raise ValueError(f"Invalid dtype={dtype}: must be a floating dtype.")


def _refusal(
    chosen: MemoryPlan,
    shape: StepShape,
    slice_size: int | None,
    memory_budget: int,
    available: int | None,
    gram_dtype: torch.dtype | None,
    dtype: torch.dtype,
) -> MemoryPlan:
    """The first candidate, marked as not fitting, with advice on what would fit."""
    if chosen.fits:
        # It fits here, but not on another process, where the error is explained.
        return replace(
            chosen, fits=False, available_source=chosen.available_source + "; not on every rank"
        )
    return replace(
        chosen,
        advice=_advice(shape, chosen, slice_size, memory_budget, available, gram_dtype, dtype),
    )


def _candidates(shape: StepShape, solver: str, form: str) -> list[tuple[str, bool]]:
    """(solver, dual) in order of preference."""
    m_all, n = shape.rows_total, shape.n
    dual = form == "dual" or (form == "auto" and m_all < n and solver != "cg")
    if solver != "auto":
        return [(solver, dual)]
    out: list[tuple[str, bool]] = []
    if (m_all if dual else n) <= DIRECT_SOLVE_LIMIT:
        out.append(("cholesky", dual))
    if form == "auto" and (n if dual else m_all) <= DIRECT_SOLVE_LIMIT:
        out.append(("cholesky", not dual))
    out.append(("cg", False))
    return out


def _fit(
    shape: StepShape,
    solver: str,
    dual: bool,
    slice_size: int | None,
    budget: int,
    available: int | None,
    source: str,
    peaks: list[int] | None = None,
    budget_applies: bool = True,
) -> MemoryPlan:
    """The plan of one configuration, with the largest slice that fits when not fixed.

    Appends to ``peaks`` every peak compared with ``available`` (see :func:`plan_memory`).
    """
    per_sample = not shape.jacobian.startswith("batch")
    chunk = slice_size if not per_sample else None

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

    def final(s: int) -> MemoryPlan:
        # Keep J's buffer for the next step only where it fits beside this plan.
        plan = build(s)
        if plan.fits:
            with_pool = build(s, pooled=True)
            if with_pool.fits:
                return with_pool
        return plan

    if not per_sample:
        return final(shape.samples)
    if slice_size is not None:
        return final(min(slice_size, shape.samples))

    def good(s: int) -> bool:
        plan = build(s)
        within = not budget_applies or plan.stage("jacobian slice") <= budget or s == 1
        return plan.fits and within

    # Both the slice's bytes and the step's peak grow with s: bisect for the largest
    # slice that respects the budget and fits.
    lo, hi = 1, shape.samples
    if good(hi):
        return final(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if good(mid):
            lo = mid
        else:
            hi = mid
    return final(lo)


def _advice(
    shape: StepShape,
    plan: MemoryPlan,
    slice_size: int | None,
    budget: int,
    available: int | None,
    gram_dtype: torch.dtype | None,
    dtype: torch.dtype,
) -> tuple[str, ...]:
    """Options, each changing one thing, under which the step would fit."""
    if available is None:
        return ()
    out: list[str] = []
    dual = plan.form == "dual"
    per_sample = not shape.jacobian.startswith("batch")
    s = slice_size if per_sample else None
    if per_sample and slice_size is not None:
        smaller = _fit(shape, plan.solver, dual, None, budget, available, "", None, False)
        if smaller.fits:
            out.append(f"slice_size={smaller.slice_size} (needs {_size(smaller.peak_bytes)})")
    others: list[tuple[str, str, bool]] = []
    if plan.solver != "cg":
        others.append(("solver='cg'", "cg", False))
    if plan.solver in ("cholesky", "eigh"):
        others.append((f"form={'primal' if dual else 'dual'!r}", plan.solver, not dual))
    if plan.solver in ("eigh", "qr"):
        others.append(("solver='cholesky'", "cholesky", dual))
    cg_fits = False
    for label, name, in_dual in others:
        option = _fit(shape, name, in_dual, s, budget, available, "")
        if option.fits:
            out.append(f"{label} (needs {_size(option.peak_bytes)})")
            cg_fits = cg_fits or name == "cg"
    if shape.g > 4 and plan.solver != "cg" and gram_dtype != torch.float32:
        small = replace(shape, g=4, converts=dtype != torch.float32)
        f32 = _fit(small, plan.solver, dual, s, budget, available, "")
        if f32.fits:
            out.append(f"gram_dtype=torch.float32 (needs {_size(f32.peak_bytes)})")
    # More ranks split the batch; with CG, each keeps only its own rows of J.
    for ranks in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if cg_fits:
            break
        rows = max(1, math.ceil(shape.rows / ranks))
        samples = max(1, math.ceil(shape.samples / ranks))
        spread = replace(shape, rows=rows, rows_total=shape.rows_total, samples=samples)
        option = _fit(spread, "cg", False, s, budget, available, "")
        if option.fits:
            more = (
                f"{ranks} ranks or devices"
                if shape.rows == shape.rows_total
                else (f"{ranks} times as many ranks or devices")
            )
            out.append(f"solver='cg' over {more} (needs {_size(option.peak_bytes)} on each)")
            break
    if not per_sample:
        out.append(
            "a per-sample jacobian ('reverse'), which slices the batch: possible when "
            "samples do not interact (call model.eval() for BatchNorm)"
        )
    return tuple(out)
