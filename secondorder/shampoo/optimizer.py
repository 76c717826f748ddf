"""``Shampoo``: the torch.optim.Optimizer that wires the parts together.

Blocking, preconditioner, grafting and distribution live in their own modules, as do
the blocks' stacked state (:mod:`.blocks`), group handling (:mod:`.groups`), the
gradient checks (:mod:`.checks`) and state-dict conversion (:mod:`.state`); this one
holds only the order of the stages and torch's optimizer contract.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .._keywords import check_keywords
from ..distributed import Reducer, resolve_reducer
from .agreement import agree_refusal, agreed_settings, check_tallies, step_tally
from .blocks import (
    Batch,
    Block,
    bind_batch_state,
    cut_blocks,
    group_batches,
    new_batch_state,
    prepare_batch,
)
from .checks import check_gradient_layout, check_received, check_step
from .config import (
    COMMUNICATION_DTYPES,
    EigenConfig,
    GraftingConfig,
    RootInvConfig,
    factor_dtype,
    validate_group,
)
from .distributor import check_distributed_params, make_distributor, resolve_distribution
from .groups import (
    REFERENCE_OPTIONS,
    STRUCTURAL,
    check_float_params,
    check_group_keys,
    factored_layout,
    make_preconditioner,
    normalize_group,
    structure,
)
from .named_configs import DistributedConfig, PreconditionerConfig
from .preconditioner import Preconditioner
from .state import (
    check_saved_layout,
    check_saved_rank,
    check_saved_shapes,
    configs_to_dicts,
    ensure_int64_steps,
    restored_state,
    validated_groups,
)
from .update import BatchUpdate, commit, compute_update, new_parameter_values

__all__ = ["Shampoo"]


class Shampoo(torch.optim.Optimizer):
    r"""Distributed Shampoo: block-diagonal Kronecker-factored AdaGrad-family optimizer.

    Each parameter is reshaped and cut into blocks (:mod:`~secondorder.shampoo.blocking`);
    each block ``G`` of order ``r`` keeps one factor per dimension,
    ``F_k ← β₂F_k + (1−β₂)G₍ₖ₎G₍ₖ₎ᵀ``, and, every ``precondition_frequency`` steps from
    ``start_preconditioning_step`` on, their inverse roots ``(F̂_k + εI)^(−1/2r)``.  The
    step is ``W ← W − lr·P`` with ``P = M ×₁ F̂₁^(−1/2r) … ×_r F̂_r^(−1/2r)`` for the
    filtered gradient ``M ← β₁M + (1−β₁)G`` (bias-corrected), rescaled per block to the
    norm of the grafted method's direction; before preconditioning starts, the grafted
    direction itself.  Then decoupled weight decay and optional (Nesterov) momentum.
    ``preconditioner="eigenvalue_corrected"`` keeps Adam's second moment in the factors'
    eigenbasis instead (SOAP).  A root applied to fewer vectors between refreshes than
    its size (``precondition_frequency · m < d``) is stored as ``D`` with root ``DᵀD``
    (state key ``block{i}.root_factor{k}`` instead of ``block{i}.root{k}``), which
    skips the ``2d³`` product that would form it; the step is the same to rounding.

    Non-finite gradients, and finite ones that would overflow the factors or the
    grafting state (checked exactly in float64, see :mod:`.checks`), raise
    ``FloatingPointError`` before any state or parameter changes.  A step is all or
    nothing (:mod:`.update`): whatever raises, a Ctrl-C included, leaves parameters and
    state as they were; with several ranks every rank raises with it, and ranks whose
    ``lr`` or other hyperparameters differ are refused (:mod:`.agreement`).

    Step count, as in DistributedShampoo: one ``t`` per parameter group (bias
    corrections, root schedule), advanced by every ``step()`` in which any of its
    parameters has a gradient; ``torch.optim.Adam`` counts per parameter, so give
    parameters that skip steps their own group (the guide's Shampoo section).

    Choose it over Adam/AdamW when the extra per-step cost (an eigendecomposition per
    factor every ``precondition_frequency`` steps) buys fewer steps; start from the
    tuned AdamW settings with ``grafting_config=AdamGraftingConfig(...)``,
    ``betas=(0.9, 0.999)`` and ``precondition_frequency`` of 10 to 100.

    Args:
        params: parameters or parameter groups (every argument below except
            ``reducer``, ``process_group`` and ``communication_dtype`` may be set per group).
        lr: learning rate.
        betas: ``(β₁, β₂)``: β₁ filters the gradient (0 disables), β₂ the factors
            (1: plain sums, AdaGrad-like).
        epsilon: added to the factors' diagonal before the root (must be 0 with
            ``EigenConfig(pseudo_inverse=True)``); for the eigenvalue-corrected
            variant, added to ``sqrt(E)`` as in Adam, where a coordinate whose ``E``
            is at rounding level (``≤ rank_rtol² · ΣE``, default the block's largest
            dimension times machine epsilon) is the factors' null space and gets a
            zero direction instead of noise over ``epsilon``.
        momentum, dampening, use_nesterov: momentum ``μ`` on the final direction,
            ``b ← μb + (1−d)P``, then ``P ← b`` (Nesterov: ``P ← (1−d)P + μb``), with
            ``b`` starting at zero as in DistributedShampoo.  With ``dampening=0`` (the
            default) this is ``torch.optim.SGD``'s rule; with ``d > 0`` it is not:
            SGD starts ``b`` at the first direction, ``b₁ = P₁``, here ``b₁ = (1−d)P₁``,
            so every later ``b_t`` is SGD's minus ``d·μ^(t−1)·P₁``.
        weight_decay: decoupled (added to the direction, AdamW-style) if
            ``use_decoupled_weight_decay`` else L2 (added to the gradient).
        max_preconditioner_dim: largest factor dimension (blocks are cut to it).
        precondition_frequency: steps between root (or eigenbasis) computations.
        start_preconditioning_step: first preconditioned step; ``None`` (or ``-1``)
            means ``precondition_frequency``, read at every step (the group keeps
            ``None``), so a later change of ``precondition_frequency`` moves it along.
        use_bias_correction: divide by ``1−β₁ᵗ`` and ``1−β₂ᵗ``.
        grafting_config: ``None`` or an SGD/AdaGrad/RMSprop/Adam grafting config.
        preconditioner: ``"root_inverse"`` (Shampoo) or ``"eigenvalue_corrected"`` (SOAP).
        root_inv_config: ``EigenConfig(...)`` (default) or ``CoupledNewtonConfig(...)``.
        factor_dtype: dtype of factors and roots; ``None`` is the parameter's dtype,
            float32 for float16 and bfloat16 parameters (whose whole state and step
            are then float32, only the direction rounded to the parameter's dtype;
            a step whose direction float16 cannot hold is refused).
        num_tolerated_failed_amortized_computations: consecutive failed root
            computations of one block that keep the previous root (with a warning)
            before an error.
        reducer, process_group: the data-parallel group (see
            :func:`secondorder.distributed.resolve_reducer`); blocks are divided among
            its ranks and the directions all-gathered.  The gradients must already be
            averaged across ranks (DDP does this).
        communication_dtype: dtype of the all-gathered directions; ``None`` is the
            parameter's dtype (directions arrive exactly: equal to one process to
            rounding, as batched kernels round by batch size); ``torch.bfloat16``
            halves the bytes.  A step whose directions exceed a narrower dtype's range
            (float16's 65504) is refused on every rank.
        distributed_config: DistributedShampoo's configs (:mod:`.named_configs`):
            ``None`` picks from the parameters; ``fully_shard`` (DTensor) parameters get
            each rank stepping the blocks of its own shards (cut inside the shard),
            which equals one process on the same model held as its row shards.

    DistributedShampoo's options it does not take (``preconditioner_config``, ...)
    and near misses of its own are refused with the way out named.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 1.0),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        dampening: float = 0.0,
        use_nesterov: bool = False,
        weight_decay: float = 0.0,
        use_decoupled_weight_decay: bool = True,
        max_preconditioner_dim: int | float = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        use_bias_correction: bool = True,
        grafting_config: GraftingConfig | PreconditionerConfig | None = None,
        preconditioner: str = "root_inverse",
        root_inv_config: RootInvConfig | None = None,
        factor_dtype: torch.dtype | None = None,
        num_tolerated_failed_amortized_computations: int = 3,
        *,
        reducer: Reducer | None = None,
        process_group: Any = None,
        communication_dtype: torch.dtype | None = None,
        distributed_config: DistributedConfig | None = None,
        **unknown: Any,
    ) -> None:
        check_keywords("so.Shampoo", unknown, KEYWORDS, REFERENCE_OPTIONS, "DistributedShampoo")
        reducer, communication_dtype = resolve_distribution(
            distributed_config, reducer, process_group, communication_dtype
        )
        if communication_dtype not in COMMUNICATION_DTYPES:
            raise ValueError(
                f"Invalid communication_dtype={communication_dtype!r}: must be None (the "
                "parameter's dtype), torch.float32, torch.float64, torch.bfloat16 or "
                "torch.float16."
            )
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, (list, tuple)) else betas,
            "epsilon": epsilon,
            "momentum": momentum,
            "dampening": dampening,
            "use_nesterov": use_nesterov,
            "weight_decay": weight_decay,
            "use_decoupled_weight_decay": use_decoupled_weight_decay,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "use_bias_correction": use_bias_correction,
            "grafting_config": grafting_config,
            "preconditioner": preconditioner,
            "root_inv_config": EigenConfig() if root_inv_config is None else root_inv_config,
            "factor_dtype": factor_dtype,
            "num_tolerated_failed_amortized_computations": (
                num_tolerated_failed_amortized_computations
            ),
        }
        #: The hyperparameters every saved group must hold (torch adds its own to defaults).
        self._hyperparameters = tuple(defaults)
        self._built = False
        self._agreed = False  # whether the ranks agreed on the built state (see _build)
        self._settings: dict[str, Any] = {}
        self._batches: list[Batch] = []
        self._blocks: list[Block] = []
        self._structures: list[tuple[Any, ...]] = []
        self._wire_dtype = torch.float32
        self._distributed_config = distributed_config
        self._sharded: bool | None = None  # whether the parameters are DTensors
        super().__init__(params, defaults)
        self.reducer = resolve_reducer(reducer, process_group)
        self.communication_dtype = communication_dtype
        self._distributor = make_distributor(self._sharded, self.reducer)

    # -- configuration -------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:  # noqa: D102
        # Checked on a copy with the defaults filled in, before torch appends the group:
        # a refused group leaves param_groups (and every later step) as they were.
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch names the set error itself
            params = list(params)  # a generator is read once, here
            param_group["params"] = params
        check_group_keys(param_group, self.defaults)
        probe = {**self.defaults, **param_group}
        self._normalize(probe)
        validate_group(probe)
        check_float_params(params)
        sharded = check_distributed_params(params, self._distributed_config, self._sharded)
        super().add_param_group(param_group)
        self._sharded = sharded
        self._normalize(self.param_groups[-1])
        self._built = False

    @staticmethod
    def _normalize(group: dict[str, Any]) -> None:
        normalize_group(group)

    def _preconditioner(
        self, group: dict[str, Any], shape: tuple[int, ...], factored: tuple[bool, ...] = ()
    ) -> Preconditioner:
        return make_preconditioner(group, shape, factored)

    def _factored(self, group: dict[str, Any], batch: Batch) -> tuple[bool, ...]:
        """Which factors keep their root as ``D`` (see :func:`.groups.factored_layout`)."""
        saved = self.state.get(batch.blocks[0].param, {})
        return factored_layout(group, batch.shape, batch.blocks[0].entry, saved)

    # -- building the blocks and the stacked state ----------------------------------------
    def _device(self) -> torch.device:
        return next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    def _build(
        self, error: BaseException | None = None, required: bool = False, agree: bool = True
    ) -> None:
        """Cut parameters into blocks, assign owners, stack the owned blocks' state.

        Per-parameter state (torch's schema) holds views into the stacked buffers, so
        ``state_dict`` sees every block while each stage runs as one batched call.
        With several ranks, a rank that failed before (``error``) or fails here makes
        every rank raise, and the ranks then check that their configurations agree.
        ``required``: every block entry must be in the (loaded) state.  ``agree=False``
        (:meth:`state_dict`, which one rank may call alone) builds without a
        collective; the ranks then agree at the next step.
        """
        settings: dict[str, Any] = {}
        if error is None:
            try:
                blocks = cut_blocks(self.param_groups, self._distributor)
                settings = agreed_settings(self.param_groups, self.communication_dtype)
                batches = self._stack_state(blocks, required)
            except BaseException as exc:  # flagged to the other ranks, then re-raised
                if self.reducer.world_size == 1 or not agree:
                    raise
                error = exc
        self._agreed = False
        if agree:
            self._agree(error, settings)
        ensure_int64_steps(self.param_groups, self.state)
        dtypes = [p.dtype for g in self.param_groups for p in g["params"]]
        # Directions travel in the widest parameter dtype unless told otherwise, so
        # each block's arrives exactly (a float64 one is not squeezed through float32).
        self._wire_dtype = self.communication_dtype or (
            functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
        )
        self._blocks = blocks
        self._batches = batches
        self._structures = [structure(g) for g in self.param_groups]
        self._settings = settings
        self._built = True

    def _agree(self, error: BaseException | None, settings: dict[str, Any]) -> None:
        """Every rank raises if one failed to build; else the configurations must agree."""
        agree_refusal(self.reducer, error, "to build or load its Shampoo state", self._device())
        self.reducer.check_agree(settings, "Shampoo configuration")
        self._agreed = True

    def _group_batches(self, blocks: list[Block]) -> list[Batch]:
        """The blocks this rank owns, one batch per (group, block shape, dtype, device)."""
        return group_batches(blocks, self.reducer.rank)

    def _stack_state(self, blocks: list[Block], required: bool = False) -> list[Batch]:
        """Stack the owned blocks' state, copying in (and checking) any saved entries."""
        batches = self._group_batches(blocks)
        for batch in batches:
            group = self.param_groups[batch.group_index]
            p0 = batch.blocks[0].param
            fdtype = factor_dtype(group["factor_dtype"], p0.dtype)
            batch.factored = self._factored(group, batch)
            pre = self._preconditioner(group, batch.shape, batch.factored)
            state = pre.init_state(len(batch.blocks), fdtype, p0.device)
            batch.state = new_batch_state(group, batch, state)
            bind_batch_state(batch, self.state, required)
        return batches

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one Shampoo step; ``closure`` (optional) re-evaluates and returns the loss.

        All or nothing: a step that raises (or is interrupted) on any rank leaves every
        rank's parameters and state as they were (see :mod:`.update`, :mod:`.agreement`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world = self.reducer.world_size
        error: BaseException | None = None
        try:
            for group in self.param_groups:
                self._normalize(group)
                validate_group(group)
        except BaseException as exc:  # flagged to the other ranks, then re-raised
            if world == 1:
                raise
            error = exc
        if not self._built:
            self._build(error)
        elif not self._agreed:  # built by state_dict() alone, without a collective
            self._agree(error, self._settings)
        updates: list[BatchUpdate] = []
        steps: dict[int, int] = {}
        if error is None:
            try:
                steps, updates = self._compute()
            except BaseException as exc:  # flagged to the other ranks, then re-raised
                if world == 1:
                    raise
                error = exc
        params = self._new_parameters(updates, error)
        counts = [(p, t) for gi, t in steps.items() for p in self.param_groups[gi]["params"]]
        commit(self.state, updates, params, counts)
        return loss

    def _compute(self) -> tuple[dict[int, int], list[BatchUpdate]]:
        """Check the gradients and compute every owned batch's update; nothing changes."""
        for gi, group in enumerate(self.param_groups):
            if structure(group) != self._structures[gi]:
                raise ValueError(
                    f"param_groups[{gi}] changed one of {STRUCTURAL} (or switched β₁, "
                    "momentum or the grafting state on or off) after the optimizer state was "
                    "built; these fix the shape of the state. Build a new Shampoo instead."
                )
        grads = check_gradient_layout(self.param_groups)
        steps: dict[int, int] = {}
        for gi, group in enumerate(self.param_groups):
            if any(p.grad is not None for p in group["params"]):
                steps[gi] = int(self.state[group["params"][0]]["step"].item()) + 1
        prepared = [
            (batch, prep)
            for batch in self._batches
            if batch.group_index in steps
            # the stacked gradients (L2 decay added) and state of the blocks with a gradient
            and (prep := prepare_batch(self.param_groups[batch.group_index], batch)) is not None
        ]
        check_step(self.param_groups, grads, prepared)  # non-finite, or would overflow
        updates = []
        for batch, prep in prepared:
            group = self.param_groups[batch.group_index]
            pre = self._preconditioner(group, batch.shape, batch.factored)
            updates.append(compute_update(pre, group, batch, prep, steps[batch.group_index]))
        return steps, updates

    def _new_parameters(
        self, updates: list[BatchUpdate], error: BaseException | None
    ) -> list[tuple[Tensor, Tensor]]:
        """``(parameter, W − lr·P)`` pairs, after the ranks exchanged and agreed.

        With several ranks, every rank sends its tally (failure flag and settings,
        :mod:`.agreement`) and, data-parallel, its directions in one all-gather, and
        raises alike unless none failed, all agree and the directions fit the wire.
        """
        directions = {gid: d for u in updates for gid, d in u.directions.items()}
        active = [b for b in self._blocks if b.param.grad is not None]
        if self.reducer.world_size > 1:
            counts = [
                int(self.state[g["params"][0]]["step"]) if g["params"] else -1
                for g in self.param_groups
            ]
            tally = step_tally(self.param_groups, counts, error is not None, self._device())
            mine = (
                []
                if error is not None
                else [directions[b.gid] for b in active if b.owner == self.reducer.rank]
            )
            parts = self._distributor.share(tally, mine, self._wire_dtype)
            check_tallies([t for t, _ in parts], self.param_groups, error, self.reducer)
            received = self._distributor.received(parts, active)
            if received:
                flats = [flat for _, flat in parts]
                check_received(flats, received, active, self._wire_dtype)
            directions.update(received)
        lrs = [float(g["lr"]) for g in self.param_groups]
        return new_parameter_values(active, directions, lrs)

    # -- state dict ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Torch's schema; configs become plain dicts so ``weights_only=True`` loads it.

        In a distributed run each rank's state holds the blocks it owns: save one file
        per rank and load it into the same rank of a run with the same world size.  It
        never communicates, so one rank may call it alone (before the first step too).
        """
        if not self._built:
            self._build(agree=False)
        return configs_to_dicts(super().state_dict(), self.reducer, self.param_groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` bit for bit, or refuse it and change nothing.

        Checked before anything is kept: that it is a Shampoo state dict of this rank
        and world size, saved for parameters of these shapes, its hyperparameters, and
        every block entry this optimizer keeps (present, shape, a dtype that holds it
        exactly, finite values, non-negative second moments, factors' 2x2 principal
        minors >= 0 to rounding, whole step counts >= 0).  With several ranks, a rank
        that refuses makes every rank refuse.
        """
        previous = {name: getattr(self, name) for name in _LOAD_REPLACES}
        try:
            error: BaseException | None = None
            try:
                check_saved_layout(state_dict, self._hyperparameters)
                check_saved_rank(state_dict, self.reducer, self._sharded is True)
                check_saved_shapes(state_dict, self.param_groups)
                saved_groups = state_dict["param_groups"]
                groups = validated_groups(saved_groups)
                # Torch's loader would cast floating state to the parameter's dtype, so
                # only the groups go through it and the state is restored here.
                super().load_state_dict({"state": {}, "param_groups": groups})
                self.state = restored_state(state_dict, saved_groups, self.param_groups)
                for group in self.param_groups:
                    self._normalize(group)
            except BaseException as exc:  # flagged to the other ranks, then re-raised
                if self.reducer.world_size == 1:
                    raise
                error = exc
            self._built = False
            self._build(error, required=bool(error is None and state_dict["state"]))
        except BaseException:
            for name, value in previous.items():
                setattr(self, name, value)
            raise


#: What :meth:`Shampoo.load_state_dict` replaces, and puts back when it refuses.
_LOAD_REPLACES = [
    "param_groups",
    "state",
    "_built",
    "_batches",
    "_blocks",
    "_structures",
    "_wire_dtype",
    "_agreed",
    "_settings",
]


#: The keywords :class:`Shampoo` takes (an unknown one is named with the nearest).
KEYWORDS = tuple(
    k for k in inspect.signature(Shampoo.__init__).parameters if k not in ("self", "unknown")
)
