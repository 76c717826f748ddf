"""Checks of the batch a step is given, made before anything changes.

:func:`check_step` validates ``step``'s arguments and, with several ranks, makes every
rank raise when any rank's batch is refused (one small all-reduce), so no rank is
left waiting in the next collective.  :func:`check_batch` probes ``residual_fn`` on
one or two samples to learn the residual count and to refuse a wrong dtype or shape
with a message that says how to fix it.

The probe is a forward pass of the model on a sample or two, and its verdict depends
on the batch's shapes, not its values:
:class:`ProbeCache` keeps it per :func:`batch_signature` (the tree, type, shape,
dtype and device of every input and target, the values of non-tensor leaves, and the
model's modules with their training flags), so a stream of batches of one shape is
probed once.  A step served from the cache checks instead,
as each slice is computed, that the residuals still have the probed count and dtype
(:class:`RowsCheck`): a ``residual_fn`` whose output changes for batches of the same
shapes is refused there, before anything is changed.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from .._validation import check_number
from .jacobian import JacobianStrategy, Params, ResidualProgram
from .model import ModelFunction, batch_size_of, frozen_batch_stats, slice_tree, to_device
from .residuals import ModelResidual, describe

__all__ = [
    "ProbeCache",
    "RowsCheck",
    "StepCheck",
    "batch_signature",
    "check_batch",
    "check_step",
]

#: Batch signatures whose probe verdict a :class:`ProbeCache` keeps: the usual batch,
#: an epoch's shorter last one and a few more (a validation batch, a second loader).
PROBE_CACHE_SIZE = 8


def batch_signature(model: nn.Module, inputs: Any, targets: Any) -> tuple[Hashable, ...] | None:
    """What :func:`check_batch`'s verdict depends on besides the values; None: no key.

    The tree structure of inputs and targets, each tensor leaf's type, shape, dtype,
    device and layout, each other leaf's type and value (an int flag a model reads
    may change its output), and the model's modules (by identity) with their
    training flags.  A leaf that cannot be hashed (an array, a list-like object)
    gives no key: such a batch is probed every time.
    """
    parts: list[Hashable] = []
    for tree in (inputs, targets):
        leaves, spec = tree_flatten(tree)
        parts.append(spec)
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                parts.append((type(leaf), leaf.shape, leaf.dtype, leaf.device, leaf.layout))
                continue
            try:
                hash(leaf)
            except TypeError:
                return None
            parts.append((type(leaf), leaf))
    parts.append(tuple((m, m.training) for m in model.modules()))
    return tuple(parts)


class ProbeCache:
    """The ``(batch size, residual count)`` :func:`check_batch` found, per batch signature.

    Keeps the :data:`PROBE_CACHE_SIZE` most recently stored signatures.  A verdict
    is stored only after every check passed, so a refused batch is refused again.
    """

    def __init__(self, size: int = PROBE_CACHE_SIZE) -> None:
        self.size = size
        self._verdicts: dict[tuple[Hashable, ...], tuple[int, int]] = {}
        #: How many :meth:`get` calls were answered (for tests and benchmarks).
        self.hits = 0

    def get(self, key: tuple[Hashable, ...] | None) -> tuple[int, int] | None:
        """The stored verdict of ``key``, or None."""
        if key is None:
            return None
        try:
            verdict = self._verdicts.get(key)
        except TypeError:
            # A leaf whose __eq__ cannot compare with the stored one: no answer.
            return None
        if verdict is not None:
            self.hits += 1
        return verdict

    def __contains__(self, key: object) -> bool:
        """Whether a batch of signature ``key`` would be answered (not counted as a hit)."""
        try:
            return key is not None and key in self._verdicts
        except TypeError:
            return False

    def put(self, key: tuple[Hashable, ...] | None, verdict: tuple[int, int]) -> None:
        """Store ``verdict`` under ``key`` (nothing for None), dropping the oldest if full."""
        if key is None:
            return
        self._verdicts.pop(key, None)
        self._verdicts[key] = verdict
        while len(self._verdicts) > self.size:
            del self._verdicts[next(iter(self._verdicts))]

    def clear(self) -> None:
        """Forget every verdict: the next batch of each signature is probed."""
        self._verdicts.clear()


class StepCheck(NamedTuple):
    """What :func:`check_step` found out about a step's arguments."""

    batch: int
    rows: int
    rows_total: int
    lr: float
    #: Whether ``residual_fn`` was probed on this batch (False: the verdict was cached).
    probed: bool


class RowsCheck(JacobianStrategy):
    """A strategy whose slices must have the residual count and dtype of a cached probe.

    Used for a step whose batch was not probed (:class:`ProbeCache` answered): each
    slice's residuals are compared, as they are computed, with the count and dtype
    the probe of an earlier batch of the same signature found, and a difference
    raises during the linearisation, so the step changes nothing.  Reads only
    shapes and dtypes: no host synchronisation.
    """

    def __init__(self, inner: JacobianStrategy, batch: int, rows: int, dtype: torch.dtype) -> None:
        self.inner = inner
        self.name = inner.name
        self.per_sample = inner.per_sample
        self.batch = batch
        self.rows = rows
        self.dtype = dtype

    def __call__(  # noqa: D102
        self, program: ResidualProgram, params: Params, inputs: Any, targets: Any
    ) -> tuple[Tensor, Tensor]:
        jac, r = self.inner(program, params, inputs, targets)
        samples = batch_size_of(inputs, "inputs")
        # A slice of the batch has its share of the rows; the whole batch (always, for
        # residuals that couple samples) has the probed count.
        expected = self.rows if samples == self.batch else samples * (self.rows // self.batch)
        if r.dtype != self.dtype:
            raise TypeError(_dtype_message(r.dtype, self.dtype))
        if r.numel() != expected:
            raise ValueError(
                f"residual_fn returned {r.numel()} residuals for {samples} samples, but "
                f"{expected} for an earlier batch with the same shapes, dtypes and devices: "
                "the number of residuals must depend only on the shapes of inputs and "
                "targets, not on their values or on earlier calls. Make residual_fn "
                "return the same shape for every batch of one shape (e.g. mask with zeros "
                "instead of dropping entries). Nothing was changed."
            )
        return jac, r


def _dtype_message(got: torch.dtype, want: torch.dtype) -> str:
    # Refused rather than cast: a cast would hide a float32 residual's rounding from
    # a float64 model, and J, Jᵀr and the model's parameters share one dtype.
    return (
        f"residual_fn returned residuals of dtype {got} but the model's "
        f"parameters are {want}; return them in the model's dtype "
        f"(e.g. end residual_fn with .to({want}))"
    )


def check_step(
    function: ModelFunction,
    param_groups: list[dict[str, Any]],
    inputs: Any,
    targets: Any,
    slice_size: int | None,
    *,
    any_device: bool,
    probes: ProbeCache | None = None,
) -> StepCheck:
    """Validate the arguments of a step: batch size, residuals (this rank's, all ranks'), lr.

    With ``probes``, a batch whose :func:`batch_signature` was probed before is not
    probed again (``probed`` is then False, and the caller checks the residuals as
    they are computed, :class:`RowsCheck`); every other check runs on every step.
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
    probed = True
    try:
        if slice_size is not None and (
            isinstance(slice_size, bool) or not isinstance(slice_size, int) or slice_size < 1
        ):
            raise ValueError(f"Invalid slice_size={slice_size!r}: must be an integer >= 1.")
        # The model first: a changed model would also fail the batch probe, less clearly.
        function.check_unchanged()
        _check_param_groups(function, param_groups)
        key = None if probes is None else batch_signature(function.model, inputs, targets)
        cached = None if probes is None else probes.get(key)
        if cached is None:
            batch, m = check_batch(function, inputs, targets, any_device=any_device)
            if probes is not None:
                probes.put(key, (batch, m))
        else:
            (batch, m), probed = cached, False
        lr = param_groups[0]["lr"]
        try:
            check_number("lr", lr, above=0)
        except (TypeError, ValueError):
            raise ValueError(
                f"Invalid lr={lr!r} in param_groups[0]: must be a finite number > 0."
            ) from None
        lr = float(lr)
    except Exception as exc:
        error = reducer.hold(exc)
    # Each rank's failure flag, residual count and lr; float64 holds a Python float's
    # lr exactly, so equal settings compare equal bit for bit.
    rows = reducer.gather_values(
        [1.0 if error is not None else 0.0, float(m), lr], function.group.solver
    )
    if error is not None:
        raise error
    failed = [i for i, row in enumerate(rows) if row[0] > 0]
    if failed:
        raise ValueError(
            f"step() rejected the batch on rank(s) {failed} of {len(rows)}; see the error "
            "raised there. No rank changed its parameters."
        )
    lrs = [row[2] for row in rows]
    if any(v != lrs[0] for v in lrs):
        shown = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(lrs))
        raise ValueError(
            f"param_groups[0]['lr'] differs across ranks ({shown}); every rank takes the "
            "same step, so the ranks' parameters would diverge. Set the same lr on every "
            "rank (change it, or step a scheduler, in code that runs on all ranks). No "
            "rank changed its parameters."
        )
    return StepCheck(batch, m, int(sum(row[1] for row in rows)), lr, probed)


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
    """Inputs in the parameters' dtype; inputs and targets on their device.

    With ``devices=`` given, both may be anywhere: each slice is moved to its device.
    """
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
        if isinstance(leaf, Tensor) and leaf.device != p0.device and not any_device:
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
        raise TypeError(_dtype_message(out.dtype, p0.dtype))
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
