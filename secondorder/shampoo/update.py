"""One batch's Shampoo step, computed into new tensors that :func:`commit` puts in place.

A step is a transaction: :func:`compute_update` reads the batch's stacked state and
writes only new tensors (the factors, grafting state, filtered gradient, momentum,
the roots when they are refreshed, the failure counters), and the parameters' new
values are formed beside them.  Nothing the user can see changes until
:func:`commit` points the state at the new tensors (no copy) and copies the new
values into the parameters; whatever interrupts it, a Ctrl-C included, puts the old
references and values back.  An error or an interrupt before that, on any rank,
leaves parameters and state as they were.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .blocks import Batch, Block, Prepared
from .config import resolved_start
from .grafting import grafting_direction, updated_grafting
from .preconditioner import Preconditioner
from .root_inverse import finite_per_matrix

__all__ = ["BatchUpdate", "commit", "compute_update", "refreshes_roots"]


@dataclass
class BatchUpdate:
    """One batch's step: its new stacked state by key, directions, deferred warnings."""

    batch: Batch
    state: dict[str, Tensor] = field(default_factory=dict)
    directions: dict[int, Tensor] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def refreshes_roots(group: dict[str, Any], t: int) -> bool:
    """Whether step ``t`` recomputes the group's roots (or eigenbases)."""
    start, freq = resolved_start(group), group["precondition_frequency"]
    return (t % freq == 0 and t > start) or t == start


def compute_update(
    pre: Preconditioner, group: dict[str, Any], batch: Batch, prep: Prepared, t: int
) -> BatchUpdate:
    """The batch's new state and its blocks' directions ``P``; no state is changed."""
    blocks, G, W = prep.blocks, prep.G, prep.W
    amortize = refreshes_roots(group, t)
    # Every stage puts new tensors into S and changes none of the old in place.
    S = dict(prep.state)
    wd = float(group["weight_decay"])
    beta1 = float(group["betas"][0])
    grafting = group["grafting_config"]
    fdtype = S["factor0"].dtype
    Gf = G.to(fdtype)
    pre.update_factors(S, Gf)
    if "grafting_state" in S:
        S["grafting_state"] = updated_grafting(grafting, S["grafting_state"], G)
    warned: list[str] = []
    if amortize:
        warned = _amortize(pre, S, t, blocks, group)
    rotated_G = pre.after_amortize(S, Gf, t)
    rotated_M = None  # M in SOAP's eigenbasis, where it comes without a rotation
    bc1 = 1.0 - beta1**t if group["use_bias_correction"] else 1.0
    if beta1 != 0.0:
        S["filtered_grad"] = torch.lerp(S["filtered_grad"], G, 1.0 - beta1)
        M = S["filtered_grad"] if bc1 == 1.0 else S["filtered_grad"] / bc1
        if "filtered_grad_eigenbasis" in S:
            # Rotation is linear: between refreshes the rotated filter follows the
            # rotated gradient, which the second moment needed anyway.
            old = S["filtered_grad_eigenbasis"]
            if amortize or rotated_G is None:
                R = pre.rotate(S, S["filtered_grad"].to(fdtype))
            else:
                R = torch.lerp(old, rotated_G, 1.0 - beta1)
            S["filtered_grad_eigenbasis"] = R
            rotated_M = R if bc1 == 1.0 else R / bc1
    else:
        M, rotated_M = G, rotated_G
    start = resolved_start(group)
    if t < start and grafting is not None:
        P = grafting_direction(grafting, S.get("grafting_state"), M, t)
    else:
        P = pre.precondition(S, M.to(fdtype), t, rotated_M).to(G.dtype)
        if grafting is not None:
            dims = tuple(range(1, P.ndim))
            graft = grafting_direction(grafting, S.get("grafting_state"), M, t)
            scale = torch.linalg.vector_norm(graft, dim=dims) / (
                torch.linalg.vector_norm(P, dim=dims) + 1e-16
            )
            P = P * scale.view(-1, *([1] * len(dims)))
    if P is M or P is G or P is S.get("filtered_grad") or P is prep.state.get("filtered_grad"):
        P = P.clone()
    if W is not None and group["use_decoupled_weight_decay"]:
        P.add_(W, alpha=wd)
    if "momentum_buffer" in S:
        mom, damp = float(group["momentum"]), float(group["dampening"])
        buf = S["momentum_buffer"].mul(mom).add_(P, alpha=1.0 - damp)
        S["momentum_buffer"] = buf
        if group["use_nesterov"]:
            P.mul_(1.0 - damp).add_(buf, alpha=mom)
        else:
            P = buf  # not changed after: the commit copies it, the direction reads it
    half = P.to(blocks[0].param.dtype)  # a no-op unless the parameters are half precision
    if half is not P:
        fits = finite_per_matrix(half.reshape(len(blocks), 1, -1))
        if not bool(fits.all()):
            # float16 holds up to 65504: a larger entry would set the parameter to ±Inf.
            bad = dict.fromkeys(blocks[i].name for i in (~fits).nonzero().flatten().tolist())
            raise FloatingPointError(
                f"the direction of {', '.join(bad)} has an entry beyond the range of its "
                f"dtype {half.dtype} (largest {torch.finfo(half.dtype).max:.6g}); no state "
                "was changed. Use AdamGraftingConfig (directions of order 1), lower the "
                "gradients' scale, or keep the parameters in bfloat16 or float32."
            )
    P = half
    update = BatchUpdate(batch, warnings=warned)
    for k, new in S.items():
        if new is prep.state[k]:
            continue
        old = batch.state[k]
        if prep.index is not None:
            new = old.index_copy(0, prep.index, new.to(old.dtype))
        # The state keeps its dtype and a contiguous layout (eigh's eigenvectors are not).
        update.state[k] = new.to(old.dtype).contiguous()
    for i, b in enumerate(blocks):
        update.directions[b.gid] = P[i]
    return update


def _amortize(
    pre: Preconditioner, S: dict[str, Tensor], t: int, blocks: list[Block], group: dict[str, Any]
) -> list[str]:
    """Refresh the roots in ``S``; count failures; raise past the tolerated number.

    Returns the warnings for tolerated failures, which :func:`commit` issues once the
    step is taken (a step refused later changes nothing, so it warns of nothing).
    """
    failed = pre.amortize(S, t)
    failed_blocks = sorted({i for i, _ in failed})
    mask = torch.zeros_like(S["failed_amortized_computations"])
    mask[failed_blocks] = 1
    counter = (S["failed_amortized_computations"] + mask) * mask
    S["failed_amortized_computations"] = counter
    tolerated = group["num_tolerated_failed_amortized_computations"]
    messages = []
    for i in failed_blocks:
        b = blocks[i]
        factors = [k for j, k in failed if j == i]
        count = int(counter[i])
        if count > tolerated:
            raise RuntimeError(
                f"the root computation of block {b.spec.index} (factors {factors}) of "
                f"{b.name} failed {count} times in a row, more than "
                f"num_tolerated_failed_amortized_computations={tolerated}; no state was "
                "changed. Check the gradients, raise epsilon, or use "
                "factor_dtype=torch.float64."
            )
        messages.append(
            f"Shampoo: the root computation of block {b.spec.index} (factors {factors}) "
            f"of {b.name} failed at step {t} ({pre.method(S['factor0'].dtype)}); keeping "
            f"its previous root ({count} failure(s) in a row, {tolerated} tolerated)."
        )
    return messages


def new_parameter_values(
    blocks: Sequence[Block], directions: dict[int, Tensor], lrs: Sequence[float]
) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, W − lr·P)`` for every parameter with a block in ``blocks``.

    The new values are formed in a contiguous copy of each parameter, so a transposed
    or ``channels_last`` parameter is updated like a contiguous one; ``lrs`` holds
    each parameter group's learning rate.
    """
    fresh: dict[int, tuple[Tensor, Tensor]] = {}
    for b in blocks:
        key = id(b.data)
        if key not in fresh:
            fresh[key] = (b.data, b.data.detach().clone(memory_format=torch.contiguous_format))
        b.view(fresh[key][1]).add_(directions[b.gid], alpha=-lrs[b.group_index])
    return list(fresh.values())


_ABSENT = object()  # an entry the per-parameter state did not hold before the commit


def commit(
    opt_state: Any,
    updates: Sequence[BatchUpdate],
    params: Sequence[tuple[Tensor, Tensor]],
    steps: Sequence[tuple[Tensor, int]],
) -> None:
    """Put the step in place: all of it, or (on any exception or interrupt) none of it.

    Each batch's stacked state and its blocks' per-parameter entries (``opt_state``,
    views into the stack) are pointed at the new tensors, every ``step`` count (keyed
    by parameter in ``steps``) at a new one, and each parameter gets its new value by
    ``copy_`` (its storage is kept: views and sharded wrappers see it).  The old
    references and a copy of each overwritten parameter are kept until the end and
    put back if anything is raised, a ``KeyboardInterrupt`` between two copies included.
    """
    rebound: list[tuple[dict[Any, Any], Any, Any]] = []  # (mapping, key, old value)
    overwritten: list[tuple[Tensor, Tensor]] = []
    try:
        for u in updates:
            for k, new in u.state.items():
                rebound.append((u.batch.state, k, u.batch.state[k]))
                u.batch.state[k] = new
                for b, row in zip(u.batch.blocks, new.unbind(0), strict=True):
                    pstate, entry = opt_state[b.param], f"{b.entry}.{k}"
                    rebound.append((pstate, entry, pstate.get(entry, _ABSENT)))
                    pstate[entry] = row
        for p, t in steps:
            pstate = opt_state[p]
            rebound.append((pstate, "step", pstate["step"]))
            pstate["step"] = torch.tensor(t, dtype=torch.int64, device="cpu")
        for dest, value in params:
            overwritten.append((dest, dest.clone()))
            dest.copy_(value)
    except BaseException:
        for dest, old in reversed(overwritten):
            dest.copy_(old)
        for mapping, key, old in reversed(rebound):
            if old is _ABSENT:
                mapping.pop(key, None)
            else:
                mapping[key] = old
        raise
    for u in updates:
        for message in u.warnings:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
