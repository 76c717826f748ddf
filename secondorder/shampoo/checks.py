"""Gradient checks of :class:`~secondorder.shampoo.Shampoo`, run before any state changes.

A non-finite gradient, or a finite one that would overflow the factors or the
grafting state, raises ``FloatingPointError`` naming the parameters.  Both decisions
rest on a few maxima stacked into one tensor and read on the host at once
(:func:`check_step`): a step that passes costs one wait for the device, not two.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .blocks import Batch, Block, Prepared
from .distributor import is_sharded, local_tensor
from .grafting import grafting_rule, update_grafting_out_of_place
from .groups import block_name

__all__ = ["check_gradient_layout", "check_received", "check_step"]

#: ``(group index, parameter index, parameter)`` of each parameter with a gradient.
Grads = list[tuple[int, int, Tensor]]


def check_gradient_layout(param_groups: list[dict[str, Any]]) -> Grads:
    """Refuse sparse gradients and misplaced DTensor ones; the parameters with a gradient.

    A DTensor parameter's gradient must be sharded as the parameter is (as
    ``fully_shard`` leaves it); only this rank's shard is then checked for finite
    values, by :func:`check_step`.  Reads nothing from the device.
    """
    grads = [
        (gi, pi, p)
        for gi, g in enumerate(param_groups)
        for pi, p in enumerate(g["params"])
        if p.grad is not None
    ]
    for gi, pi, p in grads:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError("Shampoo does not support sparse gradients; densify them first")
        if is_sharded(p) and getattr(p.grad, "placements", None) != p.placements:
            raise ValueError(
                f"the gradient of {block_name(param_groups, gi, pi, p)} is placed as "
                f"{getattr(p.grad, 'placements', 'a plain tensor')}, its parameter as "
                f"{p.placements}: Shampoo steps each rank's shard with the same shard of the "
                "averaged gradient, as fully_shard gives it; no state was changed."
            )
    return grads


def _unchanged_in_g(
    param_groups: list[dict[str, Any]], prepared: list[tuple[Batch, Prepared]]
) -> tuple[set[int], list[bool]]:
    """Which gradients the batches' ``G`` already hold whole, and which batches hold them.

    A batch's ``G`` is its blocks' gradients stacked and widened (exactly), unless L2
    decay was added to it.  The ids of the parameters all of whose (local) entries are
    in such batches, and per batch whether it is one: those gradients need no extremes
    of their own, ``G``'s (taken for the overflow bound anyway) decide for them.
    """
    clean = []
    held: dict[int, int] = {}
    for batch, prep in prepared:
        group = param_groups[batch.group_index]
        l2 = float(group["weight_decay"]) != 0.0 and not group["use_decoupled_weight_decay"]
        clean.append(not l2)
        for b in prep.blocks if not l2 else ():
            held[id(b.param)] = held.get(id(b.param), 0) + math.prod(b.spec.shape)
    whole = {
        id(b.param)
        for _, prep in prepared
        for b in prep.blocks
        if held.get(id(b.param)) == b.data.numel()
    }
    return whole, clean


def _gradient_ends(grads: Grads, skip: set[int]) -> list[Tensor]:
    """Each (local) gradient's minimum and maximum: NaN propagates, ±Inf is an extreme.

    One reduction per gradient (but those in ``skip``, by id) instead of ``isfinite``'s
    elementwise passes.
    """
    local = [local_tensor(p.grad) for _, _, p in grads if p.grad is not None and id(p) not in skip]
    return [end for g in local if g.numel() for end in torch.aminmax(g)]


def _refuse_non_finite(param_groups: list[dict[str, Any]], grads: Grads) -> None:
    """Raise naming the parameters whose gradient holds a NaN or an Inf (reads each)."""
    bad = [
        block_name(param_groups, gi, pi, p)
        for gi, pi, p in grads
        if p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all())
    ]
    raise FloatingPointError(
        f"non-finite gradient (NaN or Inf) in {', '.join(bad)}; no state was changed. "
        "Skip this batch, lower the learning rate, or use gradient clipping or loss scaling."
    )


def check_step(
    param_groups: list[dict[str, Any]], grads: Grads, prepared: list[tuple[Batch, Prepared]]
) -> None:
    """Refuse non-finite gradients, then finite ones that would overflow: one host read.

    The maxima of the overflow bound (:func:`_safety_ends`, which open with each
    batch's ``min G`` and ``max G``) and the extremes of the gradients no clean ``G``
    holds whole (:func:`_unchanged_in_g`, :func:`_gradient_ends`) are stacked, in the
    widest of their dtypes (a widening that is exact), and read together.  A
    non-finite gradient is refused first, as if checked alone; the exact float64
    overflow check (:func:`_check_overflow`) runs only for batches the bound does not
    clear.  Nothing changes before either refusal.
    """
    whole, clean = _unchanged_in_g(param_groups, prepared)
    grad_ends = _gradient_ends(grads, whole)
    bound_ends, starts = _safety_ends(prepared)
    ends = grad_ends + bound_ends
    values = torch.stack(ends).tolist() if ends else []
    bound = values[len(grad_ends) :]
    # A clean G (min and max first in its batch's values) is not finite exactly when
    # one of its gradients is not.
    g_ends = [v for at, ok in zip(starts, clean, strict=True) if ok for v in bound[at : at + 2]]
    if not all(math.isfinite(v) for v in values[: len(grad_ends)] + g_ends):
        _refuse_non_finite(param_groups, grads)
    safe = _surely_safe(param_groups, prepared, bound)
    _check_overflow(param_groups, prepared, safe)


#: The second-moment states whose largest entry the overflow bound reads, in order.
_MOMENTS = ("corrected_eigenvalues", "grafting_state")


def _safety_ends(prepared: list[tuple[Batch, Prepared]]) -> tuple[list[Tensor], list[int]]:
    """The maxima :func:`_surely_safe` bounds with, batch after batch.

    Per batch: min G, max G, each factor's largest diagonal entry, then the largest
    entry of each second-moment state (eigenvalue-corrected, grafting).
    """
    ends: list[Tensor] = []
    starts = []  # where each batch's values begin
    for _, prep in prepared:
        S, G = prep.state, prep.G
        starts.append(len(ends))
        ends.extend(torch.aminmax(G))
        for k in range(G.ndim - 1):
            ends.append(S[f"factor{k}"].diagonal(dim1=-2, dim2=-1).amax())
        for key in _MOMENTS:
            if key in S:
                ends.append(S[key].amax())
    return ends, starts


def _surely_safe(
    param_groups: list[dict[str, Any]], prepared: list[tuple[Batch, Prepared]], values: list[float]
) -> list[bool]:
    """Per batch: whether a bound from maxima alone shows that nothing can overflow.

    With ``m = max |G|`` over the batch, a factor's new diagonal is at most
    ``β₂ max diag F + α m² n/d`` (a row of ``G₍ₖ₎`` holds ``n/d`` entries), the
    eigenvalue-corrected second moment at most ``β₂ max E + α m² n`` and the grafting
    state at most ``β max v + w m²``.  ``values``: the :func:`_safety_ends`, read by
    :func:`check_step` with the gradients' extremes; the exact float64 check of every
    entry runs only where this bound does not clear the batch (a NaN or Inf maximum
    never does).
    """
    out, at = [], 0
    for batch, prep in prepared:
        group = param_groups[batch.group_index]
        S, G = prep.state, prep.G
        beta2 = float(group["betas"][1])
        alpha = 1.0 if beta2 == 1.0 else 1.0 - beta2
        n = math.prod(G.shape[1:])
        lo, hi = values[at], values[at + 1]
        # aminmax gives NaN at both ends when G holds one; Python's max would drop it.
        m2 = math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi) ** 2
        at += 1
        fmax = torch.finfo(S["factor0"].dtype).max / 2
        peaks = []
        for k, d in enumerate(batch.shape):
            rows = m2 * (n // d)
            peaks.append(max(beta2 * values[at + 1 + k] + alpha * rows, rows) / fmax)
        j = at + 1 + len(batch.shape)
        if "corrected_eigenvalues" in S:
            peaks.append(max(beta2 * values[j] + alpha * m2 * n, m2 * n) / fmax)
            j += 1
        v = S.get("grafting_state")
        if v is not None:
            rule = grafting_rule(group["grafting_config"])
            decay, weight = (rule.beta2, rule.weight) if rule else (1.0, 1.0)
            vmax = torch.finfo(v.dtype).max / 2
            peaks.append(max(decay * values[j] + weight * m2, m2) / vmax)
            j += 1
        at = j
        out.append(all(math.isfinite(x) and x <= 1.0 for x in peaks))
    return out


def _check_overflow(
    param_groups: list[dict[str, Any]], prepared: list[tuple[Batch, Prepared]], safe: list[bool]
) -> None:
    """Refuse, before any state changes, a finite gradient that would overflow the state.

    Every factor is positive semi-definite, so its largest entry is on the diagonal,
    ``β₂F_ii + α‖G₍ₖ₎ row i‖²``: computed in float64 from the diagonal and the
    gradient, it tells exactly whether ``F`` would overflow without forming it (and
    ``GGᵀ`` before the ``α`` scaling must fit as well).  The
    grafting state is checked entrywise the same way (``g²`` included) and the
    eigenvalue-corrected second moment by ``β₂ max E + α‖G‖²`` (no rotation makes an
    entry larger).  A
    state entry may reach half the dtype's largest value, leaving room for rounding.
    """
    bad_names: list[str] = []
    for (batch, prep), cleared in zip(prepared, safe, strict=True):
        if cleared:
            continue
        group = param_groups[batch.group_index]
        S, G = prep.state, prep.G
        beta2 = float(group["betas"][1])
        alpha = 1.0 if beta2 == 1.0 else 1.0 - beta2
        sq = G.to(torch.float64).square()
        B = sq.shape[0]
        fmax = torch.finfo(S["factor0"].dtype).max / 2
        peaks = []
        for k, d in enumerate(batch.shape):
            rows = sq.movedim(k + 1, 1).reshape(B, d, -1).sum(-1)
            diag = S[f"factor{k}"].diagonal(dim1=-2, dim2=-1).to(torch.float64)
            # baddbmm forms GGᵀ before scaling it by α: that product must fit too.
            peaks.append(torch.maximum(beta2 * diag + alpha * rows, rows).amax(-1) / fmax)
        if "corrected_eigenvalues" in S:
            E = S["corrected_eigenvalues"].reshape(B, -1).amax(-1).to(torch.float64)
            norm2 = sq.reshape(B, -1).sum(-1)
            peaks.append(torch.maximum(beta2 * E + alpha * norm2, norm2) / fmax)
        v = S.get("grafting_state")
        if v is not None:
            new_v = update_grafting_out_of_place(group["grafting_config"], v.to(torch.float64), sq)
            vmax = torch.finfo(v.dtype).max / 2
            peaks.append(torch.maximum(new_v, sq).reshape(B, -1).amax(-1) / vmax)
        # NaN (from inf − inf) compares False: "not <= 1" catches it too.
        over = ~(torch.stack(peaks).amax(0) <= 1.0)
        if bool(over.any()):
            bad_names.extend(
                sorted({prep.blocks[i].name for i in over.nonzero().flatten().tolist()})
            )
    if bad_names:
        raise FloatingPointError(
            f"the gradient of {', '.join(bad_names)} is finite but would overflow "
            "Shampoo's factors or grafting state (an entry above half the largest finite "
            "value of their dtype); no state was changed. Skip this batch, lower the "
            "learning rate, clip or rescale the gradients, or use "
            "factor_dtype=torch.float64."
        )


def check_received(
    flats: list[Tensor], received: dict[int, Tensor], blocks: list[Block], wire: torch.dtype
) -> None:
    """Refuse directions that ``wire`` (the communication dtype) turned into ±Inf.

    A direction entry beyond ``wire``'s range (65504 for float16) arrives as Inf and
    would set the parameter to ±Inf on every rank.  Every rank reads the same gathered
    bytes (``flats``, one per rank), so every rank refuses alike, with no collective.
    Checked only when ``wire`` is narrower than a direction's dtype (else the
    directions travel exactly); ``received`` holds each block's direction by id.
    """
    limit = torch.finfo(wire).max
    if all(torch.finfo(b.param.dtype).max <= limit for b in blocks):
        return
    ends = [end for f in flats if f.numel() for end in torch.aminmax(f)]
    if not ends or bool(torch.isfinite(torch.stack(ends)).all()):
        return
    bad = list(
        dict.fromkeys(b.name for b in blocks if not bool(torch.isfinite(received[b.gid]).all()))
    )
    raise FloatingPointError(
        f"the direction of {', '.join(bad)} has an entry beyond the range of "
        f"communication_dtype={wire} (largest {limit:.6g}), so it arrived as Inf; no rank "
        "changed its parameters or optimizer state. Use communication_dtype=torch.bfloat16 "
        "(float32's range) or None, or lower the gradients' scale."
    )
