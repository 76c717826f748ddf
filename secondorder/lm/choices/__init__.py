"""Per batch, the Jacobian strategy, solver, form, slice size and Gram dtype of a step.

One object per decision, each ``"auto"`` an object above the concrete options it
picks among (as lineax's ``AutoLinearSolver`` sits above the solvers it picks):

- the Jacobian strategy: :class:`~.jacobian.ForcedJacobian` or
  :class:`~.jacobian.AutoJacobian` (:mod:`.jacobian`, checked on a probe by
  :class:`~.probe.Probe`);
- solver, form and slice size: the planner's :mod:`~secondorder.lm.planner.rules`
  (``AutoSolver``, ``AutoForm``, ``AutoSlice`` and their fixed counterparts), priced
  by :func:`~secondorder.lm.planner.plan_memory`, which raises
  :class:`~secondorder.lm.planner.PlanError` before J is computed when nothing fits;
  the plan of each batch shape is kept by :class:`~.plans.KeptPlans`;
- the Gram's dtype: :class:`~secondorder.lm.precision.PrecisionRule`.

:class:`Choices` asks each in turn and assembles the batch's
:class:`~secondorder.lm.problem.BatchSetup`.  With several ranks every choice is
agreed (timings and fit flags are summed), so all ranks choose alike.
"""

from __future__ import annotations

from typing import Any

from ...distributed import Reducer
from ..batch import RowsCheck
from ..config import LMConfig
from ..linalg import LinearSolver, make_solver
from ..model import ModelFunction
from ..planner import MemoryPlan
from ..planner.rules import slice_choice
from ..precision import PrecisionRule, StepPrecision
from ..problem import BatchSetup
from .jacobian import AutoJacobian, ForcedJacobian, JacobianChoice, jacobian_choice
from .plans import PLAN_RECHECK_STEPS, KeptPlans

__all__ = [
    "PLAN_RECHECK_STEPS",
    "AutoJacobian",
    "Choices",
    "ForcedJacobian",
    "JacobianChoice",
    "KeptPlans",
]


class Choices:
    """The decisions of each batch, wired together (see the module docstring).

    :attr:`auto_cache` holds the Jacobian strategies ``jacobian="auto"`` chose, per
    input signature; it is part of the optimizer's checkpoint.
    """

    def __init__(
        self, config: LMConfig, function: ModelFunction, reducer: Reducer, precision: PrecisionRule
    ) -> None:
        self.config = config
        self.function = function
        self.reducer = reducer
        self.precision = precision
        self.jacobian: JacobianChoice = jacobian_choice(config.jacobian, function, reducer)
        self.memory = KeptPlans(config, function, reducer, precision)

    @property
    def auto_cache(self) -> dict[str, str]:
        """The strategies ``jacobian="auto"`` chose, per input signature."""
        return self.jacobian.cache

    @auto_cache.setter
    def auto_cache(self, cache: dict[str, str]) -> None:
        self.jacobian.cache = cache

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
        """The setup of one batch and its memory plan; raise ``PlanError`` if it cannot fit.

        ``m`` counts this rank's residuals, ``m_total`` those of every rank (the same
        on one process); form and solver follow the global problem, so every rank
        chooses alike.  ``slice_size`` overrides the configured one for this batch.
        ``probed=False`` (the residual count came from an earlier batch of the same
        signature) checks each slice's residuals against it (:class:`~..batch.RowsCheck`).
        """
        cfg, fn = self.config, self.function
        name = self.jacobian.select(inputs, targets, batch, m, m_total)
        slice_size = slice_size if slice_size is not None else cfg.slice_size
        plan = self.memory.plan(batch, m, m_total, name, slice_size)
        slices = slice_choice(slice_size, cfg.memory_budget).spread(
            plan.slice_size, batch, len(fn.group)
        )
        strategy = self.jacobian.strategy(name, slice_size)
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
        """The plan's solver, built with the configuration's options."""
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
