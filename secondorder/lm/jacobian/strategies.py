"""The five Jacobian strategies and :func:`make_jacobian` (see :mod:`secondorder.lm.jacobian`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.func import jacfwd, jacrev, vmap

from .outer import _fast_rows
from .program import (
    JacobianStrategy,
    Params,
    ResidualProgram,
    _flatten,
    _per_sample_fn,
    _VmapReverse,
    _with_aux,
)


class PerSampleReverse(JacobianStrategy):
    """Per-sample reverse mode: cost ∝ residuals per sample.

    Models made of ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` layers (and
    parameter-free modules) get the outer-product rule; any other model, ``vmap`` over
    ``jacrev``.
    """

    name = "reverse"

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        _per_sample_fn(program)  # refuses a coupled residual before any work
        if program.layers is not None:
            fast = _fast_rows(program, params, inputs, targets)
            if fast is not None:
                return fast
        return _VmapReverse()(program, params, inputs, targets)


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
