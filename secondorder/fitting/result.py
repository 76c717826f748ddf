"""The record :func:`~secondorder.fitting.least_squares` returns, with scipy's fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["MESSAGES", "OptimizeResult"]

#: scipy's sentence for each ``status``.
MESSAGES = {
    -1: "Improper input parameters status returned from the solver.",
    0: "The maximum number of function evaluations is exceeded.",
    1: "`gtol` termination condition is satisfied.",
    2: "`ftol` termination condition is satisfied.",
    3: "`xtol` termination condition is satisfied.",
    4: "Both `ftol` and `xtol` termination conditions are satisfied.",
}


@dataclass
class OptimizeResult:
    """The result of :func:`least_squares`, with scipy's field names and meanings.

    Attributes:
        x: the solution (a tensor, or a NumPy array when ``x0`` was one).
        cost: ``½ Σ ρ(f²)`` at the solution (``½‖f‖²`` for the linear loss).
        fun: residuals at the solution.
        jac: Jacobian of the residuals at the solution (unscaled by the loss).
        grad: gradient of the cost, ``Jᵀ(ρ'·f)``.
        optimality: first-order optimality, ``‖grad‖∞`` (scaled by the distance to
            active bounds as scipy's "trf" does, when bounds are given).
        active_mask: -1/0/1 for a lower bound active, none, upper bound active.
        nfev: calls of ``fun`` other than inside an autodiff Jacobian: residual
            values, finite-difference columns and geodesic second derivatives.
        njev: Jacobian evaluations ("fwd"/"rev" call ``fun`` once for each).
        status: 0 max_nfev reached, 1 gtol, 2 ftol, 3 xtol, 4 ftol and xtol.
        message: a sentence for ``status``.
        success: ``status > 0``.
        damping: λ at the end (specific to secondorder).
        reason: the engine's account of how the last iteration ended.
        history: the cost at the start and after each accepted step.
    """

    x: Any
    cost: float
    fun: Any
    jac: Any
    grad: Any
    optimality: float
    active_mask: Any
    nfev: int
    njev: int
    status: int
    message: str
    success: bool
    damping: float = 0.0
    reason: str = ""
    history: list[float] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)
