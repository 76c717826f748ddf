"""The Levenberg-Marquardt optimizer for PyTorch models.

:class:`LevenbergMarquardt` wires the parts together: a Jacobian strategy computes the
rows of J slice by slice, the slices are reduced into one :class:`NormalEquations`
record (through a reducer, the only stage that would talk to other processes), a
linear solver factors it once, and :func:`secondorder.engine.iterate` runs the damped
attempts.  Trial points are evaluated functionally: candidate tensors stand in for
the parameters for the duration of one call.  The model's own parameters are
written once, when a step is accepted, so an exception anywhere in a step leaves
them untouched.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jvp, vjp
from torch.utils._pytree import tree_flatten, tree_map

from ..distributed import Reducer, resolve_reducer
from ..distributed.devices import DeviceGroup, replicate_module, resolve_devices, sync_replica
from .backends import make_backend_solver
from .config import LMConfig
from .damping import DampingState, make_damping_matrix, make_damping_rule
from .engine import EngineConfig, iterate
from .jacobian import JacobianStrategy, ResidualProgram, linear_layers, make_jacobian
from .linalg import LinearSolver, NormalEquations, gram_update, make_solver
from .planner import (
    USABLE_FRACTION,
    MemoryPlan,
    PlanError,
    available_memory,
    plan_memory,
)
from .precision import GramPrecision
from .residuals import ModelResidual, mse
from .sharded import BroadcastSolver, ShardedCGSolver, ShardedNormalEquations

__all__ = ["LevenbergMarquardt", "StepInfo"]

STATE_FORMAT_VERSION = 1


@dataclass
class StepInfo:
    """What :meth:`LevenbergMarquardt.step` did.

    Attributes:
        loss: mean of squared residual entries at the parameters the step ends with.
        loss_before: the same at the parameters the step started from.
        accepted: whether an update was applied to the model.
        terminated: whether the optimizer considers training finished; ``reason``
            says why (a convergence test, λ at its maximum, attempts exhausted).
        reason: a human-readable account of how the step ended.
        damping: λ after the step.
        attempts: number of λ values tried.
        gain_ratio: ρ of the last attempt.
        step_norm: ‖δ‖ of the applied update (0 if none).
        status: scipy-style code: 1 gtol, 2 ftol, 3 xtol, 4 ftol and xtol, else 0.
        jacobian, solver, form: the strategy, solver and form that were used.
        gram_dtype: dtype of the normal matrix (``JᵀJ`` or ``JD⁻¹Jᵀ``) and its
            factorisation this step (``"float32"``, ``"float64"``); ``""`` for CG,
            which forms no matrix.
        cg_iterations: CG iterations spent in the step (CG solver only).
        timings: seconds per stage (``"linearize"``, ``"solve_and_trials"``, ``"total"``).
    """

    loss: float
    loss_before: float
    accepted: bool
    terminated: bool
    reason: str
    damping: float
    attempts: int
    gain_ratio: float
    step_norm: float
    status: int
    jacobian: str
    solver: str
    form: str
    cg_iterations: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    gram_dtype: str = ""


def _set_solver_dtype(solver: LinearSolver, dtype: torch.dtype) -> None:
    """Make ``solver`` (or the solver a distributed wrapper runs) factor in ``dtype``."""
    inner = getattr(solver, "inner", solver)
    if hasattr(inner, "dtype"):
        inner.dtype = dtype


def _normal_matrix_dtype(solver: LinearSolver, system: NormalEquations) -> str:
    """The dtype the step's normal matrix is formed and factored in, as a name."""
    if system.gram is not None:
        return str(system.gram.dtype).replace("torch.", "")
    inner = getattr(solver, "inner", solver)
    if not hasattr(inner, "dtype") or system.jac is None:
        return ""
    dtype = inner.dtype or system.jac.dtype
    return str(dtype).replace("torch.", "")


def _batch_size(tree: Any, name: str) -> int:
    leaves, _ = tree_flatten(tree)
    tensors = [t for t in leaves if isinstance(t, Tensor)]
    if not tensors:
        raise TypeError(f"{name} must be a tensor or a tuple/list/dict of tensors, got {tree!r}")
    if any(t.ndim == 0 for t in tensors):
        raise ValueError(f"{name} must have a batch dimension; got a 0-d tensor")
    sizes = {int(t.shape[0]) for t in tensors}
    if len(sizes) != 1:
        raise ValueError(
            f"all tensors in {name} must share the batch size, got sizes {sorted(sizes)}"
        )
    return sizes.pop()


def _slice(tree: Any, start: int, stop: int) -> Any:
    return tree_map(lambda t: t[start:stop] if isinstance(t, Tensor) else t, tree)


def _to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, tree)


def _unsqueeze(tree: Any) -> Any:
    return tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, tree)


def _interacting_modules(model: nn.Module) -> list[str]:
    """Modules whose output for a sample depends on the other samples of the batch.

    A BatchNorm normalises with the batch's statistics in training mode, and in eval
    mode too when it keeps no running statistics (``track_running_stats=False``).
    """
    return [
        name or type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None)
    ]


@contextlib.contextmanager
def _frozen_batch_stats(model: nn.Module) -> Iterator[None]:
    """Evaluate BatchNorm with batch statistics but without touching its running stats.

    The optimizer evaluates the model many times per step (Jacobian, trials); those
    evaluations must not each update the running statistics.  With
    ``track_running_stats`` off, a BatchNorm in training mode normalises with the
    batch's statistics (the same output) and leaves its buffers alone.
    """
    changed = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    for m in changed:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in changed:
            m.track_running_stats = True


class _Evaluator:
    """Functional evaluation of one copy of the model: the user's, or a device replica.

    Evaluations swap tensors into the copy's parameter slots for the duration of one
    call, so the same module serves any point ``x``.
    """

    def __init__(
        self,
        model: nn.Module,
        residual_fn: Callable[..., Tensor] | ModelResidual,
        names: list[str],
    ) -> None:
        self.model = model
        self.residual_fn = residual_fn
        # Every place a trainable parameter lives, tied copies included: (module, attribute,
        # canonical name).  Evaluations swap tensors into these slots and restore the
        # original Parameter objects afterwards, so the user's references stay valid
        # (torch.func.functional_call replaces tied parameters by new objects).
        own = dict(model.named_parameters())
        canonical = {id(own[name]): name for name in names}
        self.slots = [
            (module, attr, canonical[id(p)])
            for _, module in model.named_modules(remove_duplicate=False)
            for attr, p in module._parameters.items()
            if p is not None and id(p) in canonical
        ]
        coupled = isinstance(residual_fn, ModelResidual)
        self.program = ResidualProgram(
            per_sample=None if coupled else self.per_sample,
            batch=self.batch,
            order=tuple(names),
            layers=None if coupled else linear_layers(model, names, [own[k] for k in names]),
        )

    def call(self, params: dict[str, Tensor], inputs: Any) -> Tensor:
        originals = [module._parameters[attr] for module, attr, _ in self.slots]
        try:
            for module, attr, name in self.slots:
                module._parameters[attr] = params[name]
            out: Tensor = self.model(inputs)
        finally:
            for (module, attr, _), original in zip(self.slots, originals, strict=True):
                module._parameters[attr] = original
        return out

    def batch(self, params: dict[str, Tensor], inputs: Any, targets: Any) -> Tensor:
        if isinstance(self.residual_fn, ModelResidual):
            r = self.residual_fn.fn(lambda z: self.call(params, z), inputs, targets)
        else:
            r = self.residual_fn(self.call(params, inputs), targets)
        return r.reshape(-1)

    def per_sample(self, params: dict[str, Tensor], x: Any, y: Any) -> Tensor:
        assert not isinstance(self.residual_fn, ModelResidual)
        out = self.call(params, _unsqueeze(x))
        r = self.residual_fn(out, _unsqueeze(y) if y is not None else None)
        return r.reshape(-1)


class _ModelProblem:
    """The residuals of ``residual_fn(model(inputs), targets)`` as functions of a flat x.

    ``group`` says where slices are computed: slice ``i`` on entry ``i mod D`` of the
    group, by ``replicas[i mod D]``; the flat point ``x`` and every reduced quantity
    live on the group's solver device.
    """

    def __init__(
        self,
        model: nn.Module,
        residual_fn: Callable[..., Tensor] | ModelResidual,
        names: list[str],
        params: list[nn.Parameter],
        reducer: Reducer,
        group: DeviceGroup | None = None,
        replicas: list[nn.Module] | None = None,
    ) -> None:
        self.model = model
        self.residual_fn = residual_fn
        self.names = names
        self.params = params
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.n = sum(self.numels)
        self.reducer = reducer
        self.coupled_residual = isinstance(residual_fn, ModelResidual)
        self.group = (
            group if group is not None else DeviceGroup([params[0].device], params[0].device)
        )
        modules = replicas if replicas is not None else [model]
        self.replicas = [_Evaluator(m, residual_fn, names) for m in modules]
        homes = [e for e in self.replicas if e.model is model]
        #: The user's model, whose parameters are the optimizer's state.
        self.home = homes[0] if homes else _Evaluator(model, residual_fn, names)
        self.program = self.home.program
        self.inputs: Any = None
        self.targets: Any = None
        self.batch_size = 0
        self.slice_size = 1
        self.strategy: JacobianStrategy = make_jacobian("reverse")
        self.solver: LinearSolver = make_solver("cholesky")
        self.form = "primal"
        self.gram_dtype: torch.dtype | None = None
        #: Whether ``linearize`` measures the scale of ``J D⁻¹ Jᵀ`` (dual form, "auto").
        self.dual_scale = False
        #: Whether the last linearisation gathered every rank's rows of J (dual, QR).
        self.rows_gathered = False

    # -- functional evaluation --------------------------------------------------------
    def unflatten(self, x: Tensor) -> dict[str, Tensor]:
        return {
            name: chunk.view(shape)
            for name, chunk, shape in zip(
                self.names, torch.split(x, self.numels), self.shapes, strict=True
            )
        }

    def _call(self, params: dict[str, Tensor], inputs: Any) -> Tensor:
        return self.home.call(params, inputs)

    def _batch(self, params: dict[str, Tensor], inputs: Any, targets: Any) -> Tensor:
        return self.home.batch(params, inputs, targets)

    def _frozen(self) -> contextlib.ExitStack:
        """:func:`_frozen_batch_stats` on every copy of the model."""
        stack = contextlib.ExitStack()
        for m in dict.fromkeys(e.model for e in self.replicas):
            stack.enter_context(_frozen_batch_stats(m))
        return stack

    def _points(self, x: Tensor) -> list[dict[str, Tensor]]:
        """``x`` unflattened on each entry's device."""
        return [self.unflatten(xk) for xk in self.group.replicate(x)]

    def slices(self) -> Iterator[tuple[Any, Any]]:
        if not self.strategy.per_sample:
            # Samples interact (or the residual needs the model itself): never slice.
            yield self.inputs, self.targets
            return
        step = self.slice_size
        for start in range(0, self.batch_size, step):
            stop = min(start + step, self.batch_size)
            targets = _slice(self.targets, start, stop) if self.targets is not None else None
            yield _slice(self.inputs, start, stop), targets

    # -- the Problem protocol -----------------------------------------------------------
    def linearize(self, x: Tensor) -> NormalEquations:
        group = self.group
        n = self.n
        wide = torch.float64
        loss_sum = torch.zeros((), dtype=wide, device=x.device)
        grad = torch.zeros(n, dtype=x.dtype, device=x.device)
        col_sq = torch.zeros(n, dtype=x.dtype, device=x.device)
        # One partial Gram per device entry, summed on the solver device at the end.
        grams: list[Tensor | None] = [None] * len(group)
        jacs: list[Tensor] = []
        res: list[Tensor] = []
        count = 0
        dual = self.form == "dual"
        store = dual or self.solver.needs_jacobian
        distributed = self.reducer.world_size > 1
        points = self._points(x)
        with self._frozen():
            for k, inputs, targets in group.stage(self.slices()):
                with group.on(k):
                    J, r = self.strategy(self.replicas[k].program, points[k], inputs, targets)
                    J = J.detach()
                    r = r.detach()
                    count += r.numel()
                    part_loss = torch.dot(r.to(wide), r.to(wide))
                    part_grad = J.T @ r
                    if store:
                        part_col = (J * J).sum(0)
                    else:
                        grams[k] = gram_update(grams[k], J, self.gram_dtype)
                # The vectors are added on the solver device in slice order, as one
                # device would add them.
                loss_sum += group.gather(part_loss)
                grad += group.gather(part_grad)
                if store:
                    col_sq += group.gather(part_col)
                    jacs.append(group.gather(J))
                    res.append(group.gather(r))
        gram = group.sum(grams)
        if gram is not None:
            # diag(JᵀJ) comes free with the Gram.
            col_sq = gram.diagonal().to(x.dtype).clone()
        # The residual count travels with the loss: exact in float64 below 2⁵³ entries.
        tally = torch.stack([loss_sum, torch.tensor(float(count), dtype=wide, device=x.device)])
        self.reducer.sum_([tally, grad, col_sq] + ([gram] if gram is not None else []))
        jac = (jacs[0] if len(jacs) == 1 else torch.cat(jacs)) if store else None
        residuals = (res[0] if len(res) == 1 else torch.cat(res)) if store else None
        sharded_rows = bool(getattr(self.solver, "rows_sharded", False))
        self.rows_gathered = distributed and store and not sharded_rows
        if self.rows_gathered:
            # The dual form and QR need every row of J: gather them, residuals riding
            # along as a last column, in rank order (the order of the global batch).
            assert jac is not None and residuals is not None
            both = self.reducer.gather_rows(torch.cat([jac, residuals[:, None]], dim=1))
            jac, residuals = both[:, :-1], both[:, -1]
        dual_scale = None
        if self.dual_scale and dual and jac is not None:
            # The mean diagonal entry of J diag(col_sq)⁻¹ Jᵀ: its trace, the count of
            # nonzero columns, over the number of rows.  No pass over J.
            tiny = torch.finfo(col_sq.dtype).tiny
            dual_scale = (col_sq > tiny).sum().to(torch.float64) / max(jac.shape[0], 1)
        if not distributed:
            return NormalEquations(
                loss_sum=tally[0],
                count=count,
                grad=grad,
                col_sq=col_sq,
                gram=gram,
                jac=jac,
                residuals=residuals,
                dual=dual,
                dual_scale=dual_scale,
            )
        return ShardedNormalEquations(
            loss_sum=tally[0],
            count=int(tally[1]),
            grad=grad,
            col_sq=col_sq,
            gram=gram,
            jac=jac,
            residuals=residuals,
            dual=dual,
            dual_scale=dual_scale,
            reducer=self.reducer,
            rows_sharded=store and sharded_rows,
        )

    def loss_sum(self, x: Tensor) -> Tensor:
        group = self.group
        points = self._points(x)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        with torch.no_grad(), self._frozen():
            for k, inputs, targets in group.stage(self.slices()):
                with group.on(k):
                    r = self.replicas[k].batch(points[k], inputs, targets).to(torch.float64)
                    part = torch.dot(r, r)
                total += group.gather(part)
        self.reducer.sum_([total])
        return total

    def second_directional(
        self, x: Tensor, v: Tensor, system: NormalEquations
    ) -> tuple[Tensor, Tensor | None]:
        group = self.group
        points = self._points(x)
        tangents = [self.unflatten(vk) for vk in group.replicate(v)]
        rvvs: list[Tensor] = []
        b = torch.zeros_like(x)
        with self._frozen():
            for k, inputs, targets in group.stage(self.slices()):
                params, tangent = points[k], tangents[k]

                def f(
                    p: dict[str, Tensor],
                    inputs: Any = inputs,
                    targets: Any = targets,
                    ev: _Evaluator = self.replicas[k],
                ) -> Tensor:
                    return ev.batch(p, inputs, targets)

                def jv(
                    p: dict[str, Tensor],
                    f: Callable[..., Tensor] = f,
                    tangent: dict[str, Tensor] = tangent,
                ) -> Tensor:
                    out: Tensor = jvp(f, (p,), (tangent,))[1]
                    return out

                with group.on(k):
                    rvv = jvp(jv, (params,), (tangent,))[1].detach()
                    if system.jac is None:
                        (ct,) = vjp(f, params)[1](rvv)
                        part = torch.cat([ct[name].reshape(-1) for name in self.names]).detach()
                rvvs.append(group.gather(rvv))
                if system.jac is None:
                    b += group.gather(part)
        w = torch.cat(rvvs)
        if self.rows_gathered:
            # J holds every rank's rows: gather r_vv the same way, and Jᵀr_vv is then
            # already the global product.
            assert system.jac is not None
            w = self.reducer.gather_rows(w[:, None])[:, 0]
            return system.jac.T @ w.to(system.jac.dtype), w
        if system.jac is not None:
            b = system.jac.T @ w.to(system.jac.dtype)
        self.reducer.sum_([b])
        return b, w


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
            one of :mod:`secondorder.residuals`, or a
            :class:`~secondorder.residuals.ModelResidual` for residuals that need the
            model itself (physics-informed losses).  Default :func:`~.residuals.mse`.
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
        **options: every other field of :class:`~secondorder.config.LMConfig`
            (``damping_rule``, ``damping_matrix``, ``jacobian``, ``solver``, ``form``,
            ``max_attempts``, ``slice_size``, ``geodesic``, ``ftol``/``xtol``/``gtol``,
            ``gram_dtype``, ...).

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
    (:mod:`secondorder.distributed.solve`).  At construction the ranks check that
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
    :class:`~secondorder.residuals.ModelResidual`) are never sliced and run on the
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
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}: {model!r}"
            )
        if not (callable(residual_fn) or isinstance(residual_fn, ModelResidual)):
            raise TypeError(f"residual_fn must be callable, got {residual_fn!r}")
        try:
            self.config = LMConfig(lr=lr, damping=damping, **options)
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
        if self.reducer.world_size > 1:
            self._agree_across_ranks(named, residual_fn)
        super().__init__([p for _, p in named], {"lr": lr})
        self.model = model
        self.residual_fn = residual_fn
        #: Whether inputs may arrive on any device (they are moved slice by slice).
        self._any_device = devices is not None
        self._problem = _ModelProblem(
            model,
            residual_fn,
            [k for k, _ in named],
            [p for _, p in named],
            self.reducer,
            group,
            replicate_module(model, group.devices),
        )
        cfg = self.config
        self._rule = make_damping_rule(cfg.damping_rule, cfg.damping_up, cfg.damping_down)
        self._matrix = make_damping_matrix(cfg.damping_matrix)
        self._precision = GramPrecision(cfg.gram_dtype, cfg.gram_auto_tol, cfg.damping_matrix)
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
        #: Jacobian strategies chosen by ``jacobian="auto"``, per input signature.
        self._auto_cache: dict[str, str] = {}
        self._validated: set[str] = set()
        self._memory_plan: MemoryPlan | None = None

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
            "residual_fn": getattr(residual_fn, "__qualname__", type(residual_fn).__qualname__),
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
        return self._problem.group.devices

    @property
    def solver_device(self) -> torch.device:
        """Where the normal equations are reduced and solved."""
        return self._problem.group.solver

    @property
    def replicas(self) -> tuple[nn.Module, ...]:
        """The copy of the model that computes on each entry of :attr:`devices`."""
        return tuple(e.model for e in self._problem.replicas)

    @property
    def num_parameters(self) -> int:
        """Number of trainable scalars (columns of J)."""
        return self._problem.n

    # -- step ----------------------------------------------------------------------------
    def _validate(self, inputs: Any, targets: Any) -> tuple[int, int]:
        """Check the batch before anything changes; return (batch size, residual count)."""
        batch = _batch_size(inputs, "inputs")
        if batch == 0:
            raise ValueError("inputs is an empty batch (batch size 0)")
        if targets is not None:
            tb = _batch_size(targets, "targets")
            if tb != batch and not self._problem.coupled_residual:
                raise ValueError(
                    f"inputs and targets batch sizes differ: inputs has {batch}, targets has {tb}"
                )
        p0 = self._problem.params[0]
        for leaf in tree_flatten(inputs)[0]:
            if isinstance(leaf, Tensor):
                if leaf.is_floating_point() and leaf.dtype != p0.dtype:
                    raise TypeError(
                        f"inputs dtype {leaf.dtype} does not match the model's parameter dtype "
                        f"{p0.dtype}; convert one of them"
                    )
                if leaf.device != p0.device and not self._any_device:
                    raise ValueError(f"inputs are on {leaf.device} but the model is on {p0.device}")
        for leaf in tree_flatten(targets)[0]:
            if isinstance(leaf, Tensor) and leaf.device != p0.device:
                raise ValueError(f"targets are on {leaf.device} but the model is on {p0.device}")
        probe = batch if self._problem.coupled_residual else min(batch, 2)
        sub_in = _slice(inputs, 0, probe)
        sub_t = None if targets is None else _slice(targets, 0, probe)
        if self._problem.coupled_residual:
            sub_t = targets
        if self._any_device:
            sub_in, sub_t = _to_device((sub_in, sub_t), p0.device)
        params = {
            k: p.detach() for k, p in zip(self._problem.names, self._problem.params, strict=True)
        }
        with torch.no_grad(), _frozen_batch_stats(self.model):
            if self._problem.coupled_residual:
                r = self._problem._batch(params, sub_in, sub_t)
                out = r
            else:
                assert not isinstance(self.residual_fn, ModelResidual)
                out = self.residual_fn(self._problem._call(params, sub_in), sub_t)
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
        if self._problem.coupled_residual:
            if out.numel() == 0:
                raise ValueError("residual_fn returned no residuals")
            return batch, out.numel()
        if out.ndim == 0 or out.shape[0] != probe:
            raise ValueError(
                f"residual_fn must return residuals whose first dimension is the batch "
                f"({probe} for this probe), got shape {tuple(out.shape)}"
            )
        per_sample = out.numel() // probe
        if per_sample == 0:
            raise ValueError("residual_fn returned no residuals")
        return batch, per_sample * batch

    def _signature(self, inputs: Any, m: int) -> str:
        leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)]
        shapes = ",".join(str(tuple(t.shape[1:])) + str(t.dtype) for t in leaves)
        return f"{shapes}|rows_per_sample={m // max(1, leaves[0].shape[0])}"

    def _choose_jacobian(self, batch: int, m: int, signature: str) -> str:
        cfg, n = self.config, self._problem.n
        interacting = _interacting_modules(self.model)
        if cfg.jacobian != "auto":
            if cfg.jacobian in ("reverse", "forward"):
                if self._problem.coupled_residual:
                    raise ValueError(
                        f"jacobian={cfg.jacobian!r} needs per-sample residuals, but residual_fn "
                        "is a ModelResidual; use 'batch_reverse', 'batch_forward' or 'auto'"
                    )
                if interacting:
                    raise ValueError(
                        f"jacobian={cfg.jacobian!r} would compute a wrong per-sample Jacobian: "
                        f"modules {interacting} mix samples (BatchNorm in training mode or "
                        "without running statistics); use 'batch_reverse', 'batch_forward' "
                        "or 'auto', or call model.eval()"
                    )
            return cfg.jacobian
        if self._problem.coupled_residual or interacting:
            return "batch_reverse" if m <= n else "batch_forward"
        if signature in self._auto_cache:
            return self._auto_cache[signature]
        k = max(1, m // batch)
        if 4 * k <= n:
            choice = "reverse"
        elif k >= 4 * n:
            choice = "forward"
        else:
            choice = self._probe_jacobian(batch)
        self._auto_cache[signature] = choice
        return choice

    def _probe_jacobian(self, batch: int) -> str:
        """Time both per-sample modes on a small slice and keep the faster."""
        prob = self._problem
        size = min(batch, 64)
        inputs = _slice(prob.inputs, 0, size)
        targets = None if prob.targets is None else _slice(prob.targets, 0, size)
        # Time it where the Jacobians run: on the first device, with its replica.
        _, inputs, targets = next(prob.group.stage([(inputs, targets)]))
        with torch.no_grad():
            x = torch.cat([p.detach().reshape(-1) for p in prob.params])
        params = prob._points(x)[0]
        program = prob.replicas[0].program
        names = ("reverse", "forward")
        elapsed = torch.zeros(len(names), dtype=torch.float64, device=prob.group.solver)
        with prob._frozen(), prob.group.on(0):
            for i, name in enumerate(names):
                strategy = make_jacobian(name)
                strategy(program, params, inputs, targets)  # warm-up
                t0 = time.perf_counter()
                strategy(program, params, inputs, targets)
                elapsed[i] = time.perf_counter() - t0
        # With several ranks, the summed timings make every rank choose the same mode.
        self.reducer.sum_([elapsed])
        return names[1] if bool(elapsed[1] < elapsed[0]) else names[0]

    def _configure(
        self,
        batch: int,
        m: int,
        inputs: Any,
        slice_size: int | None = None,
        m_total: int | None = None,
    ) -> MemoryPlan:
        """Choose form, solver, Jacobian strategy and slice size for this batch.

        ``m`` counts this rank's residuals, ``m_total`` those of every rank (the
        same on one process); form and solver follow the global problem, so every
        rank chooses alike.  The memory planner (:mod:`secondorder.planner`) resolves
        ``solver="auto"``, ``form="auto"`` and the slice size; a step that cannot fit
        raises :class:`~secondorder.planner.PlanError` here, before J is computed.
        """
        cfg, prob = self.config, self._problem
        m_all = m if m_total is None else m_total
        name = self._choose_jacobian(batch, m, self._signature(inputs, m))
        slice_size = slice_size if slice_size is not None else cfg.slice_size
        plan = self._plan(batch, m, m_all, name, slice_size)
        solver = plan.solver
        prob.form = plan.form
        gram_dtype = self._precision.fixed(prob.params[0].dtype)
        prob.gram_dtype = gram_dtype
        prob.dual_scale = prob.form == "dual" and self._precision.varies(prob.params[0].dtype)
        cg = {"cg_rtol": cfg.cg_rtol, "cg_max_iter": cfg.cg_max_iter, "cg_forcing": cfg.cg_forcing}
        if self.reducer.world_size > 1:
            inner = (
                ShardedCGSolver(self.reducer, cfg.cg_rtol, cfg.cg_max_iter, cfg.cg_forcing)
                if solver == "cg"
                else make_backend_solver(solver, cfg.linalg_backend, gram_dtype, **cg)
            )
            prob.solver = BroadcastSolver(inner, self.reducer)
        else:
            prob.solver = make_backend_solver(solver, cfg.linalg_backend, gram_dtype, **cg)
        prob.slice_size = plan.slice_size
        if slice_size is None and len(prob.group) > 1:
            # At least one slice per device, or some devices would sit idle.
            prob.slice_size = min(prob.slice_size, -(-batch // len(prob.group)))
        chunk = slice_size if name.startswith("batch") else None
        prob.strategy = make_jacobian(name, chunk)
        self._memory_plan = plan
        return plan

    def _plan(
        self,
        batch: int,
        m: int,
        m_all: int,
        jacobian: str,
        slice_size: int | None,
    ) -> MemoryPlan:
        """The memory plan of this step; raise :class:`PlanError` if it cannot fit."""
        cfg, prob = self.config, self._problem
        p0 = prob.params[0]
        available: int | None = cfg.memory_limit
        source = "memory_limit"
        if available is None:
            free, where = available_memory(p0.device)
            available = None if free is None else int(free * USABLE_FRACTION)
            source = where if free is None else f"{USABLE_FRACTION:.0%} of {where}"

        def agree(fits: list[bool]) -> list[bool]:
            # Every rank must pick the same solver and form: a candidate counts as
            # fitting only where it fits on every rank.
            flags = torch.tensor([0.0 if f else 1.0 for f in fits], dtype=torch.float64)
            flags = flags.to(p0.device)
            self.reducer.sum_([flags])
            return [bool(v == 0) for v in flags]

        plan = plan_memory(
            parameters=prob.n,
            samples=batch,
            rows=m,
            rows_total=m_all,
            dtype=p0.dtype,
            gram_dtype=self._precision.fixed(p0.dtype) or torch.float64,
            jacobian=jacobian,
            # An array-module backend exists to factor matrices too big for torch, and
            # offers no CG: under "auto" it always factors.
            solver="cholesky"
            if cfg.solver == "auto" and cfg.linalg_backend != "torch"
            else cfg.solver,
            form=cfg.form,
            slice_size=slice_size,
            memory_budget=cfg.memory_budget,
            available=available,
            available_source=source,
            world_size=self.reducer.world_size,
            agree=agree if self.reducer.world_size > 1 else None,
        )
        if not plan.fits:
            raise PlanError(plan)
        return plan

    def plan(
        self, inputs: Any, targets: Any = None, *, slice_size: int | None = None
    ) -> MemoryPlan:
        """The memory plan :meth:`step` would follow on this batch, without stepping.

        The batch is validated as :meth:`step` validates it and the ``"auto"`` choices
        are resolved (``jacobian="auto"`` may time both modes on a few samples, as
        :meth:`step` would), but J is not computed and nothing is updated.  The plan
        is returned even when it does not fit (``plan.fits`` is False and
        ``plan.advice`` lists what would); :meth:`step` raises
        :class:`~secondorder.planner.PlanError` for it.  ``print(opt.plan(x, y))``
        shows the bytes of each stage.  With several ranks, call it on every rank.
        """
        batch, m, m_total, _ = self._check_step(inputs, targets, slice_size)
        prob = self._problem
        prob.inputs, prob.targets, prob.batch_size = inputs, targets, batch
        try:
            return self._configure(batch, m, inputs, slice_size, m_total)
        except PlanError as exc:
            return exc.plan

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The :class:`~secondorder.planner.MemoryPlan` of the last step (or plan)."""
        return self._memory_plan

    def step(  # type: ignore[override]
        self, inputs: Any, targets: Any = None, *, slice_size: int | None = None
    ) -> StepInfo:
        """Run one LM iteration on this batch and return what it did.

        ``slice_size`` overrides the configured samples per Jacobian slice for this
        call only.  The model's parameters are written only if a step is accepted; if anything
        raises during the step (the model, the residual function, an interrupt), they
        are exactly as before.
        """
        t_start = time.perf_counter()
        batch, m, m_total, lr = self._check_step(inputs, targets, slice_size)
        prob = self._problem
        prob.inputs, prob.targets, prob.batch_size = inputs, targets, batch
        self._configure(batch, m, inputs, slice_size, m_total)
        for replica in self.replicas:
            sync_replica(self.model, replica)
        with torch.no_grad():
            x = torch.cat([p.detach().reshape(-1) for p in prob.params]).to(prob.group.solver)
        dtype = prob.params[0].dtype
        adaptive = self._precision.varies(dtype)
        if adaptive and prob.form == "primal":
            prob.gram_dtype = self._precision.choose(dtype, self._damping.damping, m_total)
            _set_solver_dtype(prob.solver, prob.gram_dtype)
        system = prob.linearize(x)
        t_lin = time.perf_counter()
        finite, loss_sum, _ = system.scalars()
        if adaptive and prob.form == "dual":
            scale = system.dual_scale_value()
            _set_solver_dtype(
                prob.solver,
                self._precision.choose(
                    dtype, self._damping.damping, prob.n, math.inf if scale is None else scale
                ),
            )
        base: dict[str, Any] = {
            "jacobian": prob.strategy.name,
            "solver": prob.solver.name,
            "form": prob.form,
            "gram_dtype": _normal_matrix_dtype(prob.solver, system),
        }
        if not finite:
            self._rule.reject(self._damping)
            self._damping.damping = min(
                max(self._damping.damping, self.config.damping_min), self.config.damping_max
            )
            self._steps += 1
            loss = loss_sum / max(system.count, 1)
            return StepInfo(
                loss=loss,
                loss_before=loss,
                accepted=False,
                terminated=False,
                reason="non-finite residuals or Jacobian at the current parameters; "
                "step rejected and damping raised",
                damping=self._damping.damping,
                attempts=1,
                gain_ratio=float("nan"),
                step_norm=0.0,
                status=0,
                **base,
                timings={"linearize": t_lin - t_start, "total": time.perf_counter() - t_start},
            )
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
        )
        t_iter = time.perf_counter()
        if out.accepted:
            self._write(out.x)
            if _interacting_modules(self.model):
                # One real forward updates BatchNorm running statistics at the new point.
                with torch.no_grad():
                    self.model(_to_device(inputs, prob.params[0].device))
            for replica in self.replicas:
                sync_replica(self.model, replica)
        self._steps += 1
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
            timings={
                "linearize": t_lin - t_start,
                "solve_and_trials": t_iter - t_lin,
                "total": time.perf_counter() - t_start,
            },
            **base,
        )

    def _check_step(
        self, inputs: Any, targets: Any, slice_size: int | None
    ) -> tuple[int, int, int, float]:
        """Validate the arguments of :meth:`step`: (batch, residuals, all ranks' residuals, lr).

        With several ranks, one small all-reduce tells every rank whether any rank's
        batch was rejected, so that all of them raise (the rejecting rank its own
        error) instead of leaving the others waiting in the next collective.
        """
        error: Exception | None = None
        batch = m = 0
        lr = 0.0
        try:
            if slice_size is not None and (
                isinstance(slice_size, bool) or not isinstance(slice_size, int) or slice_size < 1
            ):
                raise ValueError(f"Invalid slice_size={slice_size!r}: must be an integer >= 1.")
            batch, m = self._validate(inputs, targets)
            lr = float(self.param_groups[0]["lr"])
            if not lr > 0:
                raise ValueError(f"Invalid lr={lr!r} in param_groups[0]: must be > 0.")
        except Exception as exc:
            if self.reducer.world_size == 1:
                raise
            error = exc
        if self.reducer.world_size == 1:
            return batch, m, m, lr
        world = self.reducer.world_size
        tally = torch.zeros(world + 1, dtype=torch.float64, device=self._problem.group.solver)
        tally[self.reducer.rank] = 1.0 if error is not None else 0.0
        tally[world] = float(m)
        self.reducer.sum_([tally])
        if error is not None:
            raise error
        failed = [i for i in range(world) if bool(tally[i] > 0)]
        if failed:
            raise ValueError(
                f"step() rejected the batch on rank(s) {failed} of {world}; see the error "
                "raised there. No rank changed its parameters."
            )
        return batch, m, int(tally[world]), lr

    def _write(self, x: Tensor) -> None:
        with torch.no_grad():
            for p, chunk in zip(
                self._problem.params, torch.split(x, self._problem.numels), strict=True
            ):
                p.copy_(chunk.view_as(p))

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: λ, ν, Moré scale, step count, settings.

        Holds only tensors, numbers, strings, lists and dicts, so it loads with
        ``torch.load(..., weights_only=True)``.
        """
        cfg = asdict(self.config)
        cfg["gram_dtype"] = None if self.config.gram_dtype is None else str(self.config.gram_dtype)
        scale = self._damping.scale
        return {
            "format_version": STATE_FORMAT_VERSION,
            "num_parameters": self._problem.n,
            "parameter_shapes": [list(s) for s in self._problem.shapes],
            "damping": self._damping.damping,
            "nu": self._damping.nu,
            "scale": None if scale is None else scale.clone(),
            "steps": self._steps,
            "lr": [float(g["lr"]) for g in self.param_groups],
            "auto_jacobian": dict(self._auto_cache),
            "config": cfg,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; refuse one from another model or a newer format."""
        if not isinstance(state_dict, dict) or "format_version" not in state_dict:
            raise ValueError(
                "state_dict is not a LevenbergMarquardt state dict (no format_version)"
            )
        version = state_dict["format_version"]
        if version != STATE_FORMAT_VERSION:
            raise ValueError(
                f"state_dict has format_version={version!r}; this secondorder reads "
                f"version {STATE_FORMAT_VERSION}"
            )
        n = state_dict["num_parameters"]
        shapes = [list(s) for s in self._problem.shapes]
        if n != self._problem.n or state_dict["parameter_shapes"] != shapes:
            raise ValueError(
                f"state_dict is for a model with {n} parameters of shapes "
                f"{state_dict['parameter_shapes']}, but this optimizer has {self._problem.n} "
                f"of shapes {shapes}"
            )
        # Validate every field before assigning any, so a malformed checkpoint
        # leaves the optimizer exactly as it was.
        damping, nu, steps, lrs = (state_dict[k] for k in ("damping", "nu", "steps", "lr"))
        for name, value in (("damping", damping), ("nu", nu)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"state_dict has {name}={value!r}: must be a finite number >= 0")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"state_dict has steps={steps!r}: must be an integer >= 0")
        if not isinstance(lrs, (list, tuple)) or len(lrs) != len(self.param_groups):
            raise ValueError(
                f"state_dict has lr={lrs!r}: must hold one value per parameter group "
                f"({len(self.param_groups)})"
            )
        scale = state_dict["scale"]
        p0 = self._problem.params[0]
        home = self._problem.group.solver
        self._damping = DampingState(
            damping=float(damping),
            nu=float(nu),
            scale=None if scale is None else scale.to(device=home, dtype=p0.dtype),
        )
        self._steps = steps
        for group, lr in zip(self.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._auto_cache = dict(state_dict["auto_jacobian"])
