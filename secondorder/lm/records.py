"""What the optimizer reports: :class:`StepInfo` per step, :class:`LMInternals` for tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from .damping import DampingMatrix, DampingRule, DampingState
from .problem import ModelProblem

__all__ = ["LMInternals", "SmallBatchWarning", "StepInfo"]


class SmallBatchWarning(UserWarning):
    """A batch with fewer residuals than parameters in the primal form (LM will crawl)."""


@dataclass
class StepInfo:
    """What :meth:`LevenbergMarquardt.step` did.

    Attributes:
        loss: mean of squared residual entries at the parameters the step ends with.
        loss_before: the same at the parameters the step started from.
        accepted: whether an update was applied to the model.
        terminated: whether the optimizer considers training finished; ``reason``
            says why (a convergence test, λ at its maximum, attempts exhausted).
        reason: a human-readable account of how the step ended.
        damping: λ after the step.
        attempts: number of λ values tried.
        gain_ratio: ρ of the last attempt.
        step_norm: ‖δ‖ of the applied update (0 if none).
        status: scipy-style code: 1 gtol, 2 ftol, 3 xtol, 4 ftol and xtol, else 0.
        jacobian, solver, form: the strategy, solver and form that were used.
        gram_dtype: dtype of the normal matrix (``JᵀJ`` or ``JD⁻¹Jᵀ``) and its
            factorisation this step (``"float32"``, ``"float64"``); ``""`` for CG,
            which forms no matrix.
        cg_iterations: CG iterations spent in the step (CG solver only).
        timings: seconds per stage (``"linearize"``, ``"solve_and_trials"``, ``"total"``).
    """

    loss: float
    loss_before: float
    accepted: bool
    terminated: bool
    reason: str
    damping: float
    attempts: int
    gain_ratio: float
    step_norm: float
    status: int
    jacobian: str
    solver: str
    form: str
    cg_iterations: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    gram_dtype: str = ""


@dataclass(frozen=True)
class LMInternals:
    """The optimizer's parts, for white-box tests and benchmarks; not a stable API.

    Attributes:
        problem: the per-batch :class:`~secondorder.lm.problem.ModelProblem` of the
            last :meth:`~LevenbergMarquardt.step` or :meth:`~LevenbergMarquardt.plan`
            (``None`` before the first); it exposes ``params``, ``unflatten(x)``,
            ``slices()``, ``strategy``, ``program``, ``gram_dtype``, ``form``,
            ``solver``, ``linearize(x)`` and ``loss_sum(x)``.
        damping_matrix: builds ``D`` (``damping_matrix.diagonal(col_sq, damping_state)``).
        damping_rule: moves λ after each attempt.
        damping_state: λ, ν and Moré's scale; the optimizer's own, mutable, object.
    """

    problem: ModelProblem | None
    damping_matrix: DampingMatrix
    damping_rule: DampingRule
    damping_state: DampingState
