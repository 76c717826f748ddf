"""The residual program a Jacobian strategy differentiates, and the strategy interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jacrev, vmap
from torch.utils._pytree import tree_flatten

from ..carry import ForwardCarry
from ..layers import TrainableLayer
from ..memory import BufferPool
from .factors import RowProducts

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
        layers: the model's ``nn.Linear``/``nn.Conv1d``/``nn.Conv2d`` layers when they
            hold every trainable parameter (:func:`linear_layers`), which ``"reverse"``
            then differentiates by the outer-product rule; ``None`` otherwise.
        verified: per input signature, whether the outer-product rule matched
            ``vmap`` on the first slice of that signature (filled in by the strategy).
        random_modules: the model's dropout modules; the outer-product rule refuses a
            forward pass that calls one in training mode (as ``vmap`` does), through
            hooks on these modules only (a global module hook would make
            ``torch.compile`` of the user's model warn and fall back).
        checked: per strategy and input signature, whether :class:`CheckedStrategy`
            has checked a forced strategy on this program (the probe's size).
        rows_pool: the buffer the outer-product rule writes J's rows into, reused
            from step to step while nothing else holds it (:class:`BufferPool`).
        row_products: ``Jᵀr`` and ``diag(JᵀJ)`` of the rule's last rows, from the
            layers' factors (:class:`RowProducts`).
        forward, residual: ``batch`` in two parts, ``residual(forward(params, X), Y)``
            (``None`` where the residual function needs the model itself).
        carry: the last trial's forward pass for the next linearisation
            (:class:`~secondorder.lm.carry.ForwardCarry`; ``None``: never kept).
    """

    per_sample: Callable[[Params, Any, Any], Tensor] | None
    batch: Callable[[Params, Any, Any], Tensor]
    order: tuple[str, ...]
    targets_batched: bool = True
    layers: tuple[TrainableLayer, ...] | None = None
    verified: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)
    random_modules: tuple[nn.Module, ...] = ()
    checked: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    rows_pool: BufferPool = field(default_factory=BufferPool, compare=False, repr=False)
    row_products: RowProducts = field(default_factory=RowProducts, compare=False, repr=False)
    forward: Callable[[Params, Any], Tensor] | None = None
    residual: Callable[[Tensor, Any], Tensor] | None = None
    carry: ForwardCarry | None = field(default=None, compare=False, repr=False)


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


class _UnsupportedError(Exception):
    """The outer-product rule does not apply to this model or batch."""


def _leading(tree: Any) -> int:
    sizes = {int(t.shape[0]) for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.ndim}
    if len(sizes) != 1:
        raise _UnsupportedError
    return sizes.pop()


def _signature(inputs: Any, targets: Any) -> str:
    leaves = tree_flatten((inputs, targets))[0]
    return "|".join(
        f"{tuple(t.shape[1:])}{t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        for t in leaves
    )


class _VmapReverse(JacobianStrategy):
    """``vmap`` over samples of ``jacrev``, for any per-sample residual."""

    name = "reverse"

    def __call__(
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        f = _per_sample_fn(program)
        y_dim = 0 if program.targets_batched and targets is not None else None
        jac, r = vmap(jacrev(_with_aux(f), has_aux=True), in_dims=(None, 0, y_dim))(
            params, inputs, targets
        )
        r = r.reshape(-1)
        return _flatten(jac, program.order, r.numel()), r
