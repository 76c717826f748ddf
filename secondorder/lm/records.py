"""What the optimizer reports: :class:`StepInfo` per step, :class:`LMInternals` for tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

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
        graph: with ``capturable=True``, how the step ran: ``"captured"``,
            ``"replayed"`` (a CUDA graph), or ``"eager: <why not a graph>"``.

    With ``capturable=True`` the numbers (``loss`` to ``status``, ``accepted``) are
    0-d tensors on the solver device, views of one vector: reading one waits for the
    step, as any read of a device value does.  ``terminated`` is read on the host on
    every ``check_every``-th step only, and is ``False`` in between.
    """

    loss: float | Tensor
    loss_before: float | Tensor
    accepted: bool | Tensor
    terminated: bool
    reason: str
    damping: float | Tensor
    attempts: int | Tensor
    gain_ratio: float | Tensor
    step_norm: float | Tensor
    status: int | Tensor
    jacobian: str
    solver: str
    form: str
    cg_iterations: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    gram_dtype: str = ""
    graph: str = ""


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
