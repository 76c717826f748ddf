"""Recording the layers' calls of a forward pass.

The outer-product rule's inputs, and a trial's pass kept for the next linearisation
(:class:`~secondorder.lm.carry.ForwardCarry`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .. import conv_rows
from ..layers import TrainableLayer
from .program import Params, ResidualProgram, _UnsupportedError

_Call = tuple[TrainableLayer, Tensor, Tensor]


@contextlib.contextmanager
def _recording(program: ResidualProgram) -> Iterator[list[_Call]]:
    """Hooks on the program's layers for one forward pass: each call's (layer, input, output)."""
    assert program.layers is not None
    layer_of = {id(layer.module): layer for layer in program.layers}
    calls: list[_Call] = []

    def record(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if len(args) != 1 or not isinstance(args[0], Tensor) or not isinstance(out, Tensor):
            raise _UnsupportedError
        calls.append((layer_of[id(module)], args[0], out))

    def refuse_randomness(module: nn.Module, args: Any) -> None:
        # vmap refuses random modules; so does this rule, and vmap then says why.
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p:
            raise _UnsupportedError

    handles = [layer.module.register_forward_hook(record) for layer in program.layers]
    handles += [m.register_forward_pre_hook(refuse_randomness) for m in program.random_modules]
    try:
        with torch.enable_grad():
            yield calls
    finally:
        for h in handles:
            h.remove()


def _record_calls(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any
) -> tuple[list[_Call], Tensor, Params]:
    """One forward pass of the slice: each layer call's (layer, input, output), r, leaves.

    The pass the last accepted trial recorded (:func:`record_trial`) stands in for
    a new one where :meth:`ForwardCarry.take` finds it still valid.
    """
    carry = program.carry
    kept = None if carry is None else carry.take(params, inputs)
    if kept is not None:
        assert program.residual is not None
        with torch.enable_grad():
            return kept.calls, program.residual(kept.out, targets), kept.leaves
    with _recording(program) as calls:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        r = program.batch(leaves, inputs, targets)
    return calls, r, leaves


def record_trial(
    program: ResidualProgram, params: Params, inputs: Any, targets: Any, point: Tensor
) -> Tensor:
    """The residuals at a trial point, its forward pass kept for the next linearisation.

    ``params``: the flat trial ``point`` unflattened.

    The pass is recorded as :func:`_record_calls` records one (hooks on the layers,
    autograd on) and kept by ``program.carry`` (:class:`ForwardCarry`) with what it
    depends on; the residuals are the same numbers ``program.batch`` gives, the
    residual function run without autograd as in any trial.  Where the
    model's state cannot be compared (:func:`~secondorder.lm.carry.model_state`) or
    the rule does not apply, the point is evaluated plainly and nothing is kept.
    """
    carry, forward, residual = program.carry, program.forward, program.residual
    state = None if carry is None else carry.state()
    if carry is None or forward is None or residual is None or state is None:
        with torch.no_grad():
            return program.batch(params, inputs, targets)
    try:
        with _recording(program) as calls:
            # Copies: the graph must not see the caller's buffer for the point change.
            leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
            out = forward(leaves, inputs)
    except _UnsupportedError:
        with torch.no_grad():
            return program.batch(params, inputs, targets)
    version = out._version
    with torch.no_grad():
        # As for any trial: the residual function runs without autograd (the
        # linearisation applies it again, to the kept output, with autograd).
        r = residual(out, targets)
    if out._version == version:
        carry.keep(point, leaves, inputs, state, calls, out)
    else:  # the residual function wrote into the model's output: keep nothing
        carry.discard()
    return r


def _layer_outputs(calls: list[_Call], batch: int) -> list[Tensor]:
    """The calls' outputs; refuse a call whose shapes are not ``z = a Wᵀ (+ b)``."""
    outs = []
    for layer, a, z in calls:
        w = layer.module.weight
        if conv_rows.is_conv(layer.module):
            if not conv_rows.check_call(layer.module, a, z, batch):
                raise _UnsupportedError
        elif (
            a.shape[0] != batch
            or z.shape[:-1] != a.shape[:-1]
            or w.shape
            != (
                z.shape[-1],
                a.shape[-1],
            )
        ):
            raise _UnsupportedError
        outs.append(z)
    return outs
