"""Running the capturable step: its device state, one CUDA graph per batch shape.

:class:`CapturableSteps` owns what the capturable step keeps between calls (λ and ν
as device tensors, whether a step since the last check decided to stop) and runs
:func:`~secondorder.lm.capturable.device_iteration` after the shared linearisation.
On CUDA, a step whose batch has the shape of an earlier one is replayed from a
captured ``torch.cuda.CUDAGraph``: the first step of a shape runs eagerly (the
warm-up), the second captures the step with the batch copied into static buffers
and replays it, later ones copy the batch in and replay.  A few shapes are kept
(:data:`GRAPH_CAPACITY`, least recently used first out).  Where a graph cannot
serve, the same step runs eagerly and says why (:attr:`StepInfo.graph`): not a
CUDA device, several devices or processes (gloo and the reducers' failure
agreement read on the host), or a capture that failed (its error is kept, the shape
is not tried again).  A memory plan that slices J is captured too: the slice size
is part of what a graph is kept for, so a new plan captures anew.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..distributed.devices import sync_replica
from .capturable import device_iteration
from .damping import DampingMatrix, DampingRule, DampingState, DeviceDamping
from .iteration import EngineConfig
from .model import ModelFunction
from .precision import NATIVE, PrecisionRule, StepPrecision
from .problem import BatchSetup, ModelProblem

__all__ = ["GRAPH_CAPACITY", "CapturableSteps", "StepRun"]

#: Batch shapes whose captured step is kept.
GRAPH_CAPACITY = 4


@dataclass
class StepRun:
    """One capturable step: its report (a new float64 vector), the problem and how it ran.

    ``precision``: the Gram's; ``checked``: ``(stopped, status)`` as read on a check
    step (``None`` on the others: the optimizer reads it once the step is done).
    """

    report: Tensor
    problem: ModelProblem
    graph: str
    count: int
    precision: StepPrecision = NATIVE
    checked: tuple[bool, int] | None = None


@dataclass
class _Graph:
    graph: Any
    leaves: list[Tensor]
    report: Tensor
    problem: ModelProblem
    count: int


def _key(setup: BatchSetup, lr: float, modes: tuple[bool, ...]) -> tuple[Any, ...]:
    """What a captured step depends on besides the values it reads.

    ``modes``: ``training`` of each of the model's modules (a BatchNorm or Dropout
    runs other operations in ``eval()``).
    """
    leaves, spec = tree_flatten((setup.inputs, setup.targets))
    shapes = tuple(
        (tuple(t.shape), t.dtype, t.device, t.stride()) if isinstance(t, Tensor) else t
        for t in leaves
    )
    return (
        str(spec),
        shapes,
        lr,
        modes,
        setup.form,
        setup.solver.name,
        type(setup.strategy).__name__,
        setup.slice_size,
        setup.precision.dtype,
        setup.precision.chunk,
    )


class CapturableSteps:
    """The capturable step's state and graphs (see the module docstring)."""

    def __init__(
        self,
        function: ModelFunction,
        *,
        rule: DampingRule,
        matrix: DampingMatrix,
        config: EngineConfig,
        candidates: int,
        state: DampingState,
    ) -> None:
        self.function = function
        self.rule, self.matrix, self.config = rule, matrix, config
        self.candidates = candidates
        device = function.group.solver
        self.state = DeviceDamping.of(state, device)
        #: Whether a step since the last check decided to stop (a device flag).
        self.stop_seen = torch.zeros((), dtype=torch.bool, device=device)
        #: The status of the last step that decided to stop since the last check.
        self.stop_status = torch.zeros((), dtype=torch.float64, device=device)
        #: λ as last read on the host (it picks the Gram's dtype under "auto").
        self.host_damping = float(state.damping)
        self._graphs: OrderedDict[tuple[Any, ...], _Graph] = OrderedDict()
        self._warm: set[tuple[Any, ...]] = set()
        self._failed: dict[tuple[Any, ...], str] = {}

    def check(self) -> tuple[bool, int]:
        """Read, in one host read, whether a step stopped since the last check (and why).

        Returns ``(stopped, status)`` and clears the flag; λ is read with them.
        """
        wide = torch.float64
        stopped, status, damping = torch.stack(
            [self.stop_seen.to(wide), self.stop_status, self.state.damping]
        ).tolist()
        self.host_damping = damping
        self.stop_seen.fill_(False)
        self.stop_status.fill_(0.0)
        return stopped > 0, int(status)

    def load(self, state: DampingState) -> None:
        """Take λ, ν and the scale of a checkpoint, in place; forget a pending stop.

        A stop decided before the load belongs to the run that was replaced.
        """
        self.state.load_(state)
        self.host_damping = float(state.damping)
        self.stop_seen.fill_(False)
        self.stop_status.fill_(0.0)

    def key(self, setup: BatchSetup, lr: float) -> tuple[Any, ...]:
        """What the step on ``setup`` is captured for (a graph is kept per key)."""
        modes = tuple(m.training for m in self.function.model.modules())
        return _key(setup, lr, modes)

    def forget_graphs(self) -> None:
        """Drop every captured step (the state they read was replaced)."""
        self._graphs.clear()
        self._warm.clear()

    def why_eager(self, setup: BatchSetup) -> str | None:
        """Why this step cannot be a graph replay (``None``: it can)."""
        fn = self.function
        if fn.group.solver.type != "cuda":
            return f"not a CUDA device ({fn.group.solver.type})"
        if len(fn.group) > 1:
            return "several devices (devices=): their copies are not captured"
        if not fn.reducer.is_identity:
            return "several processes: the reducer agrees on failures on the host"
        return None

    def step(
        self,
        setup: BatchSetup,
        m_total: int,
        lr: float,
        rule: PrecisionRule,
        write: Callable[[Tensor, Tensor, Any], None],
    ) -> StepRun:
        """One step of the optimizer: the Gram's precision, then the run (no check).

        λ as last read on the host picks the Gram's dtype under ``gram_dtype="auto"``;
        rows kept between steps and a kept forward pass are decided on the host, so
        they are off.
        """
        for replica in self.function.replicas:
            sync_replica(self.function.model, replica.model)
        damping = self.host_damping
        if setup.form == "primal":
            precision = rule.primal(damping, m_total)
        else:
            precision = rule.dual(damping, None)
        run = self.run(replace(setup, precision=precision, pool_rows=False), lr, write)
        run.precision = precision
        return run

    def run(
        self, setup: BatchSetup, lr: float, write: Callable[[Tensor, Tensor, Any], None]
    ) -> StepRun:
        """One capturable step; ``write(x, accepted, inputs)`` updates the model."""
        why = self.why_eager(setup)
        if why is None:
            key = self.key(setup, lr)
            why = self._failed.get(key)
            if why is None:
                return self._graphed(key, setup, lr, write)
        report, problem, count = self._body(setup, lr, write)
        return StepRun(report, problem, f"eager: {why}", count)

    def _body(
        self, setup: BatchSetup, lr: float, write: Callable[[Tensor, Tensor, Any], None]
    ) -> tuple[Tensor, ModelProblem, int]:
        fn = self.function
        x = fn.flat().to(fn.group.solver)
        problem = ModelProblem(fn, setup)
        system = problem.linearize(x)
        out = device_iteration(
            problem,
            x,
            system,
            rule=self.rule,
            matrix=self.matrix,
            state=self.state,
            config=self.config,
            reducer=fn.reducer,
            lr=lr,
            candidates=self.candidates,
            matrix_dtype=setup.precision.dtype,
        )
        write(out.x, out.accepted, setup.inputs)
        out.commit(self.state)
        self.stop_seen.logical_or_(out.stop)
        self.stop_status.copy_(torch.where(out.stop, out.report[6], self.stop_status))
        return out.report, problem, system.count

    def _graphed(
        self,
        key: tuple[Any, ...],
        setup: BatchSetup,
        lr: float,
        write: Callable[[Tensor, Tensor, Any], None],
    ) -> StepRun:
        leaves = [
            t for t in tree_flatten((setup.inputs, setup.targets))[0] if isinstance(t, Tensor)
        ]
        kept = self._graphs.get(key)
        if kept is not None:
            self._graphs.move_to_end(key)
            for static, new in zip(kept.leaves, leaves, strict=True):
                static.copy_(new)
            kept.graph.replay()
            return StepRun(kept.report.clone(), kept.problem, "replayed", kept.count)
        if key not in self._warm:
            # The first step of a shape runs eagerly on a side stream: it initialises
            # the libraries' handles and workspaces a capture must not allocate.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                report, problem, count = self._body(setup, lr, write)
            torch.cuda.current_stream().wait_stream(stream)
            self._warm.add(key)
            return StepRun(report, problem, "eager: warm-up before capture", count)
        statics = [t.clone() for t in leaves]
        static_setup = replace(setup, **_static_batch(setup, statics))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                report, problem, count = self._body(static_setup, lr, write)
        except Exception as exc:  # a capture that fails runs eagerly
            self._failed[key] = f"capture failed ({type(exc).__name__}: {exc})"
            report, problem, count = self._body(setup, lr, write)
            return StepRun(report, problem, f"eager: {self._failed[key]}", count)
        self._graphs[key] = _Graph(graph, statics, report, problem, count)
        while len(self._graphs) > GRAPH_CAPACITY:
            self._graphs.popitem(last=False)
        graph.replay()
        return StepRun(report.clone(), problem, "captured", count)


def _static_batch(setup: BatchSetup, statics: list[Tensor]) -> dict[str, Any]:
    """``inputs`` and ``targets`` of ``setup`` with their tensors replaced by ``statics``."""
    leaves, spec = tree_flatten((setup.inputs, setup.targets))
    it = iter(statics)
    swapped = [next(it) if isinstance(t, Tensor) else t for t in leaves]
    inputs, targets = tree_unflatten(swapped, spec)
    return {"inputs": inputs, "targets": targets}
