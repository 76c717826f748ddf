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
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..distributed import Reducer, resolve_reducer
from ..distributed.devices import replicate_module, resolve_devices, sync_replica
from .batch import ProbeCache, check_step
from .checkpoint import STATE_FORMAT_VERSION, Checkpoint, read_state_dict, write_state_dict
from .choices import Choices
from .config import LMConfig
from .damping import DampingState, make_damping_matrix, make_damping_rule, raise_damping
from .engine import EngineConfig, Outcome, iterate
from .linalg import NormalEquations
from .model import ModelFunction, interacting_modules, to_device
from .planner import MemoryPlan, PlanError
from .precision import GramPrecision, PrecisionRule, StepPrecision
from .problem import BatchSetup, ModelProblem
from .records import LMInternals, SmallBatchWarning, StepInfo
from .residuals import LossResidual, ModelResidual, describe, from_torch_loss, mse

__all__ = [
    "STATE_FORMAT_VERSION",
    "LMInternals",
    "LevenbergMarquardt",
    "SmallBatchWarning",
    "StepInfo",
]


class _NoTargets:
    """The default of ``step``'s ``targets``: none given (unlike an explicit ``None``)."""

    def __repr__(self) -> str:
        return "<no targets>"


_NO_TARGETS: Any = _NoTargets()

#: The steps in which the small-batch warning looks for a change of batch.
_SMALL_BATCH_STEPS = 10


def _is_torch_loss(obj: object) -> bool:
    """Whether ``obj`` is one of torch's loss modules (or a subclass of one)."""
    if not isinstance(obj, nn.modules.loss._Loss):
        return False
    return any(
        c.__module__ == "torch.nn.modules.loss" and not c.__name__.startswith("_")
        for c in type(obj).__mro__
    )


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
    to :meth:`step`; the result is the step a single process would take on the
    concatenation of the shards, in rank order, up to rounding.  Losses, ``Jᵀr`` and
    ``JᵀJ`` are summed across ranks, so acceptance and damping use the global loss
    and every rank takes the same decisions.  Every rank solves the same summed
    system and then uses rank 0's step, broadcast, so the parameters stay bitwise
    identical on all ranks (:mod:`secondorder.distributed.process_group` explains
    why).  The forms differ in what crosses the network per step: the primal form
    sums the n×n Gram; ``solver="cg"`` keeps each rank's Jacobian rows where they
    were computed and sums one n-vector per CG iteration; the dual form and
    ``solver="qr"`` gather all m rows of J onto every rank
    (:mod:`secondorder.lm.sharded`).  At construction the ranks check that
    they hold the same parameter names, shapes and dtype and the same settings
    (a :class:`ValueError` names what differs), and rank 0's parameter values are
    broadcast to the others, as DDP does.  Buffers are not synchronised, and a
    BatchNorm in training mode normalises with its own rank's shard, as under DDP
    without ``SyncBatchNorm``; such a model matches the single-process run only in
    eval mode.  Every rank must call :meth:`step` the same number of times with
    at least one sample; a rank that dies makes the others raise
    :class:`~secondorder.distributed.CollectiveError` within the process group's
    ``timeout``.

    **Several devices in one process.**  With ``devices=[d0, d1, ...]`` the model is
    replicated on each device (the model itself serves the first entry on its own
    device; every other entry gets a ``copy.deepcopy`` moved there), the batch's
    slices go to the devices in turn (slice i to ``devices[i % len(devices)]``), and
    each device's share of the normal equations is brought to ``solver_device``:
    one n×n Gram per device in the primal form, the Jacobian rows of its slices in
    the dual form and for QR and CG.  Without a ``slice_size``, slices are at most
    ``ceil(batch / len(devices))`` samples, so every device gets work; samples that
    interact (BatchNorm in training mode, a
    :class:`~secondorder.lm.residuals.ModelResidual`) are never sliced and run on the
    first device.  Inputs and targets may arrive on any device; each slice is moved
    to its own.  The result is the step one device would take, up to the order in
    which the per-device Grams are added (the dual form, QR and CG give the same
    bits).  The user's model stays where it is and holds the
    parameters; each step starts by copying its parameters, buffers and train/eval
    modes into the replicas (read-only, as :attr:`replicas`), and an accepted
    update is written to the model and to every replica.  On CUDA, slices are
    copied from pinned memory on a side stream per device, ahead of their
    computation.  ``residual_fn`` must run on every listed device.  This composes
    with several processes: each rank spreads its own shard over its own devices
    (with NCCL, make ``solver_device`` the rank's GPU).
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
        if _is_torch_loss(residual_fn):
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
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"model {type(model).__name__} has no trainable parameters "
                "(none with requires_grad=True)"
            )
        meta = [k for k, p in named if p.is_meta]
        if meta:
            raise ValueError(
                f"model {type(model).__name__} has parameters on the meta device, which hold "
                f"no values ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}): "
                "materialise them before building the optimizer, e.g. "
                "model.to_empty(device='cpu') and initialise, or "
                "model.load_state_dict(state, assign=True)"
            )
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(
                f"model parameters must share one floating dtype, got {sorted(map(str, dtypes))}"
            )
        devs = {p.device for _, p in named}
        if len(devs) != 1:
            raise ValueError(
                f"model parameters must be on one device, got {sorted(map(str, devs))}"
            )
        group = resolve_devices(devices, solver_device, next(iter(devs)))
        self.reducer = resolve_reducer(reducer, process_group)
        # The ranks of a shared batch check that they built the same optimizer (the
        # identity on one process).
        self._agree_across_ranks(named, residual_fn)
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
        self._choices = Choices(cfg, self._function, self.reducer, self._precision)
        #: The per-batch problem of the last step or plan (see :meth:`internals`).
        self._problem: ModelProblem | None = None
        self._rule = make_damping_rule(
            cfg.damping_rule, cfg.damping_up, cfg.damping_down, cfg.damping_shrink
        )
        self._matrix = make_damping_matrix(cfg.damping_matrix)
        self._damping = DampingState(damping=float(damping))
        self._engine = EngineConfig(
            max_attempts=cfg.max_attempts,
            min_gain_ratio=cfg.min_gain_ratio,
            damping_min=cfg.damping_min,
            damping_max=cfg.damping_max,
            ftol=cfg.ftol,
            xtol=cfg.xtol,
            gtol=cfg.gtol,
            geodesic=cfg.geodesic,
            geodesic_alpha=cfg.geodesic_alpha,
        )
        self._steps = 0
        self._memory_plan: MemoryPlan | None = None
        #: ``residual_fn``'s probe verdict per batch signature (see :mod:`.batch`).
        self._probes = ProbeCache()
        #: Whether the small-batch warning was given (once per optimizer).
        self._warned_small_batch = False
        #: A fingerprint of the last step's inputs, to tell mini-batches from one batch.
        self._last_batch: tuple[Any, ...] | None = None
        self._batch_marker: Tensor | None = None

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

    def _agree_across_ranks(
        self,
        named: list[tuple[str, nn.Parameter]],
        residual_fn: Callable[..., Tensor] | ModelResidual,
    ) -> None:
        """Check that the ranks built the same optimizer; give them rank 0's parameters."""
        settings: dict[str, Any] = {
            "parameter names": [k for k, _ in named],
            "parameter shapes": [tuple(p.shape) for _, p in named],
            "parameter dtype": str(named[0][1].dtype),
            # A mapped torch loss names the loss and its parameters.
            "residual_fn": repr(residual_fn)
            if isinstance(residual_fn, LossResidual)
            else getattr(residual_fn, "__qualname__", type(residual_fn).__qualname__),
        }
        # slice_size and memory_budget only change how a rank walks its own shard.
        local_only = ("slice_size", "memory_budget")
        for key, value in asdict(self.config).items():
            if key not in local_only:
                settings[key] = str(value) if isinstance(value, torch.dtype) else value
        self.reducer.check_agree(settings, "LevenbergMarquardt settings")
        with torch.no_grad():
            self.reducer.broadcast_([p.data for _, p in named])

    # -- properties --------------------------------------------------------------------
    @property
    def damping(self) -> float:
        """The current λ."""
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
        self, inputs: Any, targets: Any = _NO_TARGETS, *, slice_size: int | None = None
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
        inputs, targets = _unpack_batch(inputs, targets)
        try:
            setup, _, _ = self._setup(inputs, targets, slice_size)
        except PlanError as exc:
            return exc.plan
        self._problem = ModelProblem(self._function, setup)
        assert self._memory_plan is not None
        return self._memory_plan

    def step(  # type: ignore[override]
        self, inputs: Any, targets: Any = _NO_TARGETS, *, slice_size: int | None = None
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
        ``jacobian="auto"``'s choices) are exactly as before.  Under
        ``torch.no_grad()`` or ``torch.inference_mode()`` the step is the same: it
        needs gradients and turns them on for its own duration.
        """
        inputs, targets = _unpack_batch(inputs, targets)
        # Which batch this is, before inference tensors are cloned (see _check_batch_size).
        self._batch_marker = next(
            (t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)), None
        )
        saved = self._snapshot()
        try:
            # Like torch.optim's steps, a step works inside no_grad/inference_mode; it
            # differentiates the model, so it enables autograd for its own duration.
            with torch.inference_mode(False), torch.enable_grad():
                inputs, targets = _outside_inference(inputs), _outside_inference(targets)
                return self._step(inputs, targets, slice_size)
        except BaseException:
            # KeyboardInterrupt included: the attempts before the failure raised λ and
            # moved the damping rule's state; a failed step must leave no trace.
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
        t_start = time.perf_counter()
        setup, m_total, lr = self._setup(inputs, targets, slice_size)
        if setup.form == "primal":
            self._check_batch_size(m_total)
        for replica in self.replicas:
            sync_replica(self.model, replica)
        x = self._function.flat().to(self._function.group.solver)
        rule, damping = self._precision, self._damping.damping
        if setup.form == "primal":
            # The Gram is formed while J is computed: its precision comes first.
            setup = replace(setup, precision=rule.primal(damping, m_total))
        prob = self._problem = ModelProblem(self._function, setup)
        system = prob.linearize(x)
        t_lin = time.perf_counter()
        finite, loss_sum, _ = system.scalars()
        precision = setup.precision
        if setup.form == "dual":
            # The dual matrix is formed by the solver, from J and its measured scale.
            precision = rule.dual(damping, system.dual_scale_value() if rule.varies else None)
        if not finite:
            return self._refuse(prob, system, precision, loss_sum, t_start, t_lin)
        out = iterate(
            prob,
            x,
            system,
            solver=prob.solver,
            rule=self._rule,
            matrix=self._matrix,
            state=self._damping,
            config=self._engine,
            lr=lr,
            precision=precision,
        )
        t_iter = time.perf_counter()
        if out.accepted:
            self._accept(out.x, inputs)
        self._steps += 1
        timings = {"linearize": t_lin - t_start, "solve_and_trials": t_iter - t_lin}
        return self._info(prob, system, precision, out, timings, t_start)

    def _check_batch_size(self, m_total: int) -> None:
        """Warn, once, when primal mini-batches have fewer residuals than parameters.

        With m < n residuals, J has rank at most m: each step fits the batch it is
        given, and training on a stream of such batches progresses slowly; the
        primal form also factors an n×n matrix for it where the dual form solves
        the same step with an m×m one.  One batch stepped repeatedly (a fit) is
        fine, so the warning waits for a second, different batch among the first
        steps (batches are told apart by their shape and two sums, so views of the
        same data count as the same batch).
        """
        first = self._batch_marker
        if self._warned_small_batch or m_total >= self._function.n or first is None:
            return
        if self._steps >= _SMALL_BATCH_STEPS:
            return
        with torch.no_grad():
            v = first.detach().to(torch.float64)
            mark = (tuple(first.shape), *torch.stack([v.sum(), (v * v).sum()]).tolist())
        previous, self._last_batch = self._last_batch, mark
        if previous is None or previous == mark:
            return
        self._warned_small_batch = True
        n = self._function.n
        warnings.warn(
            f"LevenbergMarquardt: mini-batches of {m_total} residuals for {n} parameters "
            f"in the primal form: JᵀJ has rank at most {m_total} < {n}, so each step fits "
            "its own batch and training progresses slowly. Use batches of at least "
            f"{n} residuals (a larger batch_size, or the whole data set per step), or "
            "form='dual' (or 'auto'), which solves the same step as an m×m system; for "
            "small mini-batches a first-order optimizer (torch.optim.Adam) fits better. "
            "Shown once per optimizer.",
            SmallBatchWarning,
            stacklevel=4,
        )

    def _refuse(
        self,
        prob: ModelProblem,
        system: NormalEquations,
        precision: StepPrecision,
        loss_sum: float,
        t_start: float,
        t_lin: float,
    ) -> StepInfo:
        """Non-finite residuals or J at the current point: no attempt, λ raised."""
        cfg = self.config
        raise_damping(
            self._rule, self._damping, damping_min=cfg.damping_min, damping_max=cfg.damping_max
        )
        self._steps += 1
        loss = loss_sum / max(system.count, 1)
        reason = prob.nonfinite_reason(system)
        return StepInfo(
            loss=loss,
            loss_before=loss,
            accepted=False,
            terminated=False,
            reason=f"{reason}; step rejected and damping raised",
            damping=self._damping.damping,
            attempts=1,
            gain_ratio=float("nan"),
            step_norm=0.0,
            status=0,
            **self._choices_made(prob, system, precision, None),
            timings={"linearize": t_lin - t_start, "total": time.perf_counter() - t_start},
        )

    def _accept(self, x: Tensor, inputs: Any) -> None:
        """Write an accepted point into the model and its replicas.

        BatchNorm's running statistics are updated by one real forward at the new
        point; if that forward raises (an interrupt), the parameters and buffers are
        put back, so the failed step leaves the model as it was.
        """
        if interacting_modules(self.model):
            old = self._function.flat()
            buffers = [b.clone() for b in self.model.buffers()]
            self._function.write(x)
            try:
                with torch.no_grad():
                    self.model(to_device(inputs, self._function.params[0].device))
            except BaseException:
                self._function.write(old)
                with torch.no_grad():
                    for b, saved in zip(self.model.buffers(), buffers, strict=True):
                        b.copy_(saved)
                raise
        else:
            self._function.write(x)
        for replica in self.replicas:
            sync_replica(self.model, replica)

    @staticmethod
    def _choices_made(
        prob: ModelProblem,
        system: NormalEquations,
        precision: StepPrecision,
        factored: torch.dtype | None,
    ) -> dict[str, Any]:
        """What the step used, by name; ``factored``: the dtype its factorisation formed."""
        dtype: torch.dtype | None = None
        if system.gram is not None:
            dtype = system.gram.dtype
        elif prob.solver.forms_matrix and system.jac is not None:
            dtype = factored or precision.dtype or system.jac.dtype
        return {
            "jacobian": prob.strategy.name,
            "solver": prob.solver.name,
            "form": prob.form,
            "gram_dtype": "" if dtype is None else str(dtype).replace("torch.", ""),
        }

    def _info(
        self,
        prob: ModelProblem,
        system: NormalEquations,
        precision: StepPrecision,
        out: Outcome,
        timings: dict[str, float],
        t_start: float,
    ) -> StepInfo:
        count = max(system.count, 1)
        return StepInfo(
            loss=out.loss_sum / count,
            loss_before=out.loss_sum_before / count,
            accepted=out.accepted,
            terminated=out.stop,
            reason=out.reason,
            damping=self._damping.damping,
            attempts=out.attempts,
            gain_ratio=out.gain_ratio,
            step_norm=out.step_norm,
            status=out.status,
            cg_iterations=out.cg_iterations,
            timings={**timings, "total": time.perf_counter() - t_start},
            **self._choices_made(prob, system, precision, out.matrix_dtype),
        )

    # -- checkpoints ---------------------------------------------------------------------
    def _checkpoint(self) -> Checkpoint:
        return Checkpoint(
            damping=self._damping.damping,
            nu=self._damping.nu,
            scale=self._damping.scale,
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
        ckpt = read_state_dict(
            state_dict,
            self._shapes(),
            self._function.n,
            len(self.param_groups),
            self.config,
            strict=strict,
        )
        p0 = self._function.params[0]
        home = self._function.group.solver
        scale = None if ckpt.scale is None else ckpt.scale.to(device=home, dtype=p0.dtype)
        # Everything is validated and converted: nothing below can fail.
        self._damping = DampingState(damping=ckpt.damping, nu=ckpt.nu, scale=scale)
        self._steps = ckpt.steps
        for group, lr in zip(self.param_groups, ckpt.lrs, strict=True):
            group["lr"] = lr
        self._choices.auto_cache = dict(ckpt.auto_jacobian)


def _unpack_batch(inputs: Any, targets: Any) -> tuple[Any, Any]:
    """``step``'s arguments as ``(inputs, targets)``; loaders and closures refused."""
    if isinstance(inputs, torch.utils.data.DataLoader) or (
        isinstance(inputs, Iterable)
        and not isinstance(inputs, (Tensor, list, tuple, dict, str, bytes))
        and not hasattr(inputs, "__array__")
    ):
        raise TypeError(
            f"step() takes one batch, got a {type(inputs).__name__}: loop over the loader "
            "yourself, for x, y in loader: info = opt.step(x, y) (each call is one LM "
            "iteration on that batch; LM works best on large batches, e.g. "
            "DataLoader(..., batch_size=len(dataset)))"
        )
    if callable(inputs) and not isinstance(inputs, (Tensor, nn.Module)):
        raise TypeError(
            f"step() takes the batch, step(inputs, targets), not a {type(inputs).__name__}: "
            "LevenbergMarquardt evaluates residual_fn(model(inputs), targets) and its "
            "Jacobian itself, so it cannot use a closure that returns a loss; the loss "
            "of the step is in the StepInfo it returns (info.loss)"
        )
    if targets is _NO_TARGETS:
        if isinstance(inputs, (list, tuple)) and len(inputs) == 2:
            # The [x, y] (or (x, y)) a DataLoader yields.
            return inputs[0], inputs[1]
        return inputs, None
    return inputs, targets


def _outside_inference(tree: Any) -> Any:
    """``tree`` with inference tensors (made under ``inference_mode``) cloned.

    Autograd cannot save an inference tensor for the backward pass; a clone made
    outside inference mode is an ordinary tensor with the same values.
    """
    leaves, spec = tree_flatten(tree)
    if not any(isinstance(t, Tensor) and t.is_inference() for t in leaves):
        return tree
    return tree_unflatten(
        [t.clone() if isinstance(t, Tensor) and t.is_inference() else t for t in leaves], spec
    )
