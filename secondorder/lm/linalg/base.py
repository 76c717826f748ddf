"""The solver interface: factor once per iteration, solve for every λ it tries.

Every solver answers the same question for a given λ and damping diagonal ``D``:

    δ = (JᵀJ + λD)⁻¹ b,        b = Jᵀw,

where the LM step uses ``w = -r`` and geodesic acceleration uses ``w = -r''``.
:meth:`LinearSolver.factor` runs once per iteration and :meth:`Factorization.solve`
once per λ, so a rejected attempt costs a solve rather than a new factorisation
wherever the method allows it.  What a solver needs from the record (J itself, the
K-FAC factors, every rank's rows) it declares as class attributes, which the
problem that builds the record reads.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..precision import NATIVE, StepPrecision
from .gram import symmetric_product
from .record import NormalEquations

__all__ = ["Factorization", "LinearSolver"]


class Factorization:
    """The reusable part of a solve for one iteration; :meth:`solve` runs per λ."""

    #: Conjugate-gradient iterations spent by the last :meth:`solve` (0 for direct solvers).
    iterations: int = 0
    #: Whether :meth:`solve_scaled` gives ``(δ, ‖D^½δ‖)`` without touching the device
    #: (a few parameters: the factors live in NumPy arrays on the host).
    on_host: bool = False
    #: The dtype of the matrix this factorisation formed (``None``: none, or the record's).
    dtype: torch.dtype | None = None

    def held_residuals(self) -> Tensor | None:
        """``-r`` as this factorisation holds it, recognised by identity (else ``None``).

        A host factorisation of ``[J, -r]`` keeps ``-r``; handing the engine that very
        tensor spares it a comparison of every entry.
        """
        return None

    def host_sqrt_d(self) -> np.ndarray | None:
        """``D^½`` in NumPy when this factorisation lives on the host (else ``None``)."""
        return None

    def solve_scaled(self, damping: float, w: Tensor) -> tuple[Tensor, float] | None:
        """``(δ, ‖D^½δ‖)`` for ``b = Jᵀw``, or ``None`` if it failed (only when :attr:`on_host`)."""
        raise NotImplementedError

    def scaled_norm(self, damping: float, w: Tensor) -> float | None:
        """``‖D^½δ‖`` of :meth:`solve_scaled`'s step alone (only when :attr:`on_host`)."""
        raise NotImplementedError

    def solve(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        """Return ``(JᵀJ + λD)⁻¹ b`` with ``b = Jᵀw``, or ``None`` if it failed.

        ``w`` is required by the solvers that work on J directly (dual form, QR).
        A ``None`` result tells the optimizer to raise λ and try again.
        """
        raise NotImplementedError

    def image(self) -> Tensor | None:
        """``Jδ`` for the ``δ`` of the last solve, if this factorisation formed it already.

        The dual form has it from the m×m matrix (``Jδ = Js Jsᵀ y``), so measuring a
        step's curvature ``‖Jδ‖²`` need not pass over J again; ``None`` (the default)
        leaves it to :meth:`NormalEquations.curvature`.  Valid until the next solve.
        """
        return None

    def solve_unchecked(self, damping: float, b: Tensor, w: Tensor | None = None) -> Tensor | None:
        """:meth:`solve` without reading a failure flag on the host.

        A failure may show as a non-finite result rather than ``None``; the optimizer
        checks the step's finiteness in the same synchronisation as its predicted
        reduction, so a solve costs no host round trip of its own.
        """
        return self.solve(damping, b, w)


class LinearSolver:
    """Base class of the solvers: a name, what it needs, and a :meth:`factor` method.

    The capabilities below are declared by each solver class (or instance) and read by
    the problem that builds the record; nothing probes a solver for attributes.
    """

    name = ""
    #: Whether this solver needs J itself (not only ``JᵀJ``) in the primal form.
    needs_jacobian = False
    #: Whether this solver needs the record's K-FAC factors (CG with ``"kfac"``).
    needs_kronecker = False
    #: Whether it works on this participant's rows of J alone, its products summed by a
    #: reducer (CG); the others need every row, gathered where the batch is shared.
    row_shards = False
    #: Whether it forms a normal matrix in the step precision's dtype (not matrix-free CG).
    forms_matrix = True

    def factor(
        self,
        system: NormalEquations,
        d: Tensor,
        uniform: bool = False,
        precision: StepPrecision = NATIVE,
    ) -> Factorization:
        """Prepare the solves of one iteration for damping diagonal ``d``.

        ``uniform``: the caller knows ``d`` to be a multiple of the identity (its damping
        matrix says so), which no solver then reads from the device.  ``precision``: the
        dtype this iteration's normal matrix is formed in (default: the record's own)
        and, in the dual form, the check that may keep a float32 matrix.
        """
        raise NotImplementedError


def _finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _nan_unless(x: Tensor, info: Tensor) -> Tensor:
    """``x`` where the factorisation succeeded (``info == 0``), NaN otherwise."""
    return torch.where(info == 0, x, torch.full_like(x, math.nan))


def _require_w(w: Tensor | None, solver: str) -> Tensor:
    if w is None:
        raise RuntimeError(f"the {solver} solver needs the residual-space vector w")
    return w


class _ScaledRows:
    """``Js = J D^-½`` for the dual solvers: ``Js Jsᵀ`` once, ``Jsᵀ y`` per solve."""

    def __init__(self, jac: Tensor, d: Tensor, dtype: torch.dtype) -> None:
        self.inv_sqrt_d = d.to(dtype).rsqrt()
        self.js = jac.to(dtype) * self.inv_sqrt_d
        self.k = symmetric_product(self.js)
        #: ``Jδ`` of the last :meth:`step`.
        self.image: Tensor | None = None

    def step(self, y: Tensor) -> Tensor:
        """``δ = D^-½ Jsᵀ y``; its image ``Jδ = Js Jsᵀ y`` is kept in :attr:`image`."""
        # An m×m product instead of a pass over J's m×n entries to measure the step.
        self.image = self.k @ y
        return self.inv_sqrt_d * (self.js.T @ y)


class _OuterRows:
    """``J D⁻¹Jᵀ`` for ``D = d₀I`` from the factors' ``J Jᵀ``; ``δ = Jᵀy / d₀`` from J.

    ``d0`` stays a 0-d tensor on the device: reading it would cost a host read.
    """

    def __init__(self, jac: Tensor, d0: Tensor, outer: Tensor) -> None:
        self.jac, self.d0 = jac, d0.to(jac.dtype)
        self.k = outer.div_(d0.to(outer.dtype))
        #: ``Jδ`` of the last :meth:`step`.
        self.image: Tensor | None = None

    def step(self, y: Tensor) -> Tensor:
        """``δ = Jᵀy / d₀`` (in J's dtype); its image ``Jδ = K y`` is kept in :attr:`image`."""
        self.image = self.k @ y
        return (self.jac.T @ y.to(self.jac.dtype)) / self.d0
