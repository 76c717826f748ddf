"""Jacobian strategies: how the rows of J for one slice of the batch are computed.

All strategies return the same thing, ``(J, r)`` for a slice: J of shape
``(residuals in the slice, parameters)`` and the residuals themselves, and all are
tested against :func:`torch.func.jacrev` of the whole residual vector.  They differ in
cost:

* ``"reverse"`` (per-sample reverse mode, ``vmap`` over ``vjp``): one backward pass
  per residual of a sample, all samples at once.  Cost grows with the number of
  residuals *per sample* (1 for a scalar regression, the class count for
  cross-entropy on raw outputs) and not with the parameter count: the usual choice.
* ``"forward"`` (per-sample forward mode, ``vmap`` over ``jvp``): one forward pass per
  parameter.  Wins only when a sample has more residuals than the model has
  parameters (small models with large outputs).
* ``"batch_reverse"`` / ``"batch_forward"``: differentiate the residual vector of
  the whole slice at once.  Needed when samples interact (BatchNorm in training mode
  normalises with batch statistics, so a per-sample Jacobian would be wrong) and for
  :class:`~secondorder.residuals.ModelResidual`.  Reverse costs one backward per
  residual of the slice, forward one forward per parameter; the cheaper is taken
  under ``"auto"``.

Per-sample strategies assume each sample's residuals depend on that sample only;
``"auto"`` checks the model for modules that break this and falls back to a
whole-batch mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.func import jacfwd, jacrev, vmap

__all__ = [
    "JACOBIANS",
    "BatchForward",
    "BatchReverse",
    "JacobianStrategy",
    "PerSampleForward",
    "PerSampleReverse",
    "ResidualProgram",
    "make_jacobian",
]

Params = dict[str, Tensor]


@dataclass(frozen=True)
class ResidualProgram:
    """The residuals of a problem as pure functions of the parameters.

    Attributes:
        per_sample: ``f(params, x_i, y_i) -> r_i`` (1-D) for one sample without its
            batch dimension, or ``None`` when samples cannot be separated.
        batch: ``f(params, X, Y) -> r`` (1-D) for a whole slice.
        order: parameter names in the order of J's columns.
        targets_batched: whether targets carry a batch dimension to slice.
    """

    per_sample: Callable[[Params, Any, Any], Tensor] | None
    batch: Callable[[Params, Any, Any], Tensor]
    order: tuple[str, ...]
    targets_batched: bool = True


def _with_aux(f: Callable[..., Tensor]) -> Callable[..., tuple[Tensor, Tensor]]:
    def g(*args: Any) -> tuple[Tensor, Tensor]:
        r = f(*args)
        return r, r

    return g


def _flatten(jac: dict[str, Tensor], order: tuple[str, ...], rows: int) -> Tensor:
    return torch.cat([jac[name].reshape(rows, -1) for name in order], dim=1)


class JacobianStrategy:
    """Base class: compute ``(J, r)`` for one slice."""

    name = ""
    #: Whether the strategy treats samples separately (and so may slice the batch).
    per_sample = True

    def __call__(
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        """Return J (rows × parameters) and r (rows) of this slice."""
        raise NotImplementedError


def _per_sample_fn(program: ResidualProgram) -> Callable[[Params, Any, Any], Tensor]:
    if program.per_sample is None:
        raise ValueError(
            "This residual couples samples (a ModelResidual or a model whose samples "
            "interact); use jacobian='batch_reverse' or 'batch_forward'."
        )
    return program.per_sample


class PerSampleReverse(JacobianStrategy):
    """``vmap`` over samples of reverse-mode ``jacrev``: cost ∝ residuals per sample."""

    name = "reverse"

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        f = _per_sample_fn(program)
        y_dim = 0 if program.targets_batched and targets is not None else None
        jac, r = vmap(jacrev(_with_aux(f), has_aux=True), in_dims=(None, 0, y_dim))(
            params, inputs, targets
        )
        r = r.reshape(-1)
        return _flatten(jac, program.order, r.numel()), r


class PerSampleForward(JacobianStrategy):
    """``vmap`` over samples of forward-mode ``jacfwd``: cost ∝ parameters."""

    name = "forward"

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        f = _per_sample_fn(program)
        y_dim = 0 if program.targets_batched and targets is not None else None
        jac, r = vmap(jacfwd(_with_aux(f), has_aux=True), in_dims=(None, 0, y_dim))(
            params, inputs, targets
        )
        r = r.reshape(-1)
        return _flatten(jac, program.order, r.numel()), r


class BatchReverse(JacobianStrategy):
    """Reverse mode over the whole slice: one backward per residual, in chunks."""

    name = "batch_reverse"
    per_sample = False

    def __init__(self, chunk_size: int | None = None) -> None:
        self.chunk_size = chunk_size

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        jac, r = jacrev(_with_aux(program.batch), has_aux=True, chunk_size=self.chunk_size)(
            params, inputs, targets
        )
        return _flatten(jac, program.order, r.numel()), r


class BatchForward(JacobianStrategy):
    """Forward mode over the whole slice: one forward pass per parameter."""

    name = "batch_forward"
    per_sample = False

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        jac, r = jacfwd(_with_aux(program.batch), has_aux=True)(params, inputs, targets)
        return _flatten(jac, program.order, r.numel()), r


JACOBIANS = ("auto", "reverse", "forward", "batch_reverse", "batch_forward")


def make_jacobian(name: str, chunk_size: int | None = None) -> JacobianStrategy:
    """Build the strategy called ``name``; ``"auto"`` is resolved by the optimizer."""
    if name == "reverse":
        return PerSampleReverse()
    if name == "forward":
        return PerSampleForward()
    if name == "batch_reverse":
        return BatchReverse(chunk_size)
    if name == "batch_forward":
        return BatchForward()
    raise ValueError(f"Unknown jacobian={name!r}; valid choices are {JACOBIANS}.")
