"""K-FAC as a gradient preconditioner that any ``torch.optim`` optimizer follows.

The loop is KAISA's: forward, backward, ``kfac.step()`` (which rewrites ``.grad`` of
every preconditioned layer), then ``optimizer.step()``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._keywords import check_keywords
from ..distributed import CollectiveError, Reducer, resolve_reducer
from .agreement import agree, shared_settings
from .assignment import WorkAssignment, assign_work, factor_cost
from .checkpoint import layers_state
from .config import KAISA, KAISA_OPTIONS, KFACConfig
from .discovery import SUPPORTED_MODULES, check_model_and_scaler, discover_layers, layer_table
from .exchange import receive_buffers, share_inverses, share_preconditioned
from .hooks import StatsCapture, check_calls
from .layers import KFACLayer
from .loading import PreparedLoad, check_state, commit_load, prepare_load
from .packing import sums_finite, unpack_upper
from .sharding import gather_grads, refuse_flat_parameters
from .transaction import (
    Snapshot,
    StepPlan,
    blank_settings,
    kl_clip_scale,
    stats_to_sum,
    warn_about_statistics,
)

__all__ = ["KEYWORDS", "KFAC", "SUPPORTED_MODULES"]


class KFAC:
    r"""Kronecker-factored preconditioning of Linear, Conv1d/2d and Embedding gradients.

    For each layer with weight gradient ``∇`` (outputs × inputs, bias as a last
    column), K-FAC replaces ``∇`` by the solution ``P`` of ``(A ⊗ G + λI) vec P =
    vec ∇`` (``compute_method="eigen"``, exact through the factors' eigenvectors:
    ``P = Q_G[(Q_Gᵀ∇Q_A) / (d_G d_Aᵀ + λ)]Q_Aᵀ``) or by ``(G + λI)⁻¹∇(A + λI)⁻¹``
    (``"inverse"``, cheaper, damps each factor), then scales all of them by the KL clip
    ``ν = min(1, √(kl_clip / |lr² Σ⟨P, ∇⟩|))``.  ``A`` and ``G`` are running averages
    (``factor_decay``) starting at the identity.

    Scaling convention (differs from KAISA's on purpose): ``A = mean a aᵀ`` and
    ``G = mean over samples of Σ_positions g gᵀ`` where ``g`` is the gradient of each
    sample's *own* loss, i.e. ``N · ∂L/∂s`` for the mean loss ``L`` of a micro-batch of
    ``N`` (``loss_reduction="mean"``; with accumulation the loss is also divided by
    ``accumulation_steps``).  ``A ⊗ G`` is then the empirical Fisher of one sample: it
    does not change with the batch size or the number of ranks, and ``kl_clip`` bounds
    the per-sample KL divergence.  KAISA builds a Linear layer's G from mean-loss
    gradients, so its G is ours divided by ``B²`` (``B`` its per-rank batch) and its
    eigen-method step is ``B²`` times ours at damping ``B²·λ``, and our clip factor ν is
    ``B²`` times its.  So ``damping=B²·λ, kl_clip=B²·c`` at the same lr reproduces a
    KAISA run (damping λ, kl_clip c) exactly whenever our clip is active (KAISA's
    ν < 1/B²); without clipping, use ``lr·B²`` instead.  Dimension 0 of a layer's input
    is the batch (an unbatched input is one sample).  A layer called several times in
    one call of the model (weight sharing) counts its calls as more positions of the
    same samples, as one call over stacked inputs would; a call enters the factors
    when its output's gradient arrives, so forwards that are not backpropagated
    (metrics, a pass abandoned after an error) leave them alone, and calls inside
    ``torch.func`` transforms are not captured.

    Distribution (``torch.distributed`` through a :class:`~secondorder.distributed.Reducer`):
    every rank must hold the gradient of the global batch (DDP, or an all-reduce of its
    own) before :meth:`step`.  The factor statistics are summed over ranks, so W ranks
    equal one process on the concatenated batch; each layer's decomposition is done by
    one rank (:func:`~secondorder.kfac.assignment.assign_work`) and shared according to
    ``grad_worker_fraction`` (COMM-OPT 1, MEM-OPT 1/W, HYBRID-OPT between).  The ranks
    agree on every setting when K-FAC is built, and at each step (two small
    all-reduces) that none of them failed and that the step's values match: a failure
    or a difference on one rank makes every rank raise, with nothing changed.

    Args:
        model: the model (or a DDP wrapper); its supported submodules get hooks.
        modules: names of the submodules to precondition (default: every supported,
            trainable one not in ``skip_layers``).
        grad_scaler: a ``torch.amp.GradScaler`` (or a callable returning the current
            scale) whose scaled loss is backpropagated; G is built from unscaled
            gradients, and a factor update with non-finite statistics is skipped.
        reducer, process_group: see :func:`secondorder.distributed.resolve_reducer`.
        Other arguments: see :class:`~secondorder.kfac.config.KFACConfig`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: int | Callable[[int], int] = 1,
        inv_update_steps: int | Callable[[int], int] = 1,
        damping: float | Callable[[int], float] = 1e-3,
        factor_decay: float | Callable[[int], float] = 0.95,
        kl_clip: float | Callable[[int], float | None] | None = 1e-3,
        lr: float | Callable[[int], float] = 0.1,
        accumulation_steps: int = 1,
        compute_method: str = "eigen",
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: Sequence[str] = (),
        modules: Sequence[str] | None = None,
        grad_worker_fraction: float | str = 1.0,
        assignment_strategy: str = "compute",
        symmetry_aware: bool = False,
        loss_reduction: str = "mean",
        grad_scaler: Any = None,
        reducer: Reducer | None = None,
        process_group: Any = None,
        **unknown: Any,
    ) -> None:
        check_keywords("so.KFAC", unknown, KEYWORDS, KAISA_OPTIONS, KAISA)
        if isinstance(skip_layers, str):
            skip_layers = (skip_layers,)
        self.config = KFACConfig(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            compute_method=compute_method,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            skip_layers=tuple(skip_layers),
            grad_worker_fraction=grad_worker_fraction,
            assignment_strategy=assignment_strategy,
            symmetry_aware=symmetry_aware,
            loss_reduction=loss_reduction,
        )
        check_model_and_scaler(model, grad_scaler)
        refuse_flat_parameters(model)
        self.grad_scaler = grad_scaler
        layers, skipped = discover_layers(
            model, modules, self.config.skip_layers, self.config.factor_dtype
        )
        self.reducer = resolve_reducer(reducer, process_group)
        self._assign_work(layers)
        #: name → layer, for every preconditioned module, in model order.
        self.layers: dict[str, KFACLayer] = layers
        #: where the ranks' agreement tables live (the first layer's device).
        self._device = next(iter(layers.values())).device
        #: name → why the module keeps its plain gradient.
        self.skipped: dict[str, str] = skipped
        self._init_counters()
        self._capture = StatsCapture(self.config, self._grad_scale)
        self._capture.attach(model, layers)

    def _assign_work(self, layers: dict[str, KFACLayer]) -> None:
        # which rank decomposes which layer, agreed by every rank, and the sub-groups
        # that share the decompositions and the preconditioned gradients
        world = self.reducer.world_size
        k = self.config.grad_workers(world)
        costs = {
            name: factor_cost(
                [s[-1] for s in layer.factor_shapes()], self.config.assignment_strategy
            )
            for name, layer in layers.items()
        }
        self.assignment: WorkAssignment = assign_work(costs, world, k)
        self.reducer.check_agree(
            shared_settings(self.config, layers, k), "K-FAC layers and settings"
        )
        # building sub-groups is collective: every rank does it, in the same order
        self._workers = self.reducer.split(self.assignment.worker_groups())
        self._receivers = self.reducer.split(self.assignment.receiver_groups())

    def _init_counters(self) -> None:
        self.steps = 0
        #: λ set by adaptive damping; None follows ``config.damping``.
        self.damping_override: float | None = None
        #: factor updates dropped because their statistics were not finite.
        self.skipped_factor_updates = 0
        self._warned: set[str] = set()

    # -- hooks -------------------------------------------------------------------------
    def _grad_scale(self) -> float:
        s = self.grad_scaler
        if s is None:
            return 1.0
        value = s.get_scale() if hasattr(s, "get_scale") else s()
        return float(value)

    def remove_hooks(self) -> None:
        """Detach K-FAC from the model (the layers keep their factors)."""
        self._capture.remove()

    # -- the step ----------------------------------------------------------------------
    @property
    def damping(self) -> float:
        """λ at the current step (the adaptive value if adaptive damping set one)."""
        if self.damping_override is not None:
            return self.damping_override
        return float(self.config.at("damping", self.steps))

    def _check_hooks(self, capture: bool) -> list[str]:
        """The layers with a gradient this step (each checked; no communication)."""
        present: list[str] = []
        for name, layer in self.layers.items():
            frozen = not layer.module.weight.requires_grad
            if not layer.has_grad() or frozen:
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"K-FAC layer {name!r} has no gradient at step {self.steps} (frozen with "
                        "requires_grad=False, or unused); it is not preconditioned while that "
                        "lasts.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                continue
            if capture:
                check_calls(name, layer)
            present.append(name)
        return present

    def _gradients(self, present: list[str]) -> dict[str, Tensor]:
        """The ``(groups, o, i)`` gradients of ``present``, sharded ones gathered first.

        Every rank gathers the same parameters in the same order (the ranks agreed on
        ``present``) before building any matrix, so an error in building one cannot
        leave the ranks in different collectives.
        """
        whole = gather_grads(p for name in present for p in self.layers[name].params())
        grads: dict[str, Tensor] = {}
        for name in present:
            g = self.layers[name].grad(whole)
            assert g is not None
            grads[name] = g
        return grads

    def step(self) -> None:
        """Update factors and decompositions when due, then precondition every ``.grad``.

        A step is a transaction: the new factors, decompositions and gradients are
        computed into temporaries and written only once all of them exist; the ranks
        then agree that every one of them got that far, and put the old state back
        together if one did not.  If anything raises (a check, a decomposition, an
        interrupt), on any rank, every rank raises and the factors, decompositions,
        step count, the statistics gathered since the last step and every ``.grad``
        are as they were: the step can be retried, and the batch enters the factors
        once.
        """
        self._step()

    def _step(self, error: BaseException | None = None, undo: list[Snapshot] | None = None) -> None:
        """:meth:`step`; all ranks refuse if ``error`` is set; ``undo`` gets the snapshot."""
        plan: StepPlan | None = None  # BaseException below: a Ctrl-C must reach every rank
        where = f"K-FAC step {self.steps}"
        try:
            plan = None if error is not None else self._plan()
            settings = plan.settings() if plan else blank_settings(self.layers)
        except BaseException as exc:
            error = error or exc
            settings = blank_settings(self.layers)  # this rank still reports, as failed
        # every rank passed its checks and reads the same settings, before any collective
        agree(self.reducer, error, settings, self._device, where)
        assert plan is not None
        # From here on every rank makes every collective of the step, whatever fails
        # locally (it is recorded in ``error``), so that none waits for another.
        factors: dict[str, tuple[Tensor, Tensor]] = {}
        inv: dict[str, dict[str, Tensor]] = {}
        pre: dict[str, Tensor] = {}
        bad: list[str] = []
        try:
            plan.grads = self._gradients(plan.present)
        except CollectiveError:
            raise
        except BaseException as exc:
            error = exc
        try:
            if plan.stats is not None:
                factors, bad = self._update_factors(plan.stats, plan.decay)
            if plan.invert:
                inv = self._update_inverses(factors, plan.damping, plan.i_steps)
        except CollectiveError:
            raise
        except BaseException as exc:
            error = error or exc
        if plan.invert and self.assignment.grad_workers > 1:
            # a rank whose part failed still takes part, with placeholders
            share_inverses(self, inv, plan.received, plan.i_steps)
        if error is None:
            try:
                pre = self._precondition(plan.grads, plan.damping, inv)
            except BaseException as exc:
                error = exc
        pre, failed = share_preconditioned(self, pre, plan.present, plan.received)
        error = error or failed
        taken = undo if undo is not None else []
        first = len(taken)  # _commit appends its snapshot before it writes
        try:
            if error is None:
                try:
                    nu = kl_clip_scale(plan, pre)
                    self._commit(plan, factors, inv, pre, nu, bool(bad), taken)
                except BaseException as exc:
                    error = exc
            # the last agreement: a rank that did not commit makes the others undo theirs
            agree(self.reducer, error, {}, self._device, where)
        except BaseException:
            for snapshot in taken[first:]:
                snapshot.restore(self)
            raise
        warn_about_statistics(plan, bad, self.layers, self.grad_scaler)

    def _plan(self) -> StepPlan:
        """Every value the step needs, read and checked before anything changes."""
        cfg, step = self.config, self.steps
        # the next step's factor interval decides whether its forward is captured
        f_steps = cfg.at("factor_update_steps", step)
        i_steps = cfg.at("inv_update_steps", step)
        next_f_steps = cfg.at("factor_update_steps", step + 1)
        capture = step % f_steps == 0
        plan = StepPlan(
            step=step,
            f_steps=f_steps,
            i_steps=i_steps,
            next_f_steps=next_f_steps,
            damping=self.damping,
            decay=cfg.at("factor_decay", step),
            kl_clip=cfg.at("kl_clip", step),
            lr=cfg.at("lr", step),
            invert=step % i_steps == 0,
            present=self._check_hooks(capture and not self._capture.loaded),
            layers=list(self.layers),
        )
        if capture:
            plan.stats = stats_to_sum(self.layers, cfg.symmetry_aware, self.reducer, self._device)
        plan.received = receive_buffers(self, plan.present, plan.invert, i_steps)
        plan.dropped = [n for n, layer in self.layers.items() if layer.dropped]
        return plan

    def _update_factors(
        self, stats: list[Tensor], decay: float
    ) -> tuple[dict[str, tuple[Tensor, Tensor]], list[str]]:
        """Sum the statistics over ranks: the new factors, or the layers with non-finite sums."""
        self.reducer.sum_(stats)
        *tensors, counts = stats
        layers = list(self.layers.values())
        # One read for every layer: the sums' finiteness and the counts together.
        finite = sums_finite(tensors)
        rows = counts.tolist()
        bad = [
            layer.name
            for i, layer in enumerate(layers)
            if not (finite[2 * i] and finite[2 * i + 1])
        ]
        if bad:
            return {}, bad
        packed = self.config.symmetry_aware
        out: dict[str, tuple[Tensor, Tensor]] = {}
        for i, layer in enumerate(layers):
            a, g = tensors[2 * i], tensors[2 * i + 1]
            a_shape, g_shape = layer.factor_shapes()
            if packed and len(a_shape) == 3:
                a = unpack_upper(a, a_shape[-1])
            if packed:
                g = unpack_upper(g, g_shape[-1])
            a_rows, g_samples = rows[i]
            if a_rows > 0 and g_samples > 0:
                out[layer.name] = layer.new_factors(a, a_rows, g, g_samples, decay)
        return out, []

    def _update_inverses(
        self, factors: dict[str, tuple[Tensor, Tensor]], damping: float, uses: int
    ) -> dict[str, dict[str, Tensor]]:
        """The decompositions this rank owns, of the new factors.

        ``factors`` gains the identity of every layer that has no factors yet: that is
        what gets decomposed, and committed.
        """
        cfg = self.config
        asg, rank = self.assignment, self.reducer.rank
        out: dict[str, dict[str, Tensor]] = {}
        for name, layer in self.layers.items():
            if name not in factors and (layer.A is None or layer.G is None):
                factors[name] = layer.identity_factors()
            if asg.inverse_worker[name] == rank:
                out[name] = layer.decomposition(
                    cfg.compute_method, damping, cfg.inv_dtype, uses, factors.get(name)
                )
        return out

    def _precondition(
        self, grads: dict[str, Tensor], damping: float, inv: dict[str, dict[str, Tensor]]
    ) -> dict[str, Tensor]:
        """The preconditioned gradients of the layers this rank is a gradient worker of."""
        cfg = self.config
        asg, rank = self.assignment, self.reducer.rank
        out: dict[str, Tensor] = {}
        for name, g in grads.items():
            if asg.is_grad_worker(name, rank):
                layer = self.layers[name]
                out[name] = layer.precondition(g, cfg.compute_method, damping, inv.get(name))
        return out

    def _commit(
        self, plan: StepPlan, factors: dict[str, tuple[Tensor, Tensor]],
        inv: dict[str, dict[str, Tensor]], pre: dict[str, Tensor], nu: float, skipped: bool,
        undo: list[Snapshot],
    ) -> None:  # fmt: skip
        """Write the step; ``undo`` gets what it replaces first."""
        before = Snapshot.take(self, [p for n in pre for p in self.layers[n].params()])
        undo.append(before)
        try:
            for name, p in pre.items():
                self.layers[name].set_grad(p.mul_(nu) if nu != 1.0 else p)
            for name, (a, g) in factors.items():
                self.layers[name].A, self.layers[name].G = a, g
            for name, d in inv.items():
                self.layers[name].inv = d
            self.skipped_factor_updates += int(skipped)
            self.last_nu = nu
            self.steps += 1
            self._capture.capturing = self.steps % plan.next_f_steps == 0
            self._capture.end_step()
            for layer in self.layers.values():
                layer.reset_stats()
        except BaseException:
            before.restore(self)
            raise

    # -- reporting ---------------------------------------------------------------------
    def summary(self) -> str:
        """A table of the preconditioned layers and of the modules with plain gradients.

        Each preconditioned layer shows its factor shapes and the rank that decomposes
        it; each other module with parameters shows why it keeps its plain gradient.
        """
        workers = self.assignment.inverse_worker
        return layer_table(self.layers, workers, self.skipped)

    __repr__ = summary

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Steps, adaptive damping and every layer's factors and this rank's decompositions.

        Plain tensors, numbers and strings, so ``torch.load(..., weights_only=True)``
        reads it.  Factors are identical on every rank (the identity before the first
        update); decompositions are the ones this rank holds.  With
        ``torch.distributed.checkpoint``, save it beside the model's and optimizer's
        state and load into a fresh K-FAC's ``state_dict()`` as the template; it holds
        no decompositions, so pass the result to :meth:`load_state_dict` with
        ``recompute=True`` unless the loaded step recomputes them anyway.
        """
        return {
            "steps": self.steps,
            "damping_override": self.damping_override,
            "skipped_factor_updates": self.skipped_factor_updates,
            "layers": layers_state(self.layers),
        }

    def check_state_dict(self, state: Any, recompute: bool = False) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``: local, changes nothing."""
        check_state(self, state, recompute)

    def load_state_dict(self, state: dict[str, Any], recompute: bool = False) -> None:
        """Restore :meth:`state_dict`'s output; every entry is checked before any is set.

        ``recompute=True`` recomputes every loaded layer's decomposition from its
        factors, at the loaded step's damping, so a state saved without decompositions
        (kfac-pytorch's, or one rank's) resumes at any step.  The statistics gathered
        since the last step are dropped with the state they belonged to (a rolled-back
        batch does not reach the factors); a step before the next forward folds in
        nothing.  The load is one transaction on every rank: if any rank refuses its
        state (or is interrupted), every rank raises and no rank's K-FAC changes.
        """
        prepared: PreparedLoad | None = None
        error: BaseException | None = None
        try:
            prepared = prepare_load(self, state, recompute)
        except BaseException as exc:
            error = exc
        self._agree_load(error, "K-FAC load_state_dict")
        assert prepared is not None
        commit_load(self, prepared, "K-FAC load_state_dict")

    def _agree_load(self, error: BaseException | None, what: str) -> None:
        """Every rank raises if any rank's preparation of a load failed."""
        agree(self.reducer, error, {}, self._device, what)


#: The keywords :class:`KFAC` takes (an unknown one is named with a suggestion).
KEYWORDS = tuple(
    p.name
    for p in inspect.signature(KFAC.__init__).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
