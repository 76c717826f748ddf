"""Checks of the batch a step is given, made before anything changes.

:func:`check_step` validates ``step``'s arguments and, with several ranks, makes every
rank raise when any rank's batch is refused (one small all-reduce), so no rank is
left waiting in the next collective.  :func:`check_batch` probes ``residual_fn`` on
one or two samples to learn the residual count and to refuse a wrong dtype or shape
with a message that says how to fix it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from .._validation import check_number
from .model import ModelFunction, batch_size_of, frozen_batch_stats, slice_tree, to_device
from .residuals import ModelResidual, describe

__all__ = ["check_batch", "check_step"]


def check_step(
    function: ModelFunction,
    param_groups: list[dict[str, Any]],
    inputs: Any,
    targets: Any,
    slice_size: int | None,
    *,
    any_device: bool,
) -> tuple[int, int, int, float]:
    """Validate the arguments of a step: (batch, residuals, all ranks' residuals, lr).

    With several ranks, one small all-reduce tells every rank whether any rank's
    batch was rejected, so that all of them raise (the rejecting rank its own
    error) instead of leaving the others waiting in the next collective.  The same
    all-reduce carries each rank's ``lr``: a learning rate changed on one rank only
    would make the ranks' parameters diverge, so every rank raises the same error.
    """
    reducer = function.reducer
    error: Exception | None = None
    batch = m = 0
    lr = 0.0
    try:
        if slice_size is not None and (
            isinstance(slice_size, bool) or not isinstance(slice_size, int) or slice_size < 1
        ):
            raise ValueError(f"Invalid slice_size={slice_size!r}: must be an integer >= 1.")
        # The model first: a changed model would also fail the batch probe, less clearly.
        function.check_unchanged()
        _check_param_groups(function, param_groups)
        batch, m = check_batch(function, inputs, targets, any_device=any_device)
        lr = param_groups[0]["lr"]
        try:
            check_number("lr", lr, above=0)
        except (TypeError, ValueError):
            raise ValueError(
                f"Invalid lr={lr!r} in param_groups[0]: must be a finite number > 0."
            ) from None
        lr = float(lr)
    except Exception as exc:
        if reducer.world_size == 1:
            raise
        error = exc
    if reducer.world_size == 1:
        return batch, m, m, lr
    world = reducer.world_size
    # [failed flag per rank | residual count | lr per rank]; float64 holds a Python
    # float's lr exactly, so equal settings compare equal bit for bit.
    tally = torch.zeros(2 * world + 1, dtype=torch.float64, device=function.group.solver)
    tally[reducer.rank] = 1.0 if error is not None else 0.0
    tally[world] = float(m)
    tally[world + 1 + reducer.rank] = lr
    reducer.sum_([tally])
    if error is not None:
        raise error
    values = tally.tolist()
    failed = [i for i in range(world) if values[i] > 0]
    if failed:
        raise ValueError(
            f"step() rejected the batch on rank(s) {failed} of {world}; see the error "
            "raised there. No rank changed its parameters."
        )
    lrs = values[world + 1 :]
    if any(v != lrs[0] for v in lrs):
        shown = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(lrs))
        raise ValueError(
            f"param_groups[0]['lr'] differs across ranks ({shown}); every rank takes the "
            "same step, so the ranks' parameters would diverge. Set the same lr on every "
            "rank (change it, or step a scheduler, in code that runs on all ranks). No "
            "rank changed its parameters."
        )
    return batch, m, int(values[world]), lr


def _check_param_groups(function: ModelFunction, param_groups: list[dict[str, Any]]) -> None:
    """One group holding the parameters the optimizer was built on (x's layout)."""
    if len(param_groups) != 1 or [id(p) for p in param_groups[0].get("params", [])] != [
        id(p) for p in function.params
    ]:
        raise RuntimeError(
            f"param_groups was changed after the optimizer was built ({len(param_groups)} "
            "group(s)); LevenbergMarquardt optimizes one flat vector of the model's "
            "parameters, in one group: build a new optimizer instead of editing param_groups."
        )


def _check_tensors(tree: Any, name: str) -> None:
    """Refuse arrays and other non-tensors with their type and shape, never their values."""
    leaves, _ = tree_flatten(tree)
    for leaf in leaves:
        if not isinstance(leaf, Tensor) and hasattr(leaf, "__array__"):
            dtype = getattr(torch, str(getattr(leaf, "dtype", "")), None)
            cast = f", dtype={dtype}" if isinstance(dtype, torch.dtype) else ""
            raise TypeError(
                f"{name} must be torch tensors, got a {describe(leaf)}; convert it with "
                f"torch.as_tensor({name}{cast}) (in the model's dtype, on its device)"
            )
    if not any(isinstance(leaf, Tensor) for leaf in leaves):
        raise TypeError(
            f"{name} must be a tensor or a tuple/list/dict of tensors, got {describe(tree)}"
        )


def _check_leaves(inputs: Any, targets: Any, p0: Tensor, any_device: bool) -> None:
    """Inputs in the parameters' dtype, and on their device unless devices were given."""
    for leaf in tree_flatten(inputs)[0]:
        if isinstance(leaf, Tensor):
            if leaf.is_floating_point() and leaf.dtype != p0.dtype:
                raise TypeError(
                    f"inputs dtype {leaf.dtype} does not match the model's parameter dtype "
                    f"{p0.dtype}; convert one of them"
                )
            if leaf.device != p0.device and not any_device:
                raise ValueError(f"inputs are on {leaf.device} but the model is on {p0.device}")
    for leaf in tree_flatten(targets)[0]:
        if isinstance(leaf, Tensor) and leaf.device != p0.device:
            raise ValueError(f"targets are on {leaf.device} but the model is on {p0.device}")


def check_batch(
    function: ModelFunction, inputs: Any, targets: Any, *, any_device: bool
) -> tuple[int, int]:
    """Check the batch before anything changes; return (batch size, residual count)."""
    coupled = function.coupled_residual
    _check_tensors(inputs, "inputs")
    if targets is not None:
        _check_tensors(targets, "targets")
    batch = batch_size_of(inputs, "inputs")
    if batch == 0:
        raise ValueError("inputs is an empty batch (batch size 0)")
    if targets is not None:
        tb = batch_size_of(targets, "targets")
        if tb != batch and not coupled:
            raise ValueError(
                f"inputs and targets batch sizes differ: inputs has {batch}, targets has {tb}"
            )
    p0 = function.params[0]
    _check_leaves(inputs, targets, p0, any_device)
    probe = batch if coupled else min(batch, 2)
    sub_in = slice_tree(inputs, 0, probe)
    sub_t = None if targets is None else slice_tree(targets, 0, probe)
    if coupled:
        sub_t = targets
    if any_device:
        sub_in, sub_t = to_device((sub_in, sub_t), p0.device)
    params = {k: p.detach() for k, p in zip(function.names, function.params, strict=True)}
    with torch.no_grad(), frozen_batch_stats(function.model):
        if coupled:
            out = function.home.batch(params, sub_in, sub_t)
        else:
            residual_fn = function.residual_fn
            assert not isinstance(residual_fn, ModelResidual)
            out = residual_fn(function.home.call(params, sub_in), sub_t)
    if not isinstance(out, Tensor):
        raise TypeError(f"residual_fn must return a tensor, got {type(out).__name__}")
    if not out.is_floating_point():
        raise TypeError(f"residual_fn must return a floating tensor, got dtype {out.dtype}")
    if out.dtype != p0.dtype:
        # Refused rather than cast: a cast would hide a float32 residual's rounding from
        # a float64 model, and J, Jᵀr and the model's parameters share one dtype.
        raise TypeError(
            f"residual_fn returned residuals of dtype {out.dtype} but the model's "
            f"parameters are {p0.dtype}; return them in the model's dtype "
            f"(e.g. end residual_fn with .to({p0.dtype}))"
        )
    if coupled:
        if out.numel() == 0:
            raise ValueError("residual_fn returned no residuals")
        return batch, out.numel()
    if out.ndim == 0:
        raise ValueError(
            f"residual_fn returned a scalar (a 0-d tensor) for a batch of {probe}: "
            "LevenbergMarquardt needs the residuals, one row per sample, whose squares sum "
            "to the loss, not the loss itself; use one of secondorder.residuals (mse, "
            "cross_entropy, ...) or a torch loss module such as torch.nn.MSELoss()"
        )
    if out.shape[0] != probe:
        raise ValueError(
            f"residual_fn must return residuals whose first dimension is the batch "
            f"({probe} for this probe), got shape {tuple(out.shape)}"
        )
    per_sample = out.numel() // probe
    if per_sample == 0:
        raise ValueError("residual_fn returned no residuals")
    return batch, per_sample * batch
