"""The record :func:`~secondorder.fitting.least_squares` returns, with scipy's fields."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

__all__ = ["MESSAGES", "OptimizeResult"]

#: scipy's sentence for each ``status``.
MESSAGES = {
    -2: "Stopped because `callback` function raised `StopIteration`.",
    -1: "Improper input parameters status returned from the solver.",
    0: "The maximum number of function evaluations is exceeded.",
    1: "`gtol` termination condition is satisfied.",
    2: "`ftol` termination condition is satisfied.",
    3: "`xtol` termination condition is satisfied.",
    4: "Both `ftol` and `xtol` termination conditions are satisfied.",
}


class OptimizeResult(dict[str, Any]):
    """The result of :func:`least_squares`: a dict whose keys are also attributes.

    Like scipy's ``OptimizeResult``: ``res.x`` and ``res["x"]`` are the same, ``res.keys()``
    lists the fields, and ``repr(res)`` prints one short line per field (arrays by shape
    and dtype, never the whole Jacobian).

    Fields (scipy's names and meanings, plus the last three):
        x: the solution (a tensor, or a NumPy array when ``x0`` was not a tensor).
        cost: ``½ Σ ρ(f²)`` at the solution (``½‖f‖²`` for the linear loss).
        fun: residuals at the solution.
        jac: Jacobian of the residuals at the solution; under a robust loss scipy's
            modified Jacobian, rows scaled by ``√(ρ' + 2zρ'')`` (``JᵀJ`` then models the
            robust cost's Hessian).
        grad: gradient of the cost, ``Jᵀ(ρ'·f)``.
        optimality: first-order optimality, ``‖grad‖∞`` (scaled by the distance to
            active bounds as scipy's "trf" does, when bounds are given).
        active_mask: -1/0/1 for a lower bound active, none, upper bound active.
        nfev: calls of ``fun`` other than inside an autodiff Jacobian: residual
            values, finite-difference columns and geodesic second derivatives.
        njev: Jacobian evaluations ("fwd"/"rev" call ``fun`` once for each); ``None``
            with ``method="lm"`` and finite differences, as scipy reports it.
        status: -2 stopped by ``callback``, 0 max_nfev reached, 1 gtol, 2 ftol, 3 xtol,
            4 ftol and xtol (-1: the Jacobian became non-finite).
        message: a sentence for ``status``.
        success: ``status > 0``.
        nit: iterations (each ends with an accepted step or a stop).
        damping: λ at the end (specific to secondorder).
        reason: the engine's account of how the last iteration ended.
        history: the cost at the start and after each accepted step.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc

    def __dir__(self) -> list[str]:
        return list(self.keys()) + list(super().__dir__())

    def __repr__(self) -> str:
        if not self:
            return f"{type(self).__name__}()"
        width = max(len(k) for k in self)
        lines = [f"{k:>{width}}: {_short(v)}" for k, v in self.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.__repr__()


def _short(value: Any) -> str:
    """One line for a field: small arrays in full, larger ones by shape and dtype."""
    if isinstance(value, (Tensor, np.ndarray)):
        kind = "tensor" if isinstance(value, Tensor) else "array"
        if value.ndim == 0 or (value.ndim == 1 and value.shape[0] <= 6):
            return np.array2string(np.asarray(value.tolist()), precision=6, separator=", ")
        return f"{kind} of shape {tuple(value.shape)}, {value.dtype}"
    if isinstance(value, list) and len(value) > 6:
        return f"list of {len(value)} values, last {value[-1]!r}"
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
