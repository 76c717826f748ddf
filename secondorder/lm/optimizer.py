"""The Levenberg-Marquardt optimizer for PyTorch models.

:class:`LevenbergMarquardt` wires the parts together and holds no algorithm of its
own: :class:`~secondorder.lm.choices.Choices` decides each batch's Jacobian strategy,
solver, form and slice size; :class:`~secondorder.lm.problem.ModelProblem` linearises
the batch into one :class:`~secondorder.lm.linalg.NormalEquations` record (through a
reducer, the only stage that would talk to other processes); and
:func:`secondorder.lm.engine.iterate` runs the damped attempts.  Trial points are
evaluated functionally: candidate tensors stand in for the parameters for the
duration of one call.  The model's own parameters are written once, when a step is
accepted, so an exception anywhere in a step leaves them untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ..distributed import Reducer, resolve_reducer
from ..distributed.devices import replicate_module, resolve_devices, sync_replica
from .arguments import (
    NO_TARGETS,
    agree_across_ranks,
    is_torch_loss,
    outside_inference,
    trainable_parameters,
    unpack_batch,
)
from .batch import ProbeCache, check_step
from .checkpoint import STATE_FORMAT_VERSION, Checkpoint, read_state_dict, write_state_dict
from .choices import Choices
from .config import LMConfig
from .damping import DampingState, make_damping_matrix, make_damping_rule
from .graphs import CapturableSteps
from .host_step import HostStep
from .iteration import EngineConfig
from .model import ModelFunction
from .planner import MemoryPlan, PlanError
from .precision import GramPrecision, PrecisionRule
from .problem import BatchSetup, ModelProblem
from .records import LMInternals, SmallBatchWarning, StepInfo
from .report import SmallBatchWatch, capturable_info
from .residuals import ModelResidual, describe, from_torch_loss, mse
from .writes import write_point

__all__ = [
    "STATE_FORMAT_VERSION",
    "LMInternals",
    "LevenbergMarquardt",
    "SmallBatchWarning",
    "StepInfo",
]


class LevenbergMarquardt(torch.optim.Optimizer):
    r"""Levenberg-Marquardt for PyTorch models, with an explicit Jacobian.

    Each :meth:`step` minimises ``½‖r‖²`` over the batch it is given, where
    ``r = residual_fn(model(inputs), targets)`` flattened, by solving the damped
    normal equations

    .. math:: (J^\top J + \lambda D)\,\delta = -J^\top r

    (or, with fewer residuals than parameters, the equivalent dual system
    ``δ = -D⁻¹Jᵀ(JD⁻¹Jᵀ + λI)⁻¹r``), evaluating the trial point, and accepting it when
    the gain ratio ρ of actual to predicted reduction is positive.  Rejected attempts
    raise λ and solve again from the same factorisation where the solver allows.
    Larger λ gives shorter steps along the scaled gradient; smaller λ gives
    Gauss-Newton steps, which converge much faster than first-order methods near a
    minimum of a small or medium model.

    Args:
        model: the :class:`torch.nn.Module` to train; its trainable parameters
            (``requires_grad=True``) are the unknowns.
        residual_fn: ``(outputs, targets) -> residuals`` (first dimension the batch),
            one of :mod:`secondorder.lm.residuals`, or a
            :class:`~secondorder.lm.residuals.ModelResidual` for residuals that need the
            model itself (physics-informed losses).  Default :func:`~.residuals.mse`.
            A torch loss module (``torch.nn.MSELoss()``, ``CrossEntropyLoss()``, ...)
            is mapped onto its adapter (:func:`~secondorder.lm.residuals.from_torch_loss`).
        lr: scales every update.  1 is the LM step; below 1 damps it further.
        damping: the initial λ.
        devices: several devices of this process to compute on, e.g.
            ``["cuda:0", "cuda:1"]`` (see below).  ``None`` computes on the model's
            device.
        solver_device: where the partial sums meet and the linear system is
            solved; default the first of ``devices``.  Any device, listed or not.
        reducer: how partial sums meet; a :class:`~secondorder.distributed.Reducer`.
        process_group: a ``torch.distributed`` process group whose ranks train the
            model together (see below).  Give ``reducer`` or ``process_group``, not
            both.  With neither, the default group is used whenever
            ``torch.distributed.is_initialized()``; otherwise the optimizer runs on
            one process.  Pass ``reducer=LocalReducer()`` to train independent
            models on the ranks of an initialised group.
        **options: every other field of :class:`~secondorder.lm.config.LMConfig`
            (``damping_rule``, ``damping_matrix``, ``jacobian``, ``solver``, ``form``,
            ``max_attempts``, ``slice_size``, ``geodesic``, ``ftol``/``xtol``/``gtol``,
            ``gram_dtype``, ...).  Cross-entropy residuals (``cross_entropy``,
            ``binary_cross_entropy``, or the torch losses mapped onto them) default to
            ``damping_rule="multiplicative"``: their gain ratio stays near 0.5, where
            Nielsen's rule holds λ high (``LMConfig.for_residual``); pass
            ``damping_rule="nielsen"`` to keep the gain-ratio rule.

    Example::

        opt = so.LevenbergMarquardt(model, so.residuals.mse)
        for _ in range(100):
            info = opt.step(x, y)
            if info.terminated:
                break

    **Several processes.**  As with DDP and a ``DistributedSampler``, each rank
    builds the same model and optimizer and passes its own shard of the global batch
    to :meth:`step`; the result is the step one process would take on the
    concatenated shards, in rank order, up to rounding.  Losses, ``Jᵀr`` and ``JᵀJ``
    are summed across ranks, so every rank takes the same decisions, and rank 0's
    step is broadcast, so the parameters stay bitwise identical
    (:mod:`secondorder.distributed.process_group`).  The primal form sums the n×n
    Gram; ``solver="cg"`` sums one n-vector per CG iteration; the dual form and QR
    gather J's rows.  At construction the ranks check that they hold the same
    parameters and settings (a :class:`ValueError` names what differs) and take
    rank 0's parameter values.  Buffers are not synchronised (BatchNorm in training
    mode normalises with its own shard, as under DDP without ``SyncBatchNorm``).
    Every rank must call :meth:`step` equally often; a rank that dies makes the
    others raise :class:`~secondorder.distributed.CollectiveError` within the
    process group's ``timeout``.

    **Several devices in one process.**  With ``devices=[d0, d1, ...]`` the model is
    replicated on each device (read-only copies, :attr:`replicas`; the model itself
    serves the first), slice i of the batch goes to ``devices[i % len(devices)]``,
    and each device's share of the normal equations is brought to
    ``solver_device``.  Without a ``slice_size`` every device gets a slice;
    interacting samples (BatchNorm in training mode, a
    :class:`~secondorder.lm.residuals.ModelResidual`) run unsliced on the first.  The
    result is the step one device would take, up to the order in which per-device
    Grams are added.  Each step copies the model's parameters, buffers and modes into
    the replicas first, and writes an accepted update to all of them.  This composes
    with several processes (with NCCL, make ``solver_device`` the rank's GPU).
    """

    def __init__(
        self,
        model: nn.Module,
        residual_fn: Callable[..., Tensor] | ModelResidual = mse,
        *,
        lr: float = 1.0,
        damping: float = 1e-3,
        reducer: Reducer | None = None,
        process_group: Any = None,
        devices: list[Any] | None = None,
        solver_device: Any = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {describe(model)}")
        if is_torch_loss(residual_fn):
            residual_fn = from_torch_loss(residual_fn)  # type: ignore[arg-type]
        if not (callable(residual_fn) or isinstance(residual_fn, ModelResidual)):
            raise TypeError(f"residual_fn must be callable, got {describe(residual_fn)}")
        try:
            self.config = LMConfig.for_residual(residual_fn, lr=lr, damping=damping, **options)
        except TypeError as exc:
            if "unexpected keyword" in str(exc):
                valid = sorted(LMConfig.__dataclass_fields__)
                raise TypeError(f"{exc}; valid options are {valid}") from None
            raise
        named = trainable_parameters(model)
        group = resolve_devices(devices, solver_device, named[0][1].device)
        self.reducer = resolve_reducer(reducer, process_group)
        # The ranks of a shared batch check that they built the same optimizer (the
        # identity on one process).
        agree_across_ranks(self.reducer, named, residual_fn, self.config)
        super().__init__([p for _, p in named], {"lr": lr})
        self.model = model
        self.residual_fn = residual_fn
        #: Whether inputs may arrive on any device (they are moved slice by slice).
        self._any_device = devices is not None
        self._function = ModelFunction(
            model,
            residual_fn,
            [k for k, _ in named],
            [p for _, p in named],
            self.reducer,
            group,
            replicate_module(model, group.devices),
        )
        cfg = self.config
        #: Decides each step's Gram dtype and dual check (:mod:`.precision`).
        self._precision = PrecisionRule(
            GramPrecision(cfg.gram_dtype, cfg.gram_auto_tol, cfg.damping_matrix),
            named[0][1].dtype,
            group.devices,
            self._function.n,
        )
        # The capturable step factors by Cholesky: "auto" plans for it.
        planned = replace(cfg, solver="cholesky") if cfg.capturable else cfg
        self._choices = Choices(planned, self._function, self.reducer, self._precision)
        #: The per-batch problem of the last step or plan (see :meth:`internals`).
        self._problem: ModelProblem | None = None
        self._rule = make_damping_rule(
            cfg.damping_rule, cfg.damping_up, cfg.damping_down, cfg.damping_shrink
        )
        self._matrix = make_damping_matrix(cfg.damping_matrix)
        self._damping = DampingState(damping=float(damping))
        self._engine = EngineConfig.of(cfg)
        self._steps = 0
        self._memory_plan: MemoryPlan | None = None
        #: ``residual_fn``'s probe verdict per batch signature (see :mod:`.batch`).
        self._probes = ProbeCache()
        #: The small-batch warning's memory (given once per optimizer).
        self._small_batch = SmallBatchWatch()
        self._batch_marker: Tensor | None = None
        #: Whether the step in progress is applied (it then survives an interrupt).
        self._done = False
        #: The capturable step's device state and graphs (``capturable=True`` only).
        self._device: CapturableSteps | None = None
        if cfg.capturable:
            self._device = CapturableSteps(
                self._function,
                rule=self._rule,
                matrix=self._matrix,
                config=self._engine,
                candidates=cfg.candidates,
                state=self._damping,
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: LM optimizes one flat vector of the model's parameters.

        Its damping state, ``JᵀJ`` and checkpoints are laid out for the parameters it
        was built on; build a new optimizer for a model with other parameters.
        """
        if "_function" in self.__dict__:
            raise NotImplementedError(
                "LevenbergMarquardt.add_param_group is not supported: LM optimizes one flat "
                "vector of the model's trainable parameters, fixed when it is built. To train "
                "more parameters, make them part of the model (requires_grad=True) and build "
                "a new LevenbergMarquardt."
            )
        # torch.optim.Optimizer.__init__ adds the one group through here.
        super().add_param_group(param_group)

    # -- properties --------------------------------------------------------------------
    @property
    def damping(self) -> float:
        """The current λ (with ``capturable=True``, reading it waits for the device)."""
        if self._device is not None:
            return float(self._device.state.damping)
        return self._damping.damping

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The devices slices are computed on, in dispatch order."""
        return self._function.group.devices

    @property
    def solver_device(self) -> torch.device:
        """Where the normal equations are reduced and solved."""
        return self._function.group.solver

    @property
    def replicas(self) -> tuple[nn.Module, ...]:
        """The copy of the model that computes on each entry of :attr:`devices`."""
        return tuple(e.model for e in self._function.replicas)

    @property
    def num_parameters(self) -> int:
        """Number of trainable scalars (columns of J)."""
        return self._function.n

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The :class:`~secondorder.lm.planner.MemoryPlan` of the last step (or plan)."""
        return self._memory_plan

    def internals(self) -> LMInternals:
        """The parts this optimizer wires together, for tests and benchmarks.

        Not a stable API: the fields of :class:`LMInternals` follow the implementation.
        """
        return LMInternals(
            problem=self._problem,
            damping_matrix=self._matrix,
            damping_rule=self._rule,
            damping_state=self._damping,
        )

    # -- step ----------------------------------------------------------------------------
    def _setup(
        self, inputs: Any, targets: Any, slice_size: int | None
    ) -> tuple[BatchSetup, int, float]:
        """Validate the batch and resolve its choices: (setup, all ranks' residuals, lr).

        Raises :class:`~secondorder.lm.planner.PlanError` when the step cannot fit, before
        J is computed.
        """
        found = check_step(
            self._function,
            self.param_groups,
            inputs,
            targets,
            slice_size,
            any_device=self._any_device,
            probes=self._probes,
        )
        setup, plan = self._choices.setup(
            inputs,
            targets,
            found.batch,
            found.rows,
            found.rows_total,
            slice_size,
            probed=found.probed,
        )
        self._memory_plan = plan
        return setup, found.rows_total, found.lr

    def plan(
        self, inputs: Any, targets: Any = NO_TARGETS, *, slice_size: int | None = None
    ) -> MemoryPlan:
        """The memory plan :meth:`step` would follow on this batch, without stepping.

        The batch is validated as :meth:`step` validates it and the ``"auto"`` choices
        are resolved (``jacobian="auto"`` may time both modes on a few samples, as
        :meth:`step` would), but J is not computed and nothing is updated.  The plan
        is returned even when it does not fit (``plan.fits`` is False and
        ``plan.advice`` lists what would); :meth:`step` raises
        :class:`~secondorder.lm.planner.PlanError` for it.  ``print(opt.plan(x, y))``
        shows the bytes of each stage.  With several ranks, call it on every rank.
        """
        inputs, targets = unpack_batch(inputs, targets)
        try:
            setup, _, _ = self._setup(inputs, targets, slice_size)
        except PlanError as exc:
            return exc.plan
        self._problem = ModelProblem(self._function, setup)
        assert self._memory_plan is not None
        return self._memory_plan

    def step(  # type: ignore[override]
        self, inputs: Any, targets: Any = NO_TARGETS, *, slice_size: int | None = None
    ) -> StepInfo:
        """Run one LM iteration on this batch and return what it did.

        ``step(x, y)``, or ``step(batch)`` with the ``(inputs, targets)`` pair a
        :class:`~torch.utils.data.DataLoader` yields (a list or tuple of two; pass
        ``step(pair, None)`` for a model whose single input is a pair).  One call is
        one iteration on one batch: loop over a loader yourself (``for x, y in
        loader: opt.step(x, y)``).  There is no closure: the optimizer evaluates
        ``residual_fn(model(inputs), targets)`` and its Jacobian itself.

        ``slice_size`` overrides the configured samples per Jacobian slice for this
        call only.  The model's parameters are written only if a step is accepted; if anything
        raises during the step (the model, the residual function, an interrupt, in any
        attempt), they and the optimizer's state (λ, ν, Moré's scale, the step count,
        ``jacobian="auto"``'s choices) are exactly as before (under ``capturable=True`` an
        interrupt in a check step's read comes after the step, which stays done).  Under
        ``torch.no_grad()`` or ``torch.inference_mode()`` the step is the same: it
        needs gradients and turns them on for its own duration.
        """
        inputs, targets = unpack_batch(inputs, targets)
        # Which batch this is, before inference tensors are cloned (see _check_batch_size).
        self._batch_marker = next(
            (t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)), None
        )
        saved = self._snapshot()
        self._done = False
        try:
            # Like torch.optim's steps, a step works inside no_grad/inference_mode; it
            # differentiates the model, so it enables autograd for its own duration.
            with torch.inference_mode(False), torch.enable_grad():
                inputs, targets = outside_inference(inputs), outside_inference(targets)
                return self._step(inputs, targets, slice_size)
        except BaseException:
            # KeyboardInterrupt included: the attempts before the failure raised λ and
            # moved the damping rule's state; a failed step must leave no trace.
            if not self._done:
                self._restore(saved)
            raise

    def _snapshot(self) -> tuple[DampingState, int, dict[str, str], Any, Any]:
        """What :meth:`step` may change besides the parameters (written last)."""
        # The Moré scale is replaced, never updated in place, so a reference suffices.
        return (
            replace(self._damping),
            self._steps,
            dict(self._choices.auto_cache),
            self._problem,
            self._memory_plan,
        )

    def _restore(self, saved: tuple[DampingState, int, dict[str, str], Any, Any]) -> None:
        """Put back a :meth:`_snapshot`, into the same objects (:meth:`internals` holds them)."""
        damping, self._steps, cache, self._problem, self._memory_plan = saved
        self._damping.damping = damping.damping
        self._damping.nu = damping.nu
        self._damping.scale = damping.scale
        self._choices.auto_cache.clear()
        self._choices.auto_cache.update(cache)

    def _step(self, inputs: Any, targets: Any, slice_size: int | None) -> StepInfo:
        """:meth:`step` without its rollback."""
        if self._device is not None:
            return self._step_on_device(inputs, targets, slice_size)
        t_start = time.perf_counter()
        setup, m_total, lr = self._setup(inputs, targets, slice_size)
        if setup.form == "primal":
            self._small_batch.check(self._batch_marker, m_total, self._function.n, self._steps)
        for replica in self.replicas:
            sync_replica(self.model, replica)
        # The damping state is replaced on load: the step is built with the current one.
        step = HostStep(
            self._function, self._precision, self._rule, self._matrix, self._damping, self._engine
        )
        info, self._problem = step(setup, m_total, lr, inputs, t_start)
        self._steps += 1
        return info

    def _step_on_device(self, inputs: Any, targets: Any, slice_size: int | None) -> StepInfo:
        """The capturable step: no host read but every ``check_every``-th step's one."""
        assert self._device is not None
        t_start = time.perf_counter()
        setup, m_total, lr = self._setup(inputs, targets, slice_size)
        self._steps += 1
        every = self.config.check_every
        check = bool(every) and self._steps % every == 0
        run = self._device.step(setup, m_total, lr, self._precision, self._write_on_device)
        self._problem = run.problem
        self._done = True  # written and stored: an interrupt in the check leaves it done
        if check:
            run.checked = self._device.check()
        return capturable_info(run, t_start)

    def _write_on_device(self, x: Tensor, accepted: Tensor, inputs: Any) -> None:
        write_point(self._function, x, inputs, accepted)

    # -- checkpoints ---------------------------------------------------------------------
    def _checkpoint(self) -> Checkpoint:
        damping = self._damping if self._device is None else self._device.state.read()
        return Checkpoint(
            damping=damping.damping,
            nu=damping.nu,
            scale=damping.scale,
            steps=self._steps,
            lrs=[float(g["lr"]) for g in self.param_groups],
            auto_jacobian=self._choices.auto_cache,
        )

    def _shapes(self) -> list[list[int]]:
        return [list(s) for s in self._function.shapes]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue, in torch.optim's schema (format 2).

        ``{"state": {0: {...}}, "param_groups": [{...}], "format_version": 2}``: λ, ν,
        Moré's scale, the step count and ``jacobian="auto"``'s choices under the first
        parameter's index (as ``torch.optim.LBFGS`` keeps its state), ``lr``, the
        parameter shapes and the settings in the parameter group
        (:mod:`secondorder.lm.checkpoint`).  Holds only tensors, numbers, strings,
        lists and dicts, so it loads with ``torch.load(..., weights_only=True)``.
        """
        return write_state_dict(self._checkpoint(), self.config, self._shapes(), self._function.n)

    def load_state_dict(self, state_dict: dict[str, Any], *, strict: bool = True) -> None:
        """Restore a :meth:`state_dict` (format 2, or format 1 of earlier releases).

        Every entry is checked first, as the constructor checks its arguments; a
        refused checkpoint leaves the optimizer exactly as it was.  Refused: another
        model's checkpoint, an unknown format, a bad number (``lr`` of inf, λ above
        ``damping_max``, a NaN or wrong-length scale), and one written with other
        settings: the error names each difference.  Build the optimizer with
        ``**secondorder.lm.checkpoint.saved_settings(state_dict)`` to resume the
        saved run, or pass ``strict=False`` to keep this optimizer's settings (the
        damping rule and matrix must still match: the saved λ, ν and scale belong
        to them).  ``lr``, the initial ``damping`` and the layout settings
        (``slice_size``, ``memory_budget``, ``memory_limit``) may always differ;
        ``lr`` is restored from the checkpoint, as torch.optim does.
        """
        groups = len(self.param_groups)
        shapes, n = self._shapes(), self._function.n
        ckpt = read_state_dict(state_dict, shapes, n, groups, self.config, strict=strict)
        p0 = self._function.params[0]
        home = self._function.group.solver
        scale = None if ckpt.scale is None else ckpt.scale.to(device=home, dtype=p0.dtype)
        # Everything is validated and converted: nothing below can fail.
        self._damping = DampingState(damping=ckpt.damping, nu=ckpt.nu, scale=scale)
        if self._device is not None:
            # In place: a captured step reads these very tensors.
            self._device.load(self._damping)
        self._steps = ckpt.steps
        for group, lr in zip(self.param_groups, ckpt.lrs, strict=True):
            group["lr"] = lr
        self._choices.auto_cache = dict(ckpt.auto_jacobian)
