"""``jacobian="auto"``'s evidence: its candidates run on a probe of the batch, and timed.

The first batch of each input signature runs the candidate strategies on a probe of
:data:`~secondorder.lm.jacobian.PROBE_SAMPLES` samples and compares each with the
whole probe evaluated at once (:func:`~secondorder.lm.jacobian.check_strategy`).
Samples that interact (a residual minus its batch mean, ``x - x.mean(0)``,
``F.batch_norm(training=True)``) or a model that per-sample ``vmap`` cannot run
(GRU/RNN, ``Embedding(max_norm=...)``) make ``"auto"`` move on to the next candidate,
and the residual function is checked to depend on the parameters.  The check costs
about one step on the probe, two more evaluations of it and a few host
synchronisations, once per signature.

With several ranks every verdict and timing is summed over ranks (one all-reduce of
a few numbers each), so that every rank takes the same choice and runs the same
collectives; a rank whose model raises joins the sum with a failure flag.
"""

from __future__ import annotations

import time
from typing import Any

from ...distributed import Reducer
from ..jacobian import (
    PROBE_SAMPLES,
    ProbeVerdict,
    Reference,
    batch_reference,
    check_strategy,
    coupling_message,
    make_jacobian,
    random_message,
)
from ..model import ModelFunction, slice_tree

__all__ = ["TIMING_SAMPLES", "Probe"]

#: Samples of the slice on which the two per-sample modes are timed.
TIMING_SAMPLES = 64


class Probe:
    """Runs ``jacobian="auto"``'s candidates on a probe of a batch, agreeing across ranks."""

    def __init__(self, function: ModelFunction, reducer: Reducer) -> None:
        self.function = function
        self.reducer = reducer

    def flags(self, values: list[float]) -> list[float]:
        """``values`` summed over ranks (one all-reduce; nothing on one process)."""
        rows = self.reducer.gather_values(values, self.function.group.solver)
        return [sum(column) for column in zip(*rows, strict=True)]

    def first_passing(
        self, inputs: Any, targets: Any, batch: int, names: list[str], timed: bool
    ) -> tuple[str, bool]:
        """The first of ``names`` that every rank's probe passes, and whether it is settled.

        ``timed``: when ``"reverse"`` passes and ``"forward"`` would too, the faster of
        the two on a slice (:meth:`faster_mode`).  Not settled: a probe of one sample
        (it cannot show an interaction) or one whose numbers were not finite; the
        caller checks the signature's next batch again.
        """
        fn = self.function
        size = min(batch, PROBE_SAMPLES)
        p_in = slice_tree(inputs, 0, size)
        p_t = None if targets is None else slice_tree(targets, 0, size)
        _, p_in, p_t = next(fn.group.stage([(p_in, p_t)]))
        params = fn.points(fn.flat())[0]
        program = fn.replicas[0].program
        error: Exception | None = None
        reference: Reference | None = None
        with fn.frozen(), fn.group.on(0):
            try:
                reference = batch_reference(program, params, p_in, p_t)
            except Exception as exc:
                error = self.reducer.hold(exc)
            failed, random = self.flags(
                [
                    float(error is not None),
                    float(reference is not None and not reference.repeatable),
                ]
            )
            if failed:
                if error is not None:
                    raise error
                raise ValueError(
                    "the Jacobian check of this batch raised on another rank; see the error "
                    "raised there. No rank changed its parameters."
                )
            assert reference is not None
            if random:
                raise ValueError(random_message("auto", fn.model))
            verdicts: dict[str, ProbeVerdict] = {}
            chosen: str | None = None
            coupled = False
            for name in names:
                if coupled and name in ("reverse", "forward"):
                    continue
                verdict = check_strategy(make_jacobian(name), program, params, p_in, p_t, reference)
                verdicts[name] = verdict
                bad, mixed, unsure = self.flags(
                    [
                        float(verdict.status == "failed"),
                        float(verdict.status == "coupled"),
                        float(verdict.status == "undecided"),
                    ]
                )
                if mixed:
                    coupled = True
                if not bad and not mixed:
                    chosen = name
                    break
            if chosen is None:
                raise ValueError(_no_strategy_message(verdicts))
            if timed and chosen == "reverse":
                other = check_strategy(
                    make_jacobian("forward"), program, params, p_in, p_t, reference
                )
                (bad,) = self.flags([float(other.status != "ok")])
                if not bad:
                    chosen = self.faster_mode(inputs, targets, batch)
        # One sample cannot show an interaction, and non-finite numbers show nothing.
        return chosen, size >= 2 and not unsure

    def faster_mode(self, inputs: Any, targets: Any, batch: int) -> str:
        """Time both per-sample modes on a small slice and return the faster."""
        fn = self.function
        size = min(batch, TIMING_SAMPLES)
        inputs = slice_tree(inputs, 0, size)
        targets = None if targets is None else slice_tree(targets, 0, size)
        # Time it where the Jacobians run: on the first device, with its replica.
        _, inputs, targets = next(fn.group.stage([(inputs, targets)]))
        params = fn.points(fn.flat())[0]
        program = fn.replicas[0].program
        names = ("reverse", "forward")
        elapsed = [0.0, 0.0]
        error: Exception | None = None
        with fn.frozen(), fn.group.on(0):
            try:
                for i, name in enumerate(names):
                    strategy = make_jacobian(name)
                    strategy(program, params, inputs, targets)  # warm-up
                    t0 = time.perf_counter()
                    strategy(program, params, inputs, targets)
                    elapsed[i] = time.perf_counter() - t0
            except Exception as exc:
                # A rank whose model raises on this slice joins the sum with a failure
                # flag, so that every rank raises (no collective is added).
                error = self.reducer.hold(exc)
                elapsed = [0.0, 0.0]
        # With several ranks, the summed timings make every rank choose the same mode.
        rows = self.reducer.gather_values([*elapsed, float(error is not None)], fn.group.solver)
        reverse, forward, failed = (sum(column) for column in zip(*rows, strict=True))
        what = "timing the per-sample Jacobian modes for jacobian='auto'"
        self.reducer.raise_together(error, failed, what)
        return names[1] if forward < reverse else names[0]


def _no_strategy_message(verdicts: dict[str, ProbeVerdict]) -> str:
    """Why every candidate of ``"auto"`` failed on the probe."""
    lines = []
    for name, v in verdicts.items():
        if v.status == "coupled":
            lines.append(coupling_message(name, v.detail).split(". Use")[0])
        elif v.status == "failed":
            lines.append(f"jacobian={name!r} raised {v.detail or 'on another rank'}")
        else:
            lines.append(f"jacobian={name!r} failed on another rank")
    return (
        "jacobian='auto' found no strategy that reproduces the whole batch's residuals "
        "and Jacobian on a probe of this batch: " + "; ".join(lines) + ". Nothing was changed."
    )
