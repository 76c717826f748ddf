"""What a step reports: :class:`~secondorder.lm.records.StepInfo` from an outcome.

The default step's numbers are Python numbers read with its decisions; the
capturable step's are 0-d tensors, views of one float64 vector computed on the
device, that the user reads when (and if) they want to.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch
from torch import Tensor

from .capturable import REPORT
from .graphs import StepRun
from .iteration import Outcome
from .linalg import NormalEquations
from .precision import StepPrecision
from .problem import ModelProblem
from .records import SmallBatchWarning, StepInfo

__all__ = [
    "CAPTURABLE_REASON",
    "SmallBatchWatch",
    "capturable_info",
    "choices_made",
    "nonfinite_reason",
    "step_info",
]

#: The steps in which the small-batch warning looks for a change of batch.
SMALL_BATCH_STEPS = 10

#: ``info.reason`` of a capturable step whose decision was not read on the host.
CAPTURABLE_REASON = (
    "decided on the device (capturable=True): read info.accepted and info.status, or "
    "info.terminated on a check step"
)

#: Scipy's status codes, as the engine words them.
_STATUS = {
    1: "gtol: the gradient is orthogonal to the residuals (max |cos| <= gtol)",
    2: "ftol: relative reduction of the loss below ftol",
    3: "xtol: relative step size below xtol",
    4: "ftol and xtol: both the loss reduction and the step are below tolerance",
}


def choices_made(
    prob: ModelProblem,
    system: NormalEquations,
    precision: StepPrecision,
    factored: torch.dtype | None,
) -> dict[str, Any]:
    """What the step used, by name; ``factored``: the dtype its factorisation formed."""
    dtype: torch.dtype | None = None
    if system.gram is not None:
        dtype = system.gram.dtype
    elif prob.solver.forms_matrix and system.jac is not None:
        dtype = factored or precision.dtype or system.jac.dtype
    return {
        "jacobian": prob.strategy.name,
        "solver": prob.solver.name,
        "form": prob.form,
        "gram_dtype": "" if dtype is None else str(dtype).replace("torch.", ""),
    }


def nonfinite_reason(system: NormalEquations) -> str:
    """What is not finite in a linearisation that :meth:`~.linalg.NormalEquations.scalars` refused.

    Read from the reduced parts alone, after the refusal (no pass over J, no
    collective, the same on every rank): a finite ``diag(JᵀJ)`` means a finite J,
    and so does a finite Gram wider than J (J's squares cannot overflow it).
    """

    def finite(t: Tensor | None) -> bool:
        return t is None or bool(torch.isfinite(t).all())

    def name(t: Tensor) -> str:
        return str(t.dtype).removeprefix("torch.")

    advice = "scale the targets and residuals down, or train in float64 with model.double()"
    known = "at the current parameters, with finite residuals and Jacobian"
    gram, grad, col_sq = system.gram, system.grad, system.col_sq
    if not finite(system.loss_sum):
        return "non-finite residuals or Jacobian at the current parameters"
    if finite(col_sq):
        if not finite(grad):
            return f"Jᵀr overflowed {name(grad)} {known}: {advice}"
        if gram is not None and not finite(gram):
            return f"the Gram JᵀJ overflowed {name(gram)} {known}: {advice}"
    elif gram is not None and gram.dtype.itemsize > col_sq.dtype.itemsize:
        if finite(gram):
            return f"diag(JᵀJ) overflowed {name(col_sq)} {known}: {advice}"
        return (
            "non-finite Jacobian at the current parameters, with finite residuals: the "
            "model's derivatives hold NaN or inf there"
        )
    return (
        f"non-finite residuals or Jacobian at the current parameters (the residuals are "
        f"finite: J holds NaN or inf, or its products overflowed {name(grad)}; if J is "
        f"finite, {advice})"
    )


def step_info(
    prob: ModelProblem,
    system: NormalEquations,
    precision: StepPrecision,
    out: Outcome,
    damping: float,
    timings: dict[str, float],
    t_start: float,
) -> StepInfo:
    """The default step's report of ``out`` (λ after the step: ``damping``).

    The losses are means over :meth:`~.linalg.NormalEquations.mean_denominator`: the
    residual count, or cross-entropy's weighted count (NaN where that is 0, as torch's).
    """
    count = system.mean_denominator()
    return StepInfo(
        loss=out.loss_sum / count if count else math.nan,
        loss_before=out.loss_sum_before / count if count else math.nan,
        accepted=out.accepted,
        terminated=out.stop,
        reason=out.reason,
        damping=damping,
        attempts=out.attempts,
        gain_ratio=out.gain_ratio,
        step_norm=out.step_norm,
        status=out.status,
        cg_iterations=out.cg_iterations,
        timings={**timings, "total": time.perf_counter() - t_start},
        **choices_made(prob, system, precision, out.matrix_dtype),
    )


def capturable_info(run: StepRun, t_start: float) -> StepInfo:
    """The capturable step's report: 0-d tensors, and ``terminated`` from a check step.

    The step reports means over the residual count; for cross-entropy they are
    rescaled, on the device, to means over the batch's weighted count
    (:mod:`.loss_mean`).
    """
    report, prob, precision, checked = run.report, run.problem, run.precision, run.checked
    if prob.weight_sum is not None:
        weights = prob.weight_sum
        # Exactly 1 where the weights are the count: the numbers are then unchanged.
        factor = torch.where(weights > 0, max(run.count, 1) / weights, math.nan)
        report = torch.cat([report[:2] * factor, report[2:]])
    values = dict(zip(REPORT, report.unbind(), strict=True))
    terminated = checked is not None and checked[0]
    reason = CAPTURABLE_REASON
    if terminated and checked is not None:
        status = checked[1]
        reason = _STATUS.get(
            status,
            "a step since the last check stopped (damping at its maximum, or attempts exhausted)",
        )
    dtype = precision.dtype or prob.params[0].dtype
    return StepInfo(
        loss=values["loss"],
        loss_before=values["loss_before"],
        accepted=values["accepted"] > 0,
        terminated=terminated,
        reason=reason,
        damping=values["damping"],
        attempts=values["attempts"],
        gain_ratio=values["gain_ratio"],
        step_norm=values["step_norm"],
        status=values["status"],
        jacobian=prob.strategy.name,
        solver=prob.solver.name,
        form=prob.form,
        gram_dtype=str(dtype).replace("torch.", ""),
        timings={"total": time.perf_counter() - t_start},
        graph=run.graph,
    )


class SmallBatchWatch:
    """Warn, once, when primal mini-batches have fewer residuals than parameters.

    With m < n residuals, J has rank at most m: each step fits the batch it is
    given, and training on a stream of such batches progresses slowly; the primal
    form also factors an n×n matrix for it where the dual form solves the same step
    with an m×m one.  One batch stepped repeatedly (a fit) is fine, so the warning
    waits for a second, different batch among the first steps (batches are told
    apart by their shape and two sums, so views of the same data count as the same
    batch).
    """

    def __init__(self) -> None:
        self.warned = False
        #: A fingerprint of the last step's inputs, to tell mini-batches from one batch.
        self.last: tuple[Any, ...] | None = None

    def check(self, first: Tensor | None, m_total: int, n: int, steps: int) -> None:
        """``first``: the batch's first input tensor; ``steps``: the optimizer's count."""
        if self.warned or m_total >= n or first is None or steps >= SMALL_BATCH_STEPS:
            return
        with torch.no_grad():
            v = first.detach().to(torch.float64)
            mark = (tuple(first.shape), *torch.stack([v.sum(), (v * v).sum()]).tolist())
        previous, self.last = self.last, mark
        if previous is None or previous == mark:
            return
        self.warned = True
        warnings.warn(
            f"LevenbergMarquardt: mini-batches of {m_total} residuals for {n} parameters "
            f"in the primal form: JᵀJ has rank at most {m_total} < {n}, so each step fits "
            "its own batch and training progresses slowly. Use batches of at least "
            f"{n} residuals (a larger batch_size, or the whole data set per step), or "
            "form='dual' (or 'auto'), which solves the same step as an m×m system; for "
            "small mini-batches a first-order optimizer (torch.optim.Adam) fits better. "
            "Shown once per optimizer.",
            SmallBatchWarning,
            stacklevel=4,
        )
