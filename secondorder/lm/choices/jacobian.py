"""Which Jacobian strategy a batch uses: a forced one, or ``"auto"`` above the four.

:class:`ForcedJacobian` is the configuration's strategy, refused up front where it
cannot be right and otherwise checked where it runs
(:class:`~secondorder.lm.jacobian.CheckedStrategy`).  :class:`AutoJacobian` picks one
of the concrete strategies per input signature, as lineax's ``AutoLinearSolver``
picks a solver: per-sample reverse mode when a sample has few residuals (``4k ≤ n``),
forward mode when it has many (``k ≥ 4n``), otherwise the faster of the two on a few
samples; the whole-batch modes when samples interact (BatchNorm in training mode, a
``ModelResidual``, or what the probe of the signature's first batch shows,
:class:`~.probe.Probe`).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor
from torch.utils._pytree import tree_flatten

from ...distributed import Reducer
from ..jacobian import JACOBIANS, PROBE_SAMPLES, CheckedStrategy, JacobianStrategy, make_jacobian
from ..model import ModelFunction, interacting_modules
from .probe import Probe

__all__ = ["PROBE_ENTRIES", "AutoJacobian", "ForcedJacobian", "JacobianChoice", "jacobian_choice"]

#: Entries of J (probe rows × parameters) above which the Jacobian check is skipped.
PROBE_ENTRIES = 1 << 24

#: The strategies ``"auto"`` chooses among.
_CONCRETE = tuple(name for name in JACOBIANS if name != "auto")


class JacobianChoice(Protocol):
    """The Jacobian strategy of each batch."""

    #: The strategies ``"auto"`` chose, per input signature (part of the checkpoint).
    cache: dict[str, str]

    def select(self, inputs: Any, targets: Any, batch: int, m: int, m_total: int) -> str:
        """The strategy's name for this batch (``m`` rows here, ``m_total`` on all ranks)."""
        ...

    def strategy(self, name: str, slice_size: int | None) -> JacobianStrategy:
        """The strategy ``name``, checked where it runs if it was not checked on a probe."""
        ...


class ForcedJacobian:
    """A strategy the configuration names: used as given, never switched.

    A per-sample mode (``"reverse"``, ``"forward"``) is refused before anything runs
    when the residual needs the whole batch (a ``ModelResidual``) or a module mixes
    samples.  Otherwise it is checked on the first slice of each signature
    (:class:`~secondorder.lm.jacobian.CheckedStrategy`), a check local to each rank
    that calls no collective.
    """

    def __init__(self, name: str, function: ModelFunction) -> None:
        self.name = name
        self.function = function
        #: Kept as a checkpoint gave it, for a later ``"auto"`` run.
        self.cache: dict[str, str] = {}

    def select(self, inputs: Any, targets: Any, batch: int, m: int, m_total: int) -> str:
        """The forced name, after refusing a per-sample mode that would be wrong."""
        fn, name = self.function, self.name
        if name in ("reverse", "forward"):
            interacting = interacting_modules(fn.model)
            if fn.coupled_residual:
                raise ValueError(
                    f"jacobian={name!r} needs per-sample residuals, but residual_fn "
                    "is a ModelResidual; use 'batch_reverse', 'batch_forward' or 'auto'"
                )
            if interacting:
                raise ValueError(
                    f"jacobian={name!r} would compute a wrong per-sample Jacobian: "
                    f"modules {interacting} mix samples (BatchNorm in training mode or "
                    "without running statistics); use 'batch_reverse', 'batch_forward' "
                    "or 'auto', or call model.eval()"
                )
        return name

    def strategy(self, name: str, slice_size: int | None) -> JacobianStrategy:
        """The strategy, checked on the first slice of each signature."""
        return CheckedStrategy(_make(name, slice_size), self.function.model)


class AutoJacobian:
    """``jacobian="auto"``: one of the four strategies per input signature (module docstring).

    A choice is checked once per signature on a probe (:class:`~.probe.Probe`) and
    remembered in :attr:`checked`.  With several ranks, one all-reduce of a few
    numbers per step makes every rank take the same choice (a rank meeting a new
    signature alone would otherwise run the check's collectives alone).
    """

    def __init__(self, function: ModelFunction, reducer: Reducer) -> None:
        self.function = function
        self.reducer = reducer
        self.probe = Probe(function, reducer)
        self.cache: dict[str, str] = {}
        #: Per input signature, the strategy checked on a probe of its first batch.
        self.checked: dict[str, str] = {}

    def select(self, inputs: Any, targets: Any, batch: int, m: int, m_total: int) -> str:
        """The strategy for this batch: remembered for its signature, or decided now."""
        fn = self.function
        m_total = m_total or m
        if fn.coupled_residual:
            # The residual needs the model itself: only the batch modes apply.
            return "batch_reverse" if m_total <= fn.n else "batch_forward"
        signature = _signature(inputs, m)
        known = self.checked.get(signature)
        structural = bool(interacting_modules(fn.model))
        k = max(1, m // batch)
        known, k, structural = self._agree_known(known, k, structural)
        if known is None:
            known = self._decide(inputs, targets, batch, m_total, k, structural, signature)
        self.cache[signature] = known
        return known

    def strategy(self, name: str, slice_size: int | None) -> JacobianStrategy:
        """The strategy; checked where it runs only for a ``ModelResidual`` (no probe)."""
        strategy = _make(name, slice_size)
        if self.function.coupled_residual:
            return CheckedStrategy(strategy, self.function.model)
        return strategy

    def _agree_known(
        self, known: str | None, k: int, structural: bool
    ) -> tuple[str | None, int, bool]:
        """Across ranks: the choice every rank already made, the largest k, any interaction.

        One all-reduce of ``world × (3 + 4)`` numbers (nothing on one process).  The
        choice is returned only when every rank has checked its signature and made the
        same one; otherwise ``None``, and every rank decides anew, together.
        """
        names = _CONCRETE
        votes = [1.0 if name == known else 0.0 for name in names]
        rows = self.reducer.gather_values(
            [1.0 if known is None else 0.0, 1.0 if structural else 0.0, float(k), *votes],
            self.function.group.solver,
        )
        unknown = sum(row[0] for row in rows)
        tally = [sum(row[3 + i] for row in rows) for i in range(len(names))]
        agreed = None
        if unknown == 0 and max(tally) == len(rows):
            agreed = names[tally.index(max(tally))]
        return agreed, int(max(row[2] for row in rows)), any(row[1] > 0 for row in rows)

    def _candidates(self, m_total: int, k: int, structural: bool, signature: str) -> list[str]:
        """The strategies to try, best first: the rule on residuals per sample."""
        n = self.function.n
        batch_modes = ["batch_reverse", "batch_forward"]
        if m_total > n:
            batch_modes.reverse()
        if structural:
            names = batch_modes
        elif k >= 4 * n:
            names = ["forward", "reverse", *batch_modes]
        else:
            names = ["reverse", "forward", *batch_modes]
        # With several ranks only agreed numbers may shape the list (a rank's cache
        # is its own), so that every rank runs the same checks and collectives.
        cached = self.cache.get(signature) if self.reducer.is_identity else None
        if cached in names:
            # A choice restored from a checkpoint is tried first, so a resumed run
            # takes the choices of the run it continues.
            names.remove(cached)
            names.insert(0, cached)
        return names

    def _decide(
        self,
        inputs: Any,
        targets: Any,
        batch: int,
        m_total: int,
        k: int,
        structural: bool,
        signature: str,
    ) -> str:
        """Check the candidates on a probe and return the first that every rank passes."""
        n = self.function.n
        names = self._candidates(m_total, k, structural, signature)
        timed = not structural and 4 * k > n and k < 4 * n
        if PROBE_SAMPLES * k * n > PROBE_ENTRIES:
            # The probe's Jacobian alone would take more memory than the check is
            # worth (and may not fit where the planner would slice the batch): take
            # the rule's choice unchecked.  k is agreed, so every rank skips alike.
            unchecked = names[0]
            if timed and unchecked == "reverse":
                unchecked = self.probe.faster_mode(inputs, targets, batch)
            self.checked[signature] = unchecked
            return unchecked
        if self.reducer.is_identity:
            timed = timed and self.cache.get(signature) is None
        chosen, settled = self.probe.first_passing(inputs, targets, batch, names, timed)
        if settled:
            # An unsettled check is repeated on the signature's next batch.
            self.checked[signature] = chosen
        return chosen


def jacobian_choice(name: str, function: ModelFunction, reducer: Reducer) -> JacobianChoice:
    """The object for the configuration's ``jacobian``."""
    if name == "auto":
        return AutoJacobian(function, reducer)
    return ForcedJacobian(name, function)


def _make(name: str, slice_size: int | None) -> JacobianStrategy:
    """The concrete strategy; the whole-batch modes push ``slice_size`` cotangents at once."""
    return make_jacobian(name, slice_size if name.startswith("batch") else None)


def _signature(inputs: Any, m: int) -> str:
    """What ``jacobian="auto"``'s choice depends on: shapes per sample and rows per sample."""
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)]
    shapes = ",".join(str(tuple(t.shape[1:])) + str(t.dtype) for t in leaves)
    return f"{shapes}|rows_per_sample={m // max(1, leaves[0].shape[0])}"
