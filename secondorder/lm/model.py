"""A PyTorch model seen as a function of one flat parameter vector.

:class:`ModelFunction` holds what does not change from batch to batch: the model, its
device replicas, the trainable parameters and their layout in the flat vector ``x``,
and the reducer that sums partial results across ranks.  Evaluations are functional:
candidate tensors stand in for the parameters for the duration of one call
(:class:`ModelEvaluator`), so the user's parameters change only when a step is
accepted.  The helpers at the top walk batches that are tensors or trees of tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from ..distributed import Reducer
from ..distributed.devices import DeviceGroup
from .carry import ForwardCarry
from .jacobian import ResidualProgram, outer_product_layers
from .loss_mean import LossMean
from .residuals import ModelResidual

__all__ = [
    "ModelEvaluator",
    "ModelFunction",
    "batch_size_of",
    "frozen_batch_stats",
    "interacting_modules",
    "slice_tree",
    "to_device",
]


def batch_size_of(tree: Any, name: str) -> int:
    """The shared first dimension of the tensors in ``tree``; ``name`` is for errors."""
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


def slice_tree(tree: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of every tensor in ``tree``."""
    return tree_map(lambda t: t[start:stop] if isinstance(t, Tensor) else t, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of ``tree`` on ``device``."""
    return tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, tree)


def _unsqueeze(tree: Any) -> Any:
    return tree_map(lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t, tree)


def interacting_modules(model: nn.Module) -> list[str]:
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
def frozen_batch_stats(model: nn.Module) -> Iterator[None]:
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


class ModelEvaluator:
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
        layers = None if coupled else outer_product_layers(model, names, [own[k] for k in names])
        self.program = ResidualProgram(
            per_sample=None if coupled else self.per_sample,
            batch=self.batch,
            order=tuple(names),
            layers=layers,
            random_modules=tuple(
                m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)
            ),
            forward=None if coupled else self.call,
            residual=None if coupled else self.residual,
            carry=None
            if layers is None
            else ForwardCarry(model, frozenset(id(own[k]) for k in names)),
        )

    def call(self, params: dict[str, Tensor], inputs: Any) -> Tensor:
        """``model(inputs)`` with ``params`` in place of the trainable parameters."""
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
        """The flat residuals of a whole batch at ``params``."""
        if isinstance(self.residual_fn, ModelResidual):
            r = self.residual_fn.fn(lambda z: self.call(params, z), inputs, targets)
            if not isinstance(r, Tensor):
                raise TypeError(
                    f"ModelResidual's fn must return a tensor of residuals, got "
                    f"{type(r).__name__}; join several parts into one (torch.cat of "
                    "their flattened pieces)"
                )
            return r.reshape(-1)
        return self.residual(self.call(params, inputs), targets)

    def residual(self, out: Tensor, targets: Any) -> Tensor:
        """The flat residuals of the model's output ``out`` (a per-sample residual function)."""
        assert not isinstance(self.residual_fn, ModelResidual)
        return self.residual_fn(out, targets).reshape(-1)

    def per_sample(self, params: dict[str, Tensor], x: Any, y: Any) -> Tensor:
        """The flat residuals of one sample (no batch dimension) at ``params``."""
        assert not isinstance(self.residual_fn, ModelResidual)
        out = self.call(params, _unsqueeze(x))
        r = self.residual_fn(out, _unsqueeze(y) if y is not None else None)
        return r.reshape(-1)


class ModelFunction:
    """``x ↦ residual_fn(model(inputs), targets)``: the model's parameters as one flat x.

    ``group`` says where slices are computed: slice ``i`` on entry ``i mod D`` of the
    group, by ``replicas[i mod D]``; the flat point ``x`` and every reduced quantity
    live on the group's solver device.  Built once per optimizer; the per-batch
    :class:`~secondorder.lm.problem.ModelProblem` evaluates through it.
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
        # Plain tuples: Tensor.view parses a tuple faster than a torch.Size.
        self._view_shapes = [tuple(p.shape) for p in params]
        #: Shape, dtype and device of each parameter as built (see :meth:`check_unchanged`).
        self._layout = {
            k: (tuple(p.shape), p.dtype, p.device) for k, p in zip(names, params, strict=True)
        }
        self.numels = [p.numel() for p in params]
        self.n = sum(self.numels)
        self.reducer = reducer
        self.coupled_residual = isinstance(residual_fn, ModelResidual)
        #: The reported loss's denominator where it is not the residual count.
        self.loss_mean = LossMean.of(residual_fn)
        self.group = (
            group if group is not None else DeviceGroup([params[0].device], params[0].device)
        )
        modules = replicas if replicas is not None else [model]
        self.replicas = [ModelEvaluator(m, residual_fn, names) for m in modules]
        homes = [e for e in self.replicas if e.model is model]
        #: The user's model, whose parameters are the optimizer's state.
        self.home = homes[0] if homes else ModelEvaluator(model, residual_fn, names)
        self.program = self.home.program

    def check_unchanged(self) -> None:
        """Raise if the model's trainable parameters are not those x was laid out for.

        The optimizer holds the Parameter objects it was built on: one assigned later
        (``module.weight = nn.Parameter(...)``, a replaced layer), one frozen with
        ``requires_grad_(False)``, or one whose shape, dtype or device changed would
        leave it training stale tensors and reporting a loss that is not the model's.
        Reads only Python attributes: no host synchronisation.
        """
        built = dict(zip(self.names, self.params, strict=True))
        everything = dict(self.model.named_parameters())
        now = {k: p for k, p in everything.items() if p.requires_grad}
        problem = ""
        for name, old in built.items():
            new = now.get(name)
            if new is None:
                problem = (
                    f"parameter {name!r} no longer requires grad (requires_grad_(False))"
                    if name in everything
                    else f"parameter {name!r} is no longer in the model"
                )
            elif new is not old:
                problem = (
                    f"parameter {name!r} was replaced by another Parameter object "
                    "(a parameter or layer assigned after the optimizer was built)"
                )
            else:
                shape, dtype, device = self._layout[name]
                if tuple(old.shape) != shape:
                    problem = f"parameter {name!r} changed shape from {shape} to {tuple(old.shape)}"
                elif (old.dtype, old.device) != (dtype, device):
                    problem = (
                        f"parameter {name!r} moved from {dtype} on {device} "
                        f"to {old.dtype} on {old.device}"
                    )
            if problem:
                break
        else:
            added = [k for k in now if k not in built]
            if added:
                problem = f"parameter {added[0]!r} is new or became trainable (requires_grad=True)"
        if problem:
            raise RuntimeError(
                f"the model changed after the optimizer was built: {problem}. "
                "LevenbergMarquardt optimizes one flat vector of the parameters it was "
                "built with; build a new optimizer for the model as it is now "
                "(its state_dict() carries λ over when the parameter shapes are the same)."
            )

    def unflatten(self, x: Tensor) -> dict[str, Tensor]:
        """The flat vector ``x`` as a name → tensor dict of parameter-shaped views."""
        return dict(zip(self.names, self._chunks(x), strict=True))

    def _chunks(self, x: Tensor) -> list[Tensor]:
        """``x`` cut into parameter-shaped views (a vector's chunk is already one)."""
        chunks = x.split_with_sizes(self.numels)
        return [
            c if len(shape) == 1 else c.view(shape)
            for c, shape in zip(chunks, self._view_shapes, strict=True)
        ]

    def flat(self) -> Tensor:
        """The model's current parameters as one flat vector (a new tensor)."""
        with torch.no_grad():  # nothing to detach: no graph is recorded here
            return torch.cat([p if p.dim() == 1 else p.reshape(-1) for p in self.params])

    def points(self, x: Tensor) -> list[dict[str, Tensor]]:
        """``x`` unflattened on each device entry's device."""
        return [self.unflatten(xk) for xk in self.group.replicate(x)]

    def frozen(self) -> contextlib.ExitStack:
        """:func:`frozen_batch_stats` on every copy of the model."""
        stack = contextlib.ExitStack()
        for m in dict.fromkeys(e.model for e in self.replicas):
            stack.enter_context(frozen_batch_stats(m))
        return stack

    def write(self, x: Tensor) -> None:
        """Copy the flat ``x`` into the model's parameters (an accepted step)."""
        with torch.no_grad():
            torch._foreach_copy_(tuple(self.params), self._chunks(x))
        carry = self.program.carry
        if carry is not None:
            carry.written(x, self.params)
