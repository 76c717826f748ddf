"""Loading a K-FAC ``state_dict`` as one transaction, refused by every rank together.

:func:`prepare_load` checks the state and builds everything the load will assign (new
factor tensors, and with ``recompute`` every decomposition) without touching K-FAC;
the ranks then agree (:func:`~secondorder.kfac.agreement.agree`) that none of them
refused, or was interrupted, before :func:`commit_load` assigns it all.  So a damaged
checkpoint on one rank, or a Ctrl-C in the third eigendecomposition, leaves every
rank's K-FAC as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .agreement import agree
from .checkpoint import check_counters, check_layers_state, loaded_layers
from .parts import KFACParts
from .transaction import Snapshot

__all__ = ["PreparedLoad", "check_state", "commit_load", "prepare_load"]


@dataclass
class PreparedLoad:
    """What a checked ``state_dict`` sets: counters, and each layer's (A, G, inv)."""

    steps: int
    damping_override: float | None
    skipped_factor_updates: int
    capturing: bool
    layers: dict[str, tuple[Tensor | None, Tensor | None, dict[str, Tensor]]]


def check_state(kfac: KFACParts, state: Any, recompute: bool) -> None:
    """Raise if ``state`` cannot be loaded into ``kfac``; changes nothing."""
    check_counters(state)
    steps = state["steps"]
    asg, rank = kfac.assignment, kfac.reducer.rank
    recomputes = recompute or steps % kfac.config.at("inv_update_steps", steps) == 0
    needs = set() if recomputes else {n for n in kfac.layers if asg.is_grad_worker(n, rank)}
    check_layers_state(state["layers"], kfac.layers, kfac.config.compute_method, needs)


def prepare_load(
    kfac: KFACParts,
    state: Any,
    recompute: bool,
    damping: float | None = None,
    uses: int | None = None,
) -> PreparedLoad:
    """Check ``state`` and compute what loading it sets, into new tensors only.

    With ``recompute``, every layer that has factors gets its decomposition at
    ``damping`` for ``uses`` steps (default: the loaded step's damping and inverse
    update interval).
    """
    check_state(kfac, state, recompute)
    cfg = kfac.config
    # read before anything is assigned: a callable schedule may refuse the step count
    steps = int(state["steps"])
    capturing = steps % cfg.at("factor_update_steps", steps) == 0
    override = state.get("damping_override")
    override = None if override is None else float(override)
    layers = loaded_layers(state["layers"], kfac.layers, cfg.inv_dtype)
    if recompute:
        if damping is None:
            damping = override if override is not None else float(cfg.at("damping", steps))
        if uses is None:
            uses = int(cfg.at("inv_update_steps", steps))
        for name, (a, g, inv) in layers.items():
            if a is not None and g is not None:
                inv = kfac.layers[name].decomposition(
                    cfg.compute_method, damping, cfg.inv_dtype, uses, (a, g)
                )
                layers[name] = (a, g, inv)
    return PreparedLoad(
        steps=steps,
        damping_override=override,
        skipped_factor_updates=int(state.get("skipped_factor_updates", 0)),
        capturing=capturing,
        layers=layers,
    )


def _assign(kfac: KFACParts, prepared: PreparedLoad) -> None:
    for name, (a, g, inv) in prepared.layers.items():
        layer = kfac.layers[name]
        layer.A, layer.G, layer.inv = a, g, inv
    kfac.steps = prepared.steps
    kfac.damping_override = prepared.damping_override
    kfac.skipped_factor_updates = prepared.skipped_factor_updates
    kfac._capture.capturing = prepared.capturing
    # the statistics gathered since the last step belong to the state replaced, and a
    # backward of a forward from before the load is ignored, as after a step
    kfac._capture.end_step(loaded=True)
    for layer in kfac.layers.values():
        layer.reset_stats()


def commit_load(
    kfac: KFACParts,
    prepared: PreparedLoad,
    what: str,
    after: Callable[[], None] | None = None,
    undo: Callable[[], None] | None = None,
) -> None:
    """Assign ``prepared`` (then call ``after``) on every rank, or on none.

    Called once the ranks agreed that every one prepared its load.  A rank interrupted
    while assigning puts its old state back, and the agreement that follows makes the
    others put theirs back too (``undo`` undoes ``after``): every rank raises.
    """
    before: Snapshot | None = None
    error: BaseException | None = None
    try:
        try:
            before = Snapshot.take(kfac, [])
            _assign(kfac, prepared)
            if after is not None:
                after()
        except BaseException as exc:
            error = exc
        agree(kfac.reducer, error, {}, kfac._device, what)
    except BaseException:
        if before is not None:
            before.restore(kfac)
        if undo is not None:
            undo()
        raise
