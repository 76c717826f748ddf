"""The blocks of :class:`~secondorder.shampoo.Shampoo` and their stacked state.

Parameters are cut into :class:`Block` s, the blocks a rank owns are grouped by shape
into :class:`Batch` es whose state is stacked, and per-parameter state (torch's schema)
holds views into those stacks, so ``state_dict`` sees every block while each stage
runs as one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from .blocking import BlockSpec, block_slices, merge_dims
from .config import state_dtype
from .distributor import Distributor, block_cost, local_tensor
from .grafting import grafting_has_state
from .groups import block_name
from .preconditioner import mode_product
from .state import check_entry

__all__ = [
    "Batch",
    "Block",
    "Prepared",
    "bind_batch_state",
    "cut_blocks",
    "group_batches",
    "new_batch_state",
    "prepare_batch",
]


@dataclass
class Block:
    """One block of one parameter: where it lies, which rank owns it, its name in errors.

    ``param`` is the parameter (the optimizer state's key); ``data`` the tensor the
    block lies in, the parameter itself or, for a DTensor, this rank's shard;
    ``entry`` prefixes the block's state-dict entries.
    """

    param: Tensor
    group_index: int
    param_index: int
    merged: tuple[int, ...]
    spec: BlockSpec
    gid: int
    owner: int
    name: str
    data: Tensor
    entry: str

    def grad(self) -> Tensor | None:
        """The gradient of :attr:`data` (a DTensor gradient's local shard)."""
        g = self.param.grad
        return None if g is None else local_tensor(g)

    def view(self, t: Tensor) -> Tensor:
        """The block's part of ``t`` (a tensor of :attr:`data`'s shape).

        A view where ``t``'s strides allow it (a contiguous ``t``); a copy otherwise (a
        transposed or ``channels_last`` gradient), so only read through it unless ``t``
        is contiguous.
        """
        whole = t.reshape(self.merged)
        if self.spec.shape == self.merged:  # the block is the parameter: no slicing
            return whole
        return whole[self.spec.slices()]


@dataclass
class Batch:
    """The owned blocks of one shape (one parameter group, dtype and device), stacked."""

    group_index: int
    shape: tuple[int, ...]
    blocks: list[Block]
    state: dict[str, Tensor] = field(default_factory=dict)
    factored: tuple[bool, ...] = ()


@dataclass
class Prepared:
    """One batch's blocks with a gradient: their state (a copy if not all), G and W."""

    blocks: list[Block]
    index: Tensor | None
    state: dict[str, Tensor]
    G: Tensor
    W: Tensor | None


def cut_blocks(param_groups: list[dict[str, Any]], distributor: Distributor) -> list[Block]:
    """Every non-empty (local) parameter's blocks, in group and parameter order, with owners."""
    blocks: list[Block] = []
    for gi, group in enumerate(param_groups):
        mpd = group["max_preconditioner_dim"]
        for pi, p in enumerate(group["params"]):
            data = distributor.local(p)
            if data.numel() == 0:
                continue
            merged = merge_dims(data.shape, mpd)
            name = block_name(param_groups, gi, pi, p)
            for spec in block_slices(merged, mpd):
                entry = distributor.entry(spec.index)
                blocks.append(Block(p, gi, pi, merged, spec, len(blocks), 0, name, data, entry))
    owners = distributor.owners([block_cost(b.spec.shape) for b in blocks])
    for b, r in zip(blocks, owners, strict=True):
        b.owner = r
    return blocks


def group_batches(blocks: list[Block], rank: int) -> list[Batch]:
    """The blocks ``rank`` owns, one batch per (group, block shape, dtype, device)."""
    by_key: dict[tuple[Any, ...], Batch] = {}
    for b in blocks:
        if b.owner != rank:
            continue
        key = (b.group_index, b.spec.shape, b.param.dtype, b.param.device)
        if key not in by_key:
            by_key[key] = Batch(b.group_index, b.spec.shape, [])
        by_key[key].blocks.append(b)
    return list(by_key.values())


def new_batch_state(
    group: dict[str, Any], batch: Batch, state: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Add the zeroed elementwise buffers the group uses to the preconditioner's ``state``."""
    p0 = batch.blocks[0].param
    B = len(batch.blocks)
    filtered = group["betas"][0] != 0.0
    elementwise = (
        ("filtered_grad", filtered, state_dtype(p0.dtype)),
        ("grafting_state", grafting_has_state(group["grafting_config"]), state_dtype(p0.dtype)),
        ("momentum_buffer", group["momentum"] != 0.0, state_dtype(p0.dtype)),
        # SOAP: the filtered gradient in the eigenbasis too (see .update)
        (
            "filtered_grad_eigenbasis",
            filtered and group["preconditioner"] == "eigenvalue_corrected",
            state["factor0"].dtype,
        ),
    )
    for name, wanted, dtype in elementwise:
        if wanted:
            state[name] = torch.zeros(B, *batch.shape, dtype=dtype, device=p0.device)
    return state


def bind_batch_state(batch: Batch, opt_state: Any, required: bool = False) -> None:
    """Copy saved per-parameter entries into ``batch.state``, then point them at it.

    ``opt_state`` is the optimizer's per-parameter state.  A saved entry is checked
    (:func:`.state.check_entry`: shape, dtype, finite, non-negative where the math
    requires) before it is copied; with ``required`` (a loaded checkpoint), every
    block's every entry must be there.
    """
    for i, b in enumerate(batch.blocks):
        pstate = opt_state[b.param]
        derive = False
        for state_key, buf in batch.state.items():
            entry = f"{b.entry}.{state_key}"
            if entry in pstate:
                saved = pstate[entry]
                check_entry(entry, b.name, saved, buf[i])
                buf[i].copy_(saved)
            elif state_key == "filtered_grad_eigenbasis":
                derive = True  # saved before it was kept: rotated from what was saved
            elif required:
                raise ValueError(
                    f"the saved state lacks {entry!r} of {b.name}, which this optimizer "
                    "keeps: the state dict is incomplete or was saved with other settings "
                    "(preconditioner, betas, momentum, grafting_config); nothing was loaded."
                )
            pstate[entry] = buf[i]
        if derive:
            S = batch.state
            basis = [S[f"eigenvectors{k}"][i : i + 1] for k in range(len(batch.shape))]
            X = S["filtered_grad"][i : i + 1].to(S["filtered_grad_eigenbasis"].dtype)
            S["filtered_grad_eigenbasis"][i] = mode_product(X, basis, transpose=True)[0]


def _stacked(parts: list[Tensor], dtype: torch.dtype, copy: bool = False) -> Tensor:
    """``parts`` stacked along a new first dimension, in ``dtype``; a view if it can be."""
    if len(parts) == 1 and not copy:
        return parts[0].unsqueeze(0).to(dtype)
    return torch.stack(parts).to(dtype)


def prepare_batch(group: dict[str, Any], batch: Batch) -> Prepared | None:
    """The stacked gradients (L2 decay added) and state of the blocks with a gradient."""
    active = [i for i, b in enumerate(batch.blocks) if b.param.grad is not None]
    if not active:
        return None
    index = None
    if len(active) == len(batch.blocks):
        S = batch.state
    else:
        index = torch.tensor(active, device=batch.blocks[0].param.device)
        S = {k: v.index_select(0, index) for k, v in batch.state.items()}
    blocks = [batch.blocks[i] for i in active]
    # Half-precision parameters step in float32 (see config.state_dtype).
    dtype = state_dtype(blocks[0].param.dtype)
    wd = float(group["weight_decay"])
    l2 = wd != 0.0 and not group["use_decoupled_weight_decay"]
    # One block: a view of its gradient (nothing below writes into G) unless L2 decay is
    # added to it; several: stacked, which copies.
    G = _stacked([b.view(cast(Tensor, b.grad())) for b in blocks], dtype, copy=l2)
    W = _stacked([b.view(b.data) for b in blocks], dtype) if wd != 0.0 else None
    if W is not None and l2:
        G.add_(W, alpha=wd)
    return Prepared(blocks, index, S, G, W)
