"""The planner: price each configuration ``"auto"`` proposes and keep the first that fits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..._validation import check_integer
from ..stages import StepShape
from .advice import refusal
from .plan import MemoryPlan
from .price import fit
from .rules import form_choice, slice_choice, solver_choice

__all__ = ["USABLE_FRACTION", "available_range", "plan_memory"]

#: Share of a *measured* free memory a plan may use; the rest covers what the model
#: does not count (allocator fragmentation, the model's buffers, other processes).
USABLE_FRACTION = 0.9

_JACOBIANS = ("reverse", "forward", "batch_reverse", "batch_forward")


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
    advise_cg: bool = True,
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
        advise_cg: whether a refusal's advice may name ``solver="cg"`` (False where
            the caller refuses CG, as the capturable step does).

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
    candidates = solver_choice(solver).candidates(shape, form_choice(form))
    slices = slice_choice(slice_size, memory_budget)
    plans = [
        fit(shape, c_solver, c_dual, slices, available, available_source, peaks)
        for c_solver, c_dual in candidates
    ]
    fits = [p.fits for p in plans]
    if agree is not None:
        fits = agree(fits)
    chosen = next((p for p, ok in zip(plans, fits, strict=True) if ok), None)
    if chosen is not None:
        return chosen
    return refusal(
        plans[0], shape, slice_size, memory_budget, available, gram_dtype, dtype, advise_cg
    )


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
    solver_choice(solver)
    form_choice(form)
    if jacobian not in _JACOBIANS:
        raise ValueError(f"Unknown jacobian={jacobian!r}; valid choices are {_JACOBIANS}.")
    if not dtype.is_floating_point:
        raise ValueError(f"Invalid dtype={dtype}: must be a floating dtype.")
