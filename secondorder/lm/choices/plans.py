"""The memory plan of each batch shape, kept while the free memory says it still holds.

The planner (:func:`~secondorder.lm.planner.plan_memory`) decides solver, form and
slice size from shapes and the free memory.  :class:`KeptPlans` keeps the plan of
each batch shape (on one process) and follows it again while the free memory stays
in the range where the planner would decide the same
(:func:`~secondorder.lm.planner.available_range`).  The free memory is read again
every :data:`PLAN_RECHECK_STEPS` uses of a plan, and on every use when the plan needs
more than half of what was free at the last reading.  With several ranks every step
is planned: the plan's agreement is a collective every rank must join.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...distributed import Reducer
from ..config import LMConfig
from ..model import ModelFunction
from ..planner import (
    USABLE_FRACTION,
    MemoryPlan,
    PlanError,
    available_memory,
    available_range,
    plan_memory,
)
from ..precision import PrecisionRule

__all__ = ["PLAN_RECHECK_STEPS", "KeptPlans"]

#: Uses of a kept memory plan between two readings of the free memory, while the plan
#: needs at most half of what was free at the last reading.
PLAN_RECHECK_STEPS = 16

#: Batch shapes whose memory plan is kept (as many as :class:`~..batch.ProbeCache` keeps).
_KEPT_PLANS = 8


@dataclass
class _KeptPlan:
    """A memory plan, and the free memory ``[low, high)`` over which it stays the same."""

    plan: MemoryPlan
    low: int
    high: int | None
    #: Uses since the free memory was last read.
    unread: int = 0


class KeptPlans:
    """Plans each step's memory, keeping one plan per batch shape (module docstring)."""

    def __init__(
        self, config: LMConfig, function: ModelFunction, reducer: Reducer, precision: PrecisionRule
    ) -> None:
        self.config = config
        self.function = function
        self.reducer = reducer
        self.precision = precision
        #: Per ``(batch, rows, rows_total, jacobian, slice_size)``, the plan followed.
        self.kept: dict[tuple[Any, ...], _KeptPlan] = {}

    def plan(
        self, batch: int, m: int, m_all: int, jacobian: str, slice_size: int | None
    ) -> MemoryPlan:
        """The memory plan of this step; raise :class:`PlanError` if it cannot fit."""
        key = (batch, m, m_all, jacobian, slice_size)
        keep = self.reducer.is_identity
        kept = self.kept.get(key) if keep else None
        reading = None
        if kept is not None:
            plan, reading = self._follow(kept)
            if plan is not None:
                return plan
        cfg = self.config
        p0 = self.function.params[0]
        available, source = reading or self._available()
        peaks: list[int] = []
        plan = plan_memory(
            parameters=self.function.n,
            samples=batch,
            rows=m,
            rows_total=m_all,
            dtype=p0.dtype,
            gram_dtype=self.precision.fixed or torch.float64,
            jacobian=jacobian,
            # An array-module backend exists to factor matrices too big for torch, and
            # offers no CG: under "auto" it always factors.
            solver="cholesky"
            if cfg.solver == "auto" and cfg.linalg_backend != "torch"
            else cfg.solver,
            form=cfg.form,
            slice_size=slice_size,
            memory_budget=cfg.memory_budget,
            available=available,
            available_source=source,
            agree=None if keep else self._agree,
            peaks=peaks,
            # The capturable step refuses CG: its advice must not name it.
            advise_cg=not cfg.capturable,
        )
        if not plan.fits:
            raise PlanError(plan)
        if keep:
            low, high = available_range(peaks, available)
            self.kept.pop(key, None)
            self.kept[key] = _KeptPlan(plan, low, high)
            while len(self.kept) > _KEPT_PLANS:
                del self.kept[next(iter(self.kept))]
        return plan

    def _available(self) -> tuple[int | None, str]:
        """Bytes a step may use and where the number came from (``memory_limit`` first)."""
        limit = self.config.memory_limit
        if limit is not None:
            return limit, "memory_limit"
        device = self.function.params[0].device
        free, where = available_memory(device)
        if free is None:
            return None, where
        # J's pooled buffers are this step's to reuse (or drop before allocating anew);
        # the slices on this device are computed by the replicas' programs.
        pooled = sum(e.program.rows_pool.free_bytes(device) for e in self.function.replicas)
        usable = int(free * USABLE_FRACTION)
        if pooled:
            return usable + pooled, f"{USABLE_FRACTION:.0%} of {where}, + J's pooled rows"
        return usable, f"{USABLE_FRACTION:.0%} of {where}"

    def _follow(self, kept: _KeptPlan) -> tuple[MemoryPlan | None, tuple[int | None, str] | None]:
        """``kept``'s plan if the free memory may still be in its range, and any reading.

        ``(None, reading)`` when the free memory read now lies outside the range: the
        caller plans anew with that reading.
        """
        if self.config.memory_limit is not None:
            return kept.plan, None  # planned against the same fixed limit
        last = kept.plan.available_bytes
        kept.unread += 1
        if last is not None and kept.unread < PLAN_RECHECK_STEPS and kept.low <= last // 2:
            return kept.plan, None
        reading = self._available()
        available, source = reading
        if (available is None) != (last is None):
            return None, reading
        if available is not None and (
            available < kept.low or (kept.high is not None and available >= kept.high)
        ):
            return None, reading
        kept.unread = 0
        if (available, source) != (last, kept.plan.available_source):
            kept.plan = replace(kept.plan, available_bytes=available, available_source=source)
        return kept.plan, None

    def _agree(self, fits: list[bool]) -> list[bool]:
        # Every rank must pick the same solver and form: a candidate counts as
        # fitting only where it fits on every rank.
        rows = self.reducer.gather_values(
            [0.0 if f else 1.0 for f in fits], self.function.group.solver
        )
        missing = [sum(column) for column in zip(*rows, strict=True)]
        return [v == 0 for v in missing]
