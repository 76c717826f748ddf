"""What one LM iteration is given and gives back, and the rejection of a point.

:class:`Problem` is what the engine (:mod:`secondorder.lm.engine`) needs of a
least-squares problem, :class:`EngineConfig` its settings (built in one place,
:meth:`EngineConfig.of`), :class:`Outcome` what an iteration did, and :func:`refuse`
the one rejection of a point with non-finite numbers, shared by the optimizer and
:func:`~secondorder.fitting.least_squares`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import Tensor

from .damping import DampingRule, DampingState, raise_damping
from .linalg import NormalEquations

__all__ = ["EngineConfig", "Outcome", "Problem", "refuse", "unmoved"]


class Problem(Protocol):
    """What the engine needs from a least-squares problem at the current batch."""

    def loss_sum(self, x: Tensor) -> Tensor | float:
        """``Σ r²`` at ``x`` over every residual (reduced over all shares), 0-d or a number."""
        ...

    def second_directional(
        self, x: Tensor, v: Tensor, system: NormalEquations
    ) -> tuple[Tensor, Tensor | None]:
        """``(Jᵀr_vv, r_vv)`` with ``r_vv = Σᵢⱼ ∂²r/∂xᵢ∂xⱼ vᵢvⱼ`` (for geodesic steps).

        The second element may be ``None`` when the solver does not need it.
        """
        ...


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the attempt loop and of the termination tests (validated upstream)."""

    max_attempts: int = 10
    min_gain_ratio: float = 1e-4
    damping_min: float = 1e-12
    damping_max: float = 1e12
    #: λ after a rejected attempt that started from λ = 0 (a pure Gauss-Newton step);
    #: multiplying zero would leave it at zero for ever.
    damping_restart: float = 1e-3
    ftol: float = 1e-8
    xtol: float = 1e-8
    gtol: float = 1e-8
    geodesic: bool = False
    geodesic_alpha: float = 0.75

    @classmethod
    def of(cls, settings: object, **fixed: Any) -> EngineConfig:
        """The engine's settings: ``fixed``, else the attribute of ``settings`` of that name.

        The one place both drivers build it: the optimizer passes its
        :class:`~secondorder.lm.config.LMConfig`, least_squares its options and the
        bounds it fixes.  A tolerance of ``None`` disables its test (0); a field
        neither names keeps its default.
        """
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in fixed:
                values[f.name] = fixed[f.name]
            elif hasattr(settings, f.name):
                value = getattr(settings, f.name)
                values[f.name] = 0.0 if value is None and f.name.endswith("tol") else value
        return cls(**values)


@dataclass
class Outcome:
    """What one iteration did.

    ``status`` follows scipy.optimize.least_squares: 1 gtol, 2 ftol, 3 xtol, 4 ftol
    and xtol; 0 means no convergence test fired.  ``stop`` is set when the iteration
    cannot go on: attempts exhausted, λ at its maximum, or non-finite residuals.
    """

    x: Tensor
    accepted: bool
    loss_sum: float
    loss_sum_before: float
    attempts: int
    status: int
    reason: str
    stop: bool
    gain_ratio: float
    step_norm: float
    cg_iterations: int
    #: The dtype the factorisation formed its matrix in (``None``: none was formed).
    matrix_dtype: torch.dtype | None = None


def unmoved(
    x: Tensor,
    loss0: float,
    *,
    attempts: int,
    status: int,
    reason: str,
    stop: bool,
    gain_ratio: float,
    cg_iterations: int = 0,
    matrix_dtype: torch.dtype | None = None,
) -> Outcome:
    """The :class:`Outcome` of an iteration that leaves ``x`` where it was."""
    return Outcome(
        x=x,
        accepted=False,
        loss_sum=loss0,
        loss_sum_before=loss0,
        attempts=attempts,
        status=status,
        reason=reason,
        stop=stop,
        gain_ratio=gain_ratio,
        step_norm=0.0,
        cg_iterations=cg_iterations,
        matrix_dtype=matrix_dtype,
    )


def refuse(
    x: Tensor,
    loss_sum: float,
    *,
    rule: DampingRule,
    state: DampingState,
    config: EngineConfig,
    reason: str,
) -> Outcome:
    """Reject a point whose linearisation holds non-finite numbers: no attempt, λ raised.

    The one rejection of a point for both drivers (the optimizer's step and
    least_squares' iterations): the rule's ``reject`` without a restart from zero, λ
    kept within ``[damping_min, damping_max]``, ``x`` unmoved.  ``reason`` is the
    driver's account of what was not finite.
    """
    raise_damping(rule, state, damping_min=config.damping_min, damping_max=config.damping_max)
    return unmoved(
        x, loss_sum, attempts=1, status=0, reason=reason, stop=False, gain_ratio=math.nan
    )
