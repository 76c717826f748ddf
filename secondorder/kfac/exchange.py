"""How one K-FAC step's decompositions and preconditioned gradients reach the ranks.

Both are broadcasts along :class:`~secondorder.kfac.assignment.WorkAssignment`'s
groups, into new tensors (the step commits them only once every rank agreed).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .parts import KFACParts

__all__ = ["share_inverses", "share_preconditioned"]


def share_inverses(kfac: KFACParts, inv: dict[str, dict[str, Tensor]], uses: int) -> None:
    """Broadcast each decomposition inside its worker group (into new tensors)."""
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
                inv[name] = layer.empty_inverse(cfg.compute_method, cfg.inv_dtype, uses)
            bufs += [inv[name][key] for key in sorted(inv[name])]
        if bufs:
            kfac._workers.broadcast_from_(bufs, src)


def share_preconditioned(
    kfac: KFACParts, out: dict[str, Tensor], grads: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Every layer's preconditioned gradient, broadcast from its worker group."""
    asg = kfac.assignment
    blocks = asg.world_size // asg.grad_workers
    if blocks == 1:
        return out
    for b in range(blocks):
        bufs = []
        for name, g in grads.items():
            if asg.block(name) == b:
                # a layer's result may be a padded view; collectives want it dense
                out[name] = out[name].contiguous() if name in out else torch.empty_like(g)
                bufs.append(out[name])
        if bufs:
            kfac._receivers.broadcast_from_(bufs, b)
    return {name: out[name] for name in grads}
