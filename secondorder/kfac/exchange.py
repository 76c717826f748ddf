"""How one K-FAC step's decompositions and preconditioned gradients reach the ranks.

Both are broadcasts along :class:`~secondorder.kfac.assignment.WorkAssignment`'s
groups, into new tensors (the step commits them only once every rank agreed).  Every
rank takes part in every broadcast even when its own part of the step failed: it sends
a placeholder, and the agreement that follows refuses the step on every rank.  So a
rank never leaves its peers waiting in a broadcast it skipped.  The buffers a rank
receives into are allocated by :func:`receive_buffers` before the step's first
agreement, so that an allocation failing (out of memory, an interrupt) is refused by
every rank there rather than stranding the others in a broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .parts import KFACParts

__all__ = ["Received", "receive_buffers", "share_inverses", "share_preconditioned"]


@dataclass
class Received:
    """The buffers one step receives into: decompositions and preconditioned gradients."""

    #: layer → its decomposition's tensors, for the layers decomposed by another rank
    #: of this rank's worker group (when the step decomposes).
    inverses: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    #: layer → its preconditioned gradient, for the layers of another worker group.
    preconditioned: dict[str, Tensor] = field(default_factory=dict)


def _grad_dtype(kfac: KFACParts, name: str) -> torch.dtype:
    weight = kfac.layers[name].module.weight
    assert isinstance(weight, Tensor)
    return weight.grad.dtype if weight.grad is not None else weight.dtype


def _empty_grad(kfac: KFACParts, name: str) -> Tensor:
    layer = kfac.layers[name]
    return torch.empty(layer.grad_shape(), dtype=_grad_dtype(kfac, name), device=layer.device)


def receive_buffers(kfac: KFACParts, present: Sequence[str], invert: bool, uses: int) -> Received:
    """Allocate what this rank receives in a step over the layers ``present``."""
    cfg = kfac.config
    asg, rank = kfac.assignment, kfac.reducer.rank
    k = asg.grad_workers
    out = Received()
    if invert and k > 1:
        for name, layer in kfac.layers.items():
            src = asg.inverse_worker[name]
            if src != rank and src // k == rank // k:
                out.inverses[name] = layer.empty_inverse(cfg.compute_method, cfg.inv_dtype, uses)
    if asg.world_size // k > 1:
        for name in present:
            if not asg.is_grad_worker(name, rank):
                out.preconditioned[name] = _empty_grad(kfac, name)
    return out


def share_inverses(
    kfac: KFACParts, inv: dict[str, dict[str, Tensor]], received: Received, uses: int
) -> None:
    """Broadcast each decomposition inside its worker group (into ``received``'s buffers).

    ``inv`` holds this rank's own decompositions and gains the received ones; a layer
    of this rank missing from it (its decomposition failed) is sent as a placeholder.
    """
    cfg = kfac.config
    asg, rank = kfac.assignment, kfac.reducer.rank
    k = asg.grad_workers
    block = rank // k
    for src in range(k):
        bufs: list[Tensor] = []
        for name, layer in kfac.layers.items():
            if asg.inverse_worker[name] != block * k + src:
                continue
            if name not in inv:
                inv[name] = received.inverses.get(name) or layer.empty_inverse(
                    cfg.compute_method, cfg.inv_dtype, uses
                )
            bufs += [inv[name][key] for key in sorted(inv[name])]
        if bufs:
            kfac._workers.broadcast_from_(bufs, src)


def share_preconditioned(
    kfac: KFACParts, out: dict[str, Tensor], present: Sequence[str], received: Received
) -> tuple[dict[str, Tensor], BaseException | None]:
    """Every present layer's preconditioned gradient, broadcast from its worker group.

    ``out`` holds this rank's own results (missing ones, after a failure, are sent as
    placeholders).  Returns the gradients and the error of this rank's local part, if
    any: the broadcasts happen either way.
    """
    asg = kfac.assignment
    blocks = asg.world_size // asg.grad_workers
    if blocks == 1:
        return out, None
    error: BaseException | None = None
    rank = kfac.reducer.rank
    for b in range(blocks):
        bufs = []
        for name in present:
            if asg.block(name) != b:
                continue
            if not asg.is_grad_worker(name, rank):
                out[name] = received.preconditioned[name]
            else:
                try:
                    # a layer's result may be a padded view; collectives want it dense
                    out[name] = out[name].contiguous() if name in out else _empty_grad(kfac, name)
                except BaseException as exc:
                    error = error or exc
                    out[name] = _empty_grad(kfac, name)  # a placeholder, refused below
            bufs.append(out[name])
        if bufs:
            kfac._receivers.broadcast_from_(bufs, b)
    return {name: out[name] for name in present}, error
