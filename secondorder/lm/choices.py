"""Per batch, which Jacobian strategy, solver, form, slice size and Gram dtype a step uses.

Every ``"auto"`` of :class:`~secondorder.lm.config.LMConfig` is resolved here, by one
object, :class:`Choices`:

- the Jacobian strategy: per-sample reverse mode when a sample has few residuals
  (``4k ≤ n``), forward mode when it has many (``k ≥ 4n``), otherwise whichever of
  the two is faster on a few samples, timed once per input signature; the batch
  modes when samples interact (BatchNorm in training mode, a ``ModelResidual``, or
  what the probe of the first batch of a signature shows).  A forced strategy is
  used as given, checked where it runs
  (:class:`~secondorder.lm.jacobian.CheckedStrategy`);
- solver, form and slice size: the memory planner (:mod:`secondorder.lm.planner`),
  which raises :class:`~secondorder.lm.planner.PlanError` before J is computed when
  nothing fits.  A plan is kept per batch shape (on one process) and followed again
  while the free memory stays in the range where the planner would decide the same
  (:func:`~secondorder.lm.planner.available_range`); the free memory is read again
  every :data:`PLAN_RECHECK_STEPS` uses of the plan, and on every use when the plan
  needs more than half of what was free at the last reading;
- the Gram's dtype: :class:`~secondorder.lm.precision.GramPrecision`, fixed per
  batch or chosen per iteration from λ.

With several ranks every choice is agreed (timings and fit flags are summed), so
all ranks choose alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from ..distributed import Reducer
from .batch import RowsCheck
from .config import LMConfig
from .jacobian import (
    JACOBIANS,
    PROBE_SAMPLES,
    CheckedStrategy,
    ProbeVerdict,
    Reference,
    batch_reference,
    check_strategy,
    coupling_message,
    make_jacobian,
    random_message,
)
from .linalg import LinearSolver, make_solver
from .model import ModelFunction, interacting_modules, slice_tree
from .planner import (
    USABLE_FRACTION,
    MemoryPlan,
    PlanError,
    available_memory,
    available_range,
    plan_memory,
)
from .precision import PrecisionRule, StepPrecision
from .problem import BatchSetup

__all__ = ["Choices"]

#: Entries of J (probe rows × parameters) above which the Jacobian check is skipped.
PROBE_ENTRIES = 1 << 24

#: The strategies ``"auto"`` chooses among.
_CONCRETE = tuple(name for name in JACOBIANS if name != "auto")

#: Uses of a kept memory plan between two readings of the free memory, while the plan
#: needs at most half of what was free at the last reading (see :meth:`Choices.memory_plan`).
PLAN_RECHECK_STEPS = 16

#: Batch shapes whose memory plan is kept (as many as :class:`~.batch.ProbeCache` keeps).
_KEPT_PLANS = 8


@dataclass
class _KeptPlan:
    """A memory plan, and the free memory ``[low, high)`` over which it stays the same."""

    plan: MemoryPlan
    low: int
    high: int | None
    #: Uses since the free memory was last read.
    unread: int = 0


def _signature(inputs: Any, m: int) -> str:
    """What ``jacobian="auto"``'s choice depends on: shapes per sample and rows per sample."""
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)]
    shapes = ",".join(str(tuple(t.shape[1:])) + str(t.dtype) for t in leaves)
    return f"{shapes}|rows_per_sample={m // max(1, leaves[0].shape[0])}"


class Choices:
    """Resolves the configuration's choices for each batch (see the module docstring).

    ``auto_cache`` holds the Jacobian strategies ``jacobian="auto"`` chose, per input
    signature; it is part of the optimizer's checkpoint.
    """

    def __init__(
        self, config: LMConfig, function: ModelFunction, reducer: Reducer, precision: PrecisionRule
    ) -> None:
        self.config = config
        self.function = function
        self.reducer = reducer
        self.precision = precision
        self.auto_cache: dict[str, str] = {}
        #: Per input signature, the strategy checked on a probe of its first batch.
        self.checked: dict[str, str] = {}
        #: Per ``(batch, rows, rows_total, jacobian, slice_size)``, the plan followed.
        self.plans: dict[tuple[Any, ...], _KeptPlan] = {}

    def setup(
        self,
        inputs: Any,
        targets: Any,
        batch: int,
        m: int,
        m_total: int,
        slice_size: int | None = None,
        *,
        probed: bool = True,
    ) -> tuple[BatchSetup, MemoryPlan]:
        """The setup of one batch and its memory plan; raise :class:`PlanError` if it cannot fit.

        ``m`` counts this rank's residuals, ``m_total`` those of every rank (the same
        on one process); form and solver follow the global problem, so every rank
        chooses alike.  ``slice_size`` overrides the configured one for this batch.
        ``probed=False`` (the residual count came from an earlier batch of the same
        signature) checks each slice's residuals against it (:class:`~.batch.RowsCheck`).
        """
        cfg, fn = self.config, self.function
        name = self.jacobian(inputs, targets, batch, m, m_total)
        slice_size = slice_size if slice_size is not None else cfg.slice_size
        plan = self.memory_plan(batch, m, m_total, name, slice_size)
        slices = plan.slice_size
        if slice_size is None and len(fn.group) > 1:
            # At least one slice per device, or some devices would sit idle.
            slices = min(slices, -(-batch // len(fn.group)))
        strategy = make_jacobian(name, slice_size if name.startswith("batch") else None)
        if cfg.jacobian != "auto" or fn.coupled_residual:
            # "auto" checked its choice on a probe; these are checked where they run.
            strategy = CheckedStrategy(strategy, fn.model)
        if not probed:
            strategy = RowsCheck(strategy, batch, m, fn.params[0].dtype)
        if cfg.cg_preconditioner == "kfac" and plan.solver == "cg" and not strategy.per_sample:
            raise ValueError(
                f"cg_preconditioner='kfac' needs per-sample residuals, but this batch uses "
                f"jacobian={name!r} (samples interact: a ModelResidual, or BatchNorm in "
                "training mode); use cg_preconditioner='jacobi'"
            )
        setup = BatchSetup(
            inputs=inputs,
            targets=targets,
            batch_size=batch,
            slice_size=slices,
            strategy=strategy,
            solver=self._solver(plan.solver),
            form=plan.form,
            precision=StepPrecision(self.precision.fixed),
            dual_scale=plan.form == "dual" and self.precision.varies,
            pool_rows=plan.pooled_rows,
        )
        return setup, plan

    def _solver(self, name: str) -> LinearSolver:
        cfg = self.config
        return make_solver(
            name,
            backend=cfg.linalg_backend,
            cg_rtol=cfg.cg_rtol,
            cg_max_iter=cfg.cg_max_iter,
            cg_forcing=cfg.cg_forcing,
            cg_preconditioner=cfg.cg_preconditioner,
            reducer=self.reducer,
        )

    # -- the Jacobian strategy ----------------------------------------------------------
    def jacobian(self, inputs: Any, targets: Any, batch: int, m: int, m_total: int = 0) -> str:
        """The strategy's name for this batch, checked once per input signature.

        The first batch of each signature runs the candidate strategies on a probe of
        :data:`~secondorder.lm.jacobian.PROBE_SAMPLES` samples and compares each with
        the whole probe evaluated at once (:func:`~secondorder.lm.jacobian.check_strategy`):
        samples that interact (a residual minus its batch mean, ``x - x.mean(0)``,
        ``F.batch_norm(training=True)``) or a model that per-sample ``vmap`` cannot run
        (GRU/RNN, ``Embedding(max_norm=...)``) make ``"auto"`` move on to the next
        candidate, and the residual function is checked to depend on the parameters.
        The check costs about one step on the probe, two more evaluations of it and a
        few host synchronisations, once per signature.  With several ranks, one
        all-reduce of a few numbers per step makes every rank take the same choice (a
        rank meeting a new signature alone would otherwise run the check's collectives
        alone).

        A forced strategy is returned as given, never switched: it is checked where it
        runs, on the first slice of each signature
        (:class:`~secondorder.lm.jacobian.CheckedStrategy`: the same probe for
        ``"reverse"``/``"forward"``, residuals that ignore the parameters for the
        batch modes), and raises where its Jacobian would be wrong.  That check is
        local to each rank and calls no collective.
        """
        cfg, fn = self.config, self.function
        m_total = m_total or m
        interacting = interacting_modules(fn.model)
        if cfg.jacobian in ("reverse", "forward"):
            if fn.coupled_residual:
                raise ValueError(
                    f"jacobian={cfg.jacobian!r} needs per-sample residuals, but residual_fn "
                    "is a ModelResidual; use 'batch_reverse', 'batch_forward' or 'auto'"
                )
            if interacting:
                raise ValueError(
                    f"jacobian={cfg.jacobian!r} would compute a wrong per-sample Jacobian: "
                    f"modules {interacting} mix samples (BatchNorm in training mode or "
                    "without running statistics); use 'batch_reverse', 'batch_forward' "
                    "or 'auto', or call model.eval()"
                )
        if cfg.jacobian != "auto":
            # A forced strategy runs as asked; setup() wraps it in a CheckedStrategy.
            return cfg.jacobian
        if fn.coupled_residual:
            # The residual needs the model itself: only the batch modes apply.
            return "batch_reverse" if m_total <= fn.n else "batch_forward"
        signature = _signature(inputs, m)
        known = self.checked.get(signature)
        structural = bool(interacting)
        k = max(1, m // batch)
        known, k, structural = self._agree_known(known, k, structural)
        if known is None:
            known = self._decide(inputs, targets, batch, m_total, k, structural, signature)
        if cfg.jacobian == "auto":
            self.auto_cache[signature] = known
        return known

    def _agree_known(
        self, known: str | None, k: int, structural: bool
    ) -> tuple[str | None, int, bool]:
        """Across ranks: the choice every rank already made, the largest k, any interaction.

        One all-reduce of ``world × (3 + 4)`` numbers (nothing on one process).  The
        choice is returned only when every rank has checked its signature and made the
        same one; otherwise ``None``, and every rank decides anew, together.
        """
        names = _CONCRETE
        votes = [1.0 if name == known else 0.0 for name in names]
        rows = self.reducer.gather_values(
            [1.0 if known is None else 0.0, 1.0 if structural else 0.0, float(k), *votes],
            self.function.group.solver,
        )
        unknown = sum(row[0] for row in rows)
        tally = [sum(row[3 + i] for row in rows) for i in range(len(names))]
        agreed = None
        if unknown == 0 and max(tally) == len(rows):
            agreed = names[tally.index(max(tally))]
        return agreed, int(max(row[2] for row in rows)), any(row[1] > 0 for row in rows)

    def _candidates(self, m_total: int, k: int, structural: bool, signature: str) -> list[str]:
        """The strategies to try, best first; ``"auto"``'s rule on residuals per sample."""
        cfg, n = self.config, self.function.n
        batch_modes = ["batch_reverse", "batch_forward"]
        if m_total > n:
            batch_modes.reverse()
        if cfg.jacobian != "auto":
            return [cfg.jacobian]
        if structural:
            names = batch_modes
        elif k >= 4 * n:
            names = ["forward", "reverse", *batch_modes]
        else:
            names = ["reverse", "forward", *batch_modes]
        # With several ranks only agreed numbers may shape the list (a rank's cache
        # is its own), so that every rank runs the same checks and collectives.
        cached = self.auto_cache.get(signature) if self.reducer.is_identity else None
        if cached in names:
            # A choice restored from a checkpoint is tried first, so a resumed run
            # takes the choices of the run it continues.
            names.remove(cached)
            names.insert(0, cached)
        return names

    def _flags(self, values: list[float]) -> list[float]:
        """``values`` summed over ranks (one all-reduce; nothing on one process)."""
        rows = self.reducer.gather_values(values, self.function.group.solver)
        return [sum(column) for column in zip(*rows, strict=True)]

    def _decide(
        self,
        inputs: Any,
        targets: Any,
        batch: int,
        m_total: int,
        k: int,
        structural: bool,
        signature: str,
    ) -> str:
        """Check the candidates on a probe and return the first that every rank passes."""
        fn = self.function
        names = self._candidates(m_total, k, structural, signature)
        timed = not structural and 4 * k > fn.n and k < 4 * fn.n
        if PROBE_SAMPLES * k * fn.n > PROBE_ENTRIES:
            # The probe's Jacobian alone would take more memory than the check is
            # worth (and may not fit where the planner would slice the batch): take
            # the rule's choice unchecked.  k is agreed, so every rank skips alike.
            unchecked = names[0]
            if timed and unchecked == "reverse":
                unchecked = self._probe_jacobian(inputs, targets, batch)
            self.checked[signature] = unchecked
            return unchecked
        if self.reducer.is_identity:
            timed = timed and self.auto_cache.get(signature) is None
        size = min(batch, PROBE_SAMPLES)
        p_in = slice_tree(inputs, 0, size)
        p_t = None if targets is None else slice_tree(targets, 0, size)
        _, p_in, p_t = next(fn.group.stage([(p_in, p_t)]))
        params = fn.points(fn.flat())[0]
        program = fn.replicas[0].program
        error: Exception | None = None
        reference: Reference | None = None
        with fn.frozen(), fn.group.on(0):
            try:
                reference = batch_reference(program, params, p_in, p_t)
            except Exception as exc:
                error = self.reducer.hold(exc)
            failed, random = self._flags(
                [
                    float(error is not None),
                    float(reference is not None and not reference.repeatable),
                ]
            )
            if failed:
                if error is not None:
                    raise error
                raise ValueError(
                    "the Jacobian check of this batch raised on another rank; see the error "
                    "raised there. No rank changed its parameters."
                )
            assert reference is not None
            if random:
                raise ValueError(random_message("auto", fn.model))
            verdicts: dict[str, ProbeVerdict] = {}
            chosen: str | None = None
            coupled = False
            for name in names:
                if coupled and name in ("reverse", "forward"):
                    continue
                verdict = check_strategy(make_jacobian(name), program, params, p_in, p_t, reference)
                verdicts[name] = verdict
                bad, mixed, unsure = self._flags(
                    [
                        float(verdict.status == "failed"),
                        float(verdict.status == "coupled"),
                        float(verdict.status == "undecided"),
                    ]
                )
                if mixed:
                    coupled = True
                if not bad and not mixed:
                    chosen = name
                    break
            if chosen is None:
                raise ValueError(self._no_strategy_message(verdicts))
            if timed and chosen == "reverse":
                other = check_strategy(
                    make_jacobian("forward"), program, params, p_in, p_t, reference
                )
                (bad,) = self._flags([float(other.status != "ok")])
                if not bad:
                    chosen = self._probe_jacobian(inputs, targets, batch)
        if size >= 2 and not unsure:
            # One sample cannot show an interaction, and non-finite numbers show
            # nothing: such a check is repeated on the signature's next batch.
            self.checked[signature] = chosen
        return chosen

    @staticmethod
    def _no_strategy_message(verdicts: dict[str, ProbeVerdict]) -> str:
        """Why every candidate of ``"auto"`` failed on the probe."""
        lines = []
        for name, v in verdicts.items():
            if v.status == "coupled":
                lines.append(coupling_message(name, v.detail).split(". Use")[0])
            elif v.status == "failed":
                lines.append(f"jacobian={name!r} raised {v.detail or 'on another rank'}")
            else:
                lines.append(f"jacobian={name!r} failed on another rank")
        return (
            "jacobian='auto' found no strategy that reproduces the whole batch's residuals "
            "and Jacobian on a probe of this batch: " + "; ".join(lines) + ". Nothing was changed."
        )

    def _probe_jacobian(self, inputs: Any, targets: Any, batch: int) -> str:
        """Time both per-sample modes on a small slice and keep the faster."""
        fn = self.function
        size = min(batch, 64)
        inputs = slice_tree(inputs, 0, size)
        targets = None if targets is None else slice_tree(targets, 0, size)
        # Time it where the Jacobians run: on the first device, with its replica.
        _, inputs, targets = next(fn.group.stage([(inputs, targets)]))
        params = fn.points(fn.flat())[0]
        program = fn.replicas[0].program
        names = ("reverse", "forward")
        elapsed = [0.0, 0.0]
        error: Exception | None = None
        with fn.frozen(), fn.group.on(0):
            try:
                for i, name in enumerate(names):
                    strategy = make_jacobian(name)
                    strategy(program, params, inputs, targets)  # warm-up
                    t0 = time.perf_counter()
                    strategy(program, params, inputs, targets)
                    elapsed[i] = time.perf_counter() - t0
            except Exception as exc:
                # A rank whose model raises on this slice joins the sum with a failure
                # flag, so that every rank raises (no collective is added).
                error = self.reducer.hold(exc)
                elapsed = [0.0, 0.0]
        # With several ranks, the summed timings make every rank choose the same mode.
        rows = self.reducer.gather_values([*elapsed, float(error is not None)], fn.group.solver)
        reverse, forward, failed = (sum(column) for column in zip(*rows, strict=True))
        what = "timing the per-sample Jacobian modes for jacobian='auto'"
        self.reducer.raise_together(error, failed, what)
        return names[1] if forward < reverse else names[0]

    # -- memory ---------------------------------------------------------------------------
    def memory_plan(
        self, batch: int, m: int, m_all: int, jacobian: str, slice_size: int | None
    ) -> MemoryPlan:
        """The memory plan of this step; raise :class:`PlanError` if it cannot fit.

        On one process the plan of each batch shape is kept and followed again while
        the free memory stays where :func:`~secondorder.lm.planner.plan_memory` would
        make the same decisions.  The free memory is read again on every
        :data:`PLAN_RECHECK_STEPS`-th use, and on every use when the plan needs more
        than half of what was free at the last reading; outside the range the batch
        is planned anew.  With several ranks every step is planned (the plan's
        agreement is a collective every rank must join).
        """
        key = (batch, m, m_all, jacobian, slice_size)
        # With several ranks the plan's agreement is a collective: every step is planned.
        keep = self.reducer.is_identity
        kept = self.plans.get(key) if keep else None
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
        )
        if not plan.fits:
            raise PlanError(plan)
        if keep:
            low, high = available_range(peaks, available)
            self.plans.pop(key, None)
            self.plans[key] = _KeptPlan(plan, low, high)
            while len(self.plans) > _KEPT_PLANS:
                del self.plans[next(iter(self.plans))]
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
        missing = self._flags([0.0 if f else 1.0 for f in fits])
        return [v == 0 for v in missing]
