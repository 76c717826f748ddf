"""What every damping rule shares: λ's state, an evaluated attempt, the rule's interface.

A rule moves λ after each attempt from the gain ratio ρ; :func:`raise_damping` is the
one λ-after-failure rule of the package, with its bounds.  Each rule states its
decisions twice: on Python numbers (the default step, which reads them on the host)
and on 0-d tensors with masks (:meth:`DampingRule.update`, the capturable step, which
never reads them).  Where both apply they compute the same IEEE operations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._validation import check_number

__all__ = [
    "NIELSEN_SHRINK",
    "DampingRule",
    "DampingState",
    "DeviceDamping",
    "StepRecord",
    "check_damping_factors",
    "check_damping_shrink",
    "raise_damping",
]


@dataclass
class DampingState:
    """The mutable part of damping: λ, Nielsen's growth factor ν, Moré's running scale.

    ``radius`` is the trust radius Δ of :class:`TrustRegionRule` (``None`` until its
    first iteration sets it), in the damping matrix's norm ``‖D^½δ‖``, and
    ``chosen_norm`` that norm of the last step it chose.
    """

    damping: float
    nu: float = 2.0
    scale: Tensor | None = None
    radius: float | None = None
    chosen_norm: float | None = None


@dataclass
class DeviceDamping:
    """λ, ν and Moré's scale as tensors on the solver device (the capturable step).

    0-d float64 tensors updated in place, so a step captured in a CUDA graph reads
    and writes the same memory on every replay; reading one is a host read.
    """

    damping: Tensor
    nu: Tensor
    scale: Tensor | None = None

    @classmethod
    def of(cls, state: DampingState, device: torch.device) -> DeviceDamping:
        """The device copy of ``state``."""
        wide = torch.float64
        return cls(
            damping=torch.tensor(state.damping, dtype=wide, device=device),
            nu=torch.tensor(state.nu, dtype=wide, device=device),
            scale=None if state.scale is None else state.scale.to(device).clone(),
        )

    def load_(self, state: DampingState) -> None:
        """Write ``state``'s numbers into these tensors, in place."""
        self.damping.fill_(state.damping)
        self.nu.fill_(state.nu)
        if state.scale is None:
            self.scale = None
        elif self.scale is not None and self.scale.shape == state.scale.shape:
            self.scale.copy_(state.scale)
        else:
            self.scale = state.scale.to(self.damping.device).clone()

    def read(self) -> DampingState:
        """The numbers on the host (one read)."""
        damping, nu = torch.stack([self.damping, self.nu]).tolist()
        scale = None if self.scale is None else self.scale.clone()
        return DampingState(damping=damping, nu=nu, scale=scale)


@dataclass(frozen=True)
class StepRecord:
    """What a trust-region rule needs to know about an evaluated attempt.

    ``scaled_norm`` is ``‖D^½δ‖``, ``slope`` is ``gᵀδ`` (half the derivative of
    ``Σr²`` along δ), ``actual`` the reduction ``Σr²(x) - Σr²(x + δ)``, and
    ``loss0`` and ``loss1`` the two sums of squares.
    """

    scaled_norm: float
    slope: float
    actual: float
    loss0: float
    loss1: float


class DampingRule:
    """Base class: update λ after an accepted or a rejected attempt."""

    name = ""
    #: Whether the rule picks λ itself before each attempt (:meth:`choose`).
    chooses = False

    def accept(self, state: DampingState, rho: float, step: StepRecord | None = None) -> None:
        """Update ``state`` after an attempt with gain ratio ``rho`` was accepted."""
        raise NotImplementedError

    def reject(self, state: DampingState, step: StepRecord | None = None) -> None:
        """Update ``state`` after an attempt was rejected (``step`` is ``None`` when it failed).

        A failed attempt (a failed solve, non-finite residuals) has no ``step``.
        """
        raise NotImplementedError

    def accepted(self, damping: Tensor, nu: Tensor, rho: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`accept` on 0-d tensors: ``(λ, ν)`` after an accepted attempt, no host read.

        The capturable step's form of the rule (the same operations; only a rule that
        decides on tensors alone can be captured).
        """
        raise NotImplementedError(f"the {self.name!r} rule has no tensor form")

    def rejected(self, damping: Tensor, nu: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`reject` on 0-d tensors: ``(λ, ν)`` after a rejected attempt."""
        raise NotImplementedError(f"the {self.name!r} rule has no tensor form")

    def choose(
        self,
        state: DampingState,
        scaled_norm: Callable[[float], float | None],
        scaled_xnorm: float,
        scaled_gnorm: float,
    ) -> float:
        """λ for the next attempt, given ``λ ↦ ‖D^½δ(λ)‖`` (``None`` where the solve fails).

        ``scaled_xnorm`` is ``‖D^½x‖`` and ``scaled_gnorm`` is ``‖D^-½Jᵀr‖``.  Called
        only when :attr:`chooses` is true; the other rules move λ in :meth:`accept` and
        :meth:`reject` alone.
        """
        return state.damping


#: Nielsen's largest decrease of λ per accepted step (``damping_shrink``'s default).
NIELSEN_SHRINK = 3.0


def check_damping_factors(up: object, down: object) -> None:
    """The multiplicative rule's factors: ``up`` a finite number > 1, ``down`` in (0, 1)."""
    check_number("damping_up", up, above=1, type_error=False)
    if not (isinstance(down, (int, float)) and not isinstance(down, bool) and 0 < down < 1):
        raise ValueError(f"Invalid damping_down={down!r}: must be in (0, 1).")


def check_damping_shrink(shrink: object) -> None:
    """Nielsen's largest decrease of λ per accepted step: a finite number > 1."""
    if not (
        isinstance(shrink, (int, float))
        and not isinstance(shrink, bool)
        and math.isfinite(shrink)
        and shrink > 1
    ):
        raise ValueError(
            f"Invalid damping_shrink={shrink!r}: must be a finite number > 1 (the largest "
            "factor by which Nielsen's rule lowers λ after one accepted step; Nielsen's is 3)."
        )


def raise_damping(
    rule: DampingRule,
    state: DampingState,
    *,
    damping_min: float,
    damping_max: float | None = None,
    restart: float | None = None,
    step: StepRecord | None = None,
) -> None:
    """Raise λ after a failed attempt: the rule's ``reject``, then the bounds.

    The one λ-after-failure rule of the package.  Its callers differ on purpose:

    - ``restart``: the λ to restart from when the rule left λ at zero (a rejected
      pure Gauss-Newton attempt; multiplying zero would leave it at zero for ever).
      The attempt loop (:func:`secondorder.lm.engine.iterate`) passes its
      ``damping_restart``; the optimizer's non-finite linearisation passes ``None``,
      and λ = 0 then rises only to ``damping_min``.
    - ``damping_max``: clamp λ to it here; ``None`` leaves λ above the maximum for a
      caller that ends the iteration when it gets there.

    - ``step``: the evaluated attempt, for a rule that measures it (``None``: it failed
      before its trial point could be judged).

    Then ``λ ← max(λ, damping_min)`` and, with ``damping_max``, ``λ ← min(λ, damping_max)``.
    """
    rule.reject(state, step)
    if restart is not None and state.damping <= 0.0:
        state.damping = restart
    state.damping = max(state.damping, damping_min)
    if damping_max is not None:
        state.damping = min(state.damping, damping_max)
