"""The default step: λ and each attempt's verdict read on the host.

One linearisation of the batch, then :func:`~secondorder.lm.engine.iterate`'s
attempts until one is accepted (or the engine's
:func:`~secondorder.lm.engine.refuse` when the linearisation holds non-finite
numbers).  The host reads the loss once and each attempt's verdict, which is what
lets the attempts stop at the first accepted one; the capturable step
(:mod:`secondorder.lm.graphs`) decides on the device instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from .damping import DampingMatrix, DampingRule, DampingState
from .engine import iterate
from .iteration import EngineConfig, refuse
from .model import ModelFunction
from .precision import PrecisionRule
from .problem import BatchSetup, ModelProblem
from .records import StepInfo
from .report import nonfinite_reason, step_info
from .writes import write_point

__all__ = ["HostStep"]


@dataclass
class HostStep:
    """The parts the default step uses (the optimizer's own objects)."""

    function: ModelFunction
    precision: PrecisionRule
    rule: DampingRule
    matrix: DampingMatrix
    state: DampingState
    config: EngineConfig

    def __call__(
        self, setup: BatchSetup, m_total: int, lr: float, inputs: Any, t_start: float
    ) -> tuple[StepInfo, ModelProblem]:
        """One step on ``setup``'s batch from the model's current parameters."""
        fn, rule, damping = self.function, self.precision, self.state.damping
        x = fn.flat().to(fn.group.solver)
        if setup.form == "primal":
            # The Gram is formed while J is computed: its precision comes first.
            setup = replace(setup, precision=rule.primal(damping, m_total))
        prob = ModelProblem(fn, setup)
        system = prob.linearize(x)
        t_lin = time.perf_counter()
        finite, loss_sum, _ = system.scalars()
        precision = setup.precision
        if setup.form == "dual":
            # The dual matrix is formed by the solver, from J and its measured scale.
            precision = rule.dual(damping, system.dual_scale_value() if rule.varies else None)
        timings = {"linearize": t_lin - t_start}
        if not finite:
            reason = nonfinite_reason(system)
            out = refuse(
                x,
                loss_sum,
                rule=self.rule,
                state=self.state,
                config=self.config,
                reason=f"{reason}; step rejected and damping raised",
            )
        else:
            out = iterate(
                prob,
                x,
                system,
                solver=prob.solver,
                rule=self.rule,
                matrix=self.matrix,
                state=self.state,
                config=self.config,
                lr=lr,
                precision=precision,
            )
            timings["solve_and_trials"] = time.perf_counter() - t_lin
            if out.accepted:
                write_point(fn, out.x, inputs)
        info = step_info(prob, system, precision, out, self.state.damping, timings, t_start)
        return info, prob
