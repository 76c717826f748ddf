"""Parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): whole gradients.

Under ``fully_shard`` a parameter and its ``.grad`` are DTensors: each rank holds rows
of the global-batch gradient (FSDP2 reduce-scatters it), while the module's inputs and
output gradients that K-FAC's hooks see are this rank's ordinary tensors, as under DDP.
K-FAC's factor G mixes the rows of a layer's gradient, so a step first gathers every
sharded gradient it preconditions (:func:`gather_grads`, in the same order on every
rank), preconditions whole matrices like any rank under DDP, and writes back only this
rank's rows (:func:`write_grad`, no communication).  The DTensor's own device mesh and
placements say where the rows live: HSDP's ``(Replicate, Shard)`` needs nothing else.
The older ``FullyShardedDataParallel`` wrapper flattens a module's parameters into one
buffer, hiding the weight gradients: :func:`refuse_flat_parameters` says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["gather_grads", "is_sharded", "refuse_flat_parameters", "write_grad"]

try:  # torch >= 2.4; older versions have no DTensor to meet
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    distribute_tensor = None  # type: ignore[assignment]


def is_sharded(t: Tensor | None) -> bool:
    """Whether ``t`` is a DTensor (a ``fully_shard`` parameter or its gradient)."""
    return DTensor is not None and isinstance(t, DTensor)


def gather_grads(params: Iterable[Tensor]) -> dict[Tensor, Tensor]:
    """The whole gradient of every parameter whose ``.grad`` is a DTensor.

    A collective per sharded gradient: every rank calls it with the same parameters in
    the same order (K-FAC's layer order, after the ranks agreed on the step's layers).
    """
    out: dict[Tensor, Tensor] = {}
    for p in params:
        g = p.grad
        if is_sharded(g):
            out[p] = g.full_tensor()  # type: ignore[union-attr]
    return out


def grad_of(p: Tensor, whole: Mapping[Tensor, Tensor]) -> Tensor | None:
    """``p.grad`` as one tensor: from ``whole`` when it is sharded, else as it is."""
    g = p.grad
    if g is None or not is_sharded(g):
        return g
    if p not in whole:
        raise RuntimeError(
            "K-FAC met a sharded gradient that was not gathered; call KFAC.step(), which "
            "gathers them, rather than a layer's grad()."
        )
    return whole[p]


def write_grad(p: Tensor, value: Tensor) -> None:
    """Set ``p.grad`` to ``value`` (whole), keeping only this rank's rows if it is sharded."""
    if p.grad is None:
        p.grad = p.detach().new_empty(p.shape) if not is_sharded(p) else _empty_like(p)
    g: Any = p.grad
    assert g is not None
    if is_sharded(g):
        # the rows this rank holds, cut by the gradient's own mesh and placements
        # (src_data_rank=None: every rank cuts its own copy, nothing is sent)
        local = distribute_tensor(value, g.device_mesh, g.placements, src_data_rank=None)
        g.to_local().copy_(local.to_local())
    else:
        g.copy_(value)


def _empty_like(p: Tensor) -> Tensor:
    import torch

    return torch.empty_like(p.detach())


def refuse_flat_parameters(model: nn.Module) -> None:
    """Raise if ``model`` is or holds the ``FullyShardedDataParallel`` wrapper."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return
    for name, m in model.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            where = "the model" if not name else f"submodule {name!r}"
            raise TypeError(
                f"so.KFAC does not support the FullyShardedDataParallel wrapper ({where} is "
                "one): it flattens each wrapped module's parameters into one buffer, so "
                "K-FAC cannot read a layer's weight gradient. Shard the model with "
                "torch.distributed.fsdp.fully_shard (FSDP2) instead, or use DDP."
            )
