"""Per batch, which Jacobian strategy, solver, form, slice size and Gram dtype a step uses.

Every ``"auto"`` of :class:`~secondorder.lm.config.LMConfig` is resolved here, by one
object, :class:`Choices`:

- the Jacobian strategy: per-sample reverse mode when a sample has few residuals
  (``4k ≤ n``), forward mode when it has many (``k ≥ 4n``), otherwise whichever of
  the two is faster on a few samples, timed once per input signature; the batch
  modes when samples interact (BatchNorm in training mode, a ``ModelResidual``);
- solver, form and slice size: the memory planner (:mod:`secondorder.lm.planner`),
  which raises :class:`~secondorder.lm.planner.PlanError` before J is computed when
  nothing fits;
- the Gram's dtype: :class:`~secondorder.lm.precision.GramPrecision`, fixed per
  batch or chosen per iteration from λ.

With several ranks every choice is agreed (timings and fit flags are summed), so
all ranks choose alike.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from ..distributed import Reducer
from .backends import make_backend_solver
from .config import LMConfig
from .jacobian import make_jacobian
from .linalg import LinearSolver, NormalEquations
from .model import ModelFunction, interacting_modules, slice_tree
from .planner import USABLE_FRACTION, MemoryPlan, PlanError, available_memory, plan_memory
from .precision import GramPrecision
from .problem import BatchSetup
from .sharded import BroadcastSolver, ShardedCGSolver

__all__ = ["Choices", "normal_matrix_dtype", "set_solver_dtype"]


def set_solver_dtype(solver: LinearSolver, dtype: torch.dtype) -> None:
    """Make ``solver`` (or the solver a distributed wrapper runs) factor in ``dtype``."""
    inner = getattr(solver, "inner", solver)
    if hasattr(inner, "dtype"):
        inner.dtype = dtype


def normal_matrix_dtype(solver: LinearSolver, system: NormalEquations) -> str:
    """The dtype the step's normal matrix is formed and factored in, as a name."""
    if system.gram is not None:
        return str(system.gram.dtype).replace("torch.", "")
    inner = getattr(solver, "inner", solver)
    if not hasattr(inner, "dtype") or system.jac is None:
        return ""
    dtype = inner.dtype or system.jac.dtype
    return str(dtype).replace("torch.", "")


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

    def __init__(self, config: LMConfig, function: ModelFunction, reducer: Reducer) -> None:
        self.config = config
        self.function = function
        self.reducer = reducer
        self.precision = GramPrecision(
            config.gram_dtype, config.gram_auto_tol, config.damping_matrix
        )
        self.auto_cache: dict[str, str] = {}

    def setup(
        self,
        inputs: Any,
        targets: Any,
        batch: int,
        m: int,
        m_total: int,
        slice_size: int | None = None,
    ) -> tuple[BatchSetup, MemoryPlan]:
        """The setup of one batch and its memory plan; raise :class:`PlanError` if it cannot fit.

        ``m`` counts this rank's residuals, ``m_total`` those of every rank (the same
        on one process); form and solver follow the global problem, so every rank
        chooses alike.  ``slice_size`` overrides the configured one for this batch.
        """
        cfg, fn = self.config, self.function
        name = self.jacobian(inputs, targets, batch, m)
        slice_size = slice_size if slice_size is not None else cfg.slice_size
        plan = self.memory_plan(batch, m, m_total, name, slice_size)
        dtype = fn.params[0].dtype
        gram_dtype = self.precision.fixed(dtype)
        slices = plan.slice_size
        if slice_size is None and len(fn.group) > 1:
            # At least one slice per device, or some devices would sit idle.
            slices = min(slices, -(-batch // len(fn.group)))
        strategy = make_jacobian(name, slice_size if name.startswith("batch") else None)
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
            solver=self._solver(plan.solver, gram_dtype),
            form=plan.form,
            gram_dtype=gram_dtype,
            dual_scale=plan.form == "dual" and self.precision.varies(dtype),
        )
        return setup, plan

    def _solver(self, name: str, gram_dtype: torch.dtype | None) -> LinearSolver:
        cfg = self.config
        cg: dict[str, Any] = {
            "cg_rtol": cfg.cg_rtol,
            "cg_max_iter": cfg.cg_max_iter,
            "cg_forcing": cfg.cg_forcing,
        }
        if cfg.cg_preconditioner != "jacobi":
            # Only passed when set, so array-module backends see the options they know.
            cg["cg_preconditioner"] = cfg.cg_preconditioner
        if self.reducer.world_size == 1:
            return make_backend_solver(name, cfg.linalg_backend, gram_dtype, **cg)
        inner = (
            ShardedCGSolver(
                self.reducer,
                cfg.cg_rtol,
                cfg.cg_max_iter,
                cfg.cg_forcing,
                cfg.cg_preconditioner,
            )
            if name == "cg"
            else make_backend_solver(name, cfg.linalg_backend, gram_dtype, **cg)
        )
        return BroadcastSolver(inner, self.reducer)

    # -- the Gram's dtype, per iteration ---------------------------------------------------
    def varies(self) -> bool:
        """Whether the Gram's dtype is chosen per iteration (``gram_dtype="auto"``, float32)."""
        return self.precision.varies(self.function.params[0].dtype)

    def primal_gram_dtype(self, damping: float, m_total: int) -> torch.dtype:
        """The primal Gram's dtype for an iteration starting at λ = ``damping``."""
        return self.precision.choose(self.function.params[0].dtype, damping, m_total)

    def dual_gram_dtype(self, damping: float, scale: float) -> torch.dtype:
        """The dual matrix's dtype at λ = ``damping`` and mean diagonal ``scale``."""
        dtype = self.function.params[0].dtype
        return self.precision.choose(dtype, damping, self.function.n, scale)

    # -- the Jacobian strategy ----------------------------------------------------------
    def jacobian(self, inputs: Any, targets: Any, batch: int, m: int) -> str:
        """The strategy's name; refuse per-sample strategies where samples interact."""
        cfg, fn = self.config, self.function
        n = fn.n
        interacting = interacting_modules(fn.model)
        if cfg.jacobian != "auto":
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
            return cfg.jacobian
        if fn.coupled_residual or interacting:
            return "batch_reverse" if m <= n else "batch_forward"
        signature = _signature(inputs, m)
        if signature in self.auto_cache:
            return self.auto_cache[signature]
        k = max(1, m // batch)
        if 4 * k <= n:
            choice = "reverse"
        elif k >= 4 * n:
            choice = "forward"
        else:
            choice = self._probe_jacobian(inputs, targets, batch)
        self.auto_cache[signature] = choice
        return choice

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
        elapsed = torch.zeros(len(names), dtype=torch.float64, device=fn.group.solver)
        with fn.frozen(), fn.group.on(0):
            for i, name in enumerate(names):
                strategy = make_jacobian(name)
                strategy(program, params, inputs, targets)  # warm-up
                t0 = time.perf_counter()
                strategy(program, params, inputs, targets)
                elapsed[i] = time.perf_counter() - t0
        # With several ranks, the summed timings make every rank choose the same mode.
        self.reducer.sum_([elapsed])
        return names[1] if bool(elapsed[1] < elapsed[0]) else names[0]

    # -- memory ---------------------------------------------------------------------------
    def memory_plan(
        self, batch: int, m: int, m_all: int, jacobian: str, slice_size: int | None
    ) -> MemoryPlan:
        """The memory plan of this step; raise :class:`PlanError` if it cannot fit."""
        cfg = self.config
        p0 = self.function.params[0]
        available: int | None = cfg.memory_limit
        source = "memory_limit"
        if available is None:
            free, where = available_memory(p0.device)
            available = None if free is None else int(free * USABLE_FRACTION)
            source = where if free is None else f"{USABLE_FRACTION:.0%} of {where}"
        world = self.reducer.world_size
        plan = plan_memory(
            parameters=self.function.n,
            samples=batch,
            rows=m,
            rows_total=m_all,
            dtype=p0.dtype,
            gram_dtype=self.precision.fixed(p0.dtype) or torch.float64,
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
            world_size=world,
            agree=self._agree if world > 1 else None,
        )
        if not plan.fits:
            raise PlanError(plan)
        return plan

    def _agree(self, fits: list[bool]) -> list[bool]:
        # Every rank must pick the same solver and form: a candidate counts as
        # fitting only where it fits on every rank.
        flags = torch.tensor([0.0 if f else 1.0 for f in fits], dtype=torch.float64)
        flags = flags.to(self.function.params[0].device)
        self.reducer.sum_([flags])
        return [bool(v == 0) for v in flags]
