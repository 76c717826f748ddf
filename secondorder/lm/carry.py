"""The accepted trial's forward pass, kept for the next linearisation of the same batch.

Fitting a whole data set evaluates the model twice per step on the same inputs: the
trial point's forward pass, then, once that point is accepted, the same pass again to
linearise there.  :class:`ForwardCarry` keeps the trial's pass (recorded with the hooks
the outer-product rule reads, :func:`~secondorder.lm.jacobian.record_trial`) and hands
it to the next linearisation only if nothing that pass depends on has changed:

* the point: the trial's, copied into the model's parameters as the accepted step
  and not changed since (their versions, then their values);
* the inputs: the same tensor objects, not modified in place since (their versions,
  then their values against a copy: writes through ``.data`` or a NumPy array that
  shares their memory do not move versions);
* the model: the same modules, each of a type whose forward depends on nothing but its
  parameters and plain settings (:data:`PLAIN_MODULES`, exact types), with the same
  settings and training flags, and no buffers, frozen parameters or hooks;
* the backend switches that choose kernels (matmul precision, TF32, the per-backend
  float32 precisions of torch's newer API, mkldnn, cudnn, deterministic algorithms),
  the active torch function and dispatch modes, and no autocast.

The values are compared on the device and read with the loss (no host read of their
own); where they differ, the linearisation starts again without the pass.  The
residual function is applied anew to the kept output, so targets and the residual
function itself may change between steps.  A trial is recorded only when the batch
looks repeated (the last two linearisations saw the same input tensors), so training
on a new mini-batch each step pays nothing.  The kept pass holds the model's
activations (what the linearisation's forward pass would allocate) and a copy of the
inputs between steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

__all__ = ["PLAIN_MODULES", "ForwardCarry", "model_state"]

#: Module types (exact, not subclasses) whose output depends only on their input,
#: parameters and public settings of plain Python values.
PLAIN_MODULES: tuple[type[nn.Module], ...] = (
    nn.Sequential,
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.Tanh,
    nn.Sigmoid,
    nn.ReLU,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Softplus,
    nn.Mish,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.Dropout,
)

_PLAIN_VALUES = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return type(value) in _PLAIN_VALUES


def _no_global_hooks() -> bool:
    module = nn.modules.module
    names = (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    return not any(getattr(module, name, None) for name in names)


#: Where torch keeps the per-backend float32 precisions of its newer API (torch 2.9
#: on), read where they exist: ``fp32_precision`` of each of these namespaces.
_PRECISION_PATHS = (
    "",
    "cuda.matmul",
    "cudnn",
    "cudnn.conv",
    "cudnn.rnn",
    "mkldnn",
    "mkldnn.matmul",
    "mkldnn.conv",
    "mkldnn.rnn",
)


def _read(name: str) -> Any:
    """One switch of ``torch.backends`` (``"cuda.matmul.allow_tf32"``), or a marker.

    torch refuses to report some legacy switches once the newer precision API has
    set one (``get_float32_matmul_precision`` and ``cuda.matmul.allow_tf32`` raise
    then); the newer switches are read as well, so the state is still compared.
    """
    obj: Any = torch.backends
    try:
        for part in name.split("."):
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return "unreadable"
    return obj


def _backend_flags() -> tuple[Any, ...]:
    """Global switches that choose the kernels a forward pass runs."""
    try:
        matmul = torch.get_float32_matmul_precision()
    except RuntimeError:  # the legacy and the newer precision API were both used
        matmul = "unreadable"
    return (
        matmul,
        *(_read(f"{path}.fp32_precision".lstrip(".")) for path in _PRECISION_PATHS),
        _read("mkldnn.enabled"),
        _read("cuda.matmul.allow_tf32"),
        _read("cuda.matmul.allow_fp16_reduced_precision_reduction"),
        _read("cuda.matmul.allow_bf16_reduced_precision_reduction"),
        _read("cudnn.enabled"),
        _read("cudnn.allow_tf32"),
        _read("cudnn.deterministic"),
        _read("cudnn.benchmark"),
        torch.are_deterministic_algorithms_enabled(),
    )


def _modes() -> tuple[Any, ...]:
    """The active torch function and dispatch modes (each may change any operation)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return (tuple(_get_current_function_mode_stack()), tuple(_get_current_dispatch_mode_stack()))


def model_state(model: nn.Module, trainable: frozenset[int]) -> tuple[Any, ...] | None:
    """What ``model``'s forward depends on besides its trainable parameters and input.

    A tuple to compare for equality (module identities, types, training flags, public
    settings, the backend flags that choose kernels, the active torch function and
    dispatch modes), or ``None`` where the forward may depend on more: a module
    outside :data:`PLAIN_MODULES`, a setting that is not a plain value, a buffer or a
    frozen parameter (a write through ``.data`` would go unseen), a hook (forward or
    backward, on a module or global), or autocast.  ``trainable``: the ids of the
    parameters the optimizer passes in (compared by value instead).
    """
    if not _no_global_hooks():
        return None
    parts: list[Any] = [_backend_flags(), *_modes()]
    for name, module in model.named_modules(remove_duplicate=False):
        if type(module) not in PLAIN_MODULES:
            return None
        if (
            module._forward_hooks
            or module._forward_pre_hooks
            or module._backward_hooks
            or module._backward_pre_hooks
        ):
            return None
        settings = []
        for key, value in vars(module).items():
            if key.startswith("_"):
                continue
            if not _plain(value):
                return None
            settings.append((key, value))
        if any(t is not None for t in module._buffers.values()):
            return None
        if any(t is not None and id(t) not in trainable for t in module._parameters.values()):
            return None
        parts.append((name, module, tuple(settings)))
    first = next(model.parameters(), None)
    if first is not None and torch.is_autocast_enabled(first.device.type):
        return None
    return tuple(parts)


def _tensor_leaves(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


@dataclass
class _Pass:
    """One recorded forward pass and what it was computed from."""

    point: Tensor  # the flat trial point, as the engine holds it
    version: int  # ... and its version then
    leaves: dict[str, Tensor]  # the point's values, as the graph's leaves
    inputs: list[tuple[Tensor, int]]  # each input tensor and its version
    values: list[Tensor]  # ... and a copy of its values
    state: tuple[Any, ...]
    calls: list[Any]  # the rule's (layer, input, output) per layer call
    out: Tensor  # the model's output, with its graph
    #: The model's parameters and their versions once the point was written into them.
    written: list[tuple[Tensor, int]] | None = None


class ForwardCarry:
    """Keeps one trial's forward pass for the next linearisation (see the module doc).

    Its own checks read no device value: the point is expected to be the model's
    because :meth:`written` saw exactly the trial's tensor copied into the parameters,
    and their versions have not moved since.  Versions miss some writes, so the values
    are compared as well, on the device (:attr:`check`); the linearisation reads the
    answer together with the loss and starts again without the pass where it fails.
    """

    def __init__(self, model: nn.Module, trainable: frozenset[int]) -> None:
        self.model = model
        self.trainable = trainable
        self._kept: _Pass | None = None
        self._last: list[weakref.ref[Tensor]] = []
        #: Whether this step's trials should be recorded (the batch looks repeated).
        self.armed = False
        # Kept passes that went unused in a row, and steps left without recording.
        self._misses = 0
        self._rest = 0
        #: For the pass the last :meth:`take` handed out: whether its point and inputs
        #: still hold their values (a 0-d bool on the device), else ``None``.
        self.check: Tensor | None = None

    def begin(self) -> None:
        """A linearisation starts: nothing armed or pending until the rule's :meth:`take`."""
        self.armed = False
        self.check = None

    def discard(self) -> None:
        """Let go of any kept pass (one a linearisation did not use, or not to keep)."""
        self._kept = None

    def state(self) -> tuple[Any, ...] | None:
        """:func:`model_state` of the model (``None``: nothing may be kept)."""
        return model_state(self.model, self.trainable)

    def keep(
        self, point: Tensor, leaves: dict[str, Tensor], inputs: Any, state: tuple[Any, ...],
        calls: list[Any], out: Tensor,
    ) -> None:  # fmt: skip
        """Keep a trial's pass at the flat ``point`` (replacing any kept before).

        Nothing is kept where ``inputs`` hold anything but tensors.
        """
        leaves_in = tree_flatten(inputs)[0]
        if not all(isinstance(t, Tensor) for t in leaves_in):
            self._kept = None
            return
        held = [(t, t._version) for t in leaves_in]
        values = [t.detach().clone() for t in leaves_in]
        self._kept = _Pass(point, point._version, leaves, held, values, state, calls, out)

    def written(self, x: Tensor, params: Sequence[Tensor]) -> None:
        """``x`` was just copied into ``params`` (an accepted step, or a rollback).

        The kept pass stays only if ``x`` is its point, unchanged, and every parameter
        holds x's dtype (so the copy is exact).
        """
        kept = self._kept
        if kept is None:
            return
        if (
            kept.point is not x
            or x._version != kept.version
            or any(p.dtype != x.dtype for p in params)
        ):
            self._kept = None
            return
        kept.written = [(p, p._version) for p in params]

    def take(self, params: dict[str, Tensor], inputs: Any) -> _Pass | None:
        """The kept pass if the model is still at its point and ``inputs`` are its own.

        Called as the model's point ``params`` is linearised.  Either way nothing
        stays kept.  A pass handed out leaves :attr:`check`, the device-side
        comparison of ``params`` and ``inputs`` with the values it was computed from,
        for the caller to read (and to linearise again where it fails).  Also arms
        the recording of this step's trials when ``inputs`` are the tensors the
        previous linearisation saw.
        """
        kept, self._kept = self._kept, None
        self.check = None
        tensors = _tensor_leaves(inputs)
        last = [ref() for ref in self._last]
        repeated = len(last) == len(tensors) and all(
            a is b for a, b in zip(last, tensors, strict=True)
        )
        self._last = [weakref.ref(t) for t in tensors]
        if kept is not None:
            if self._valid(kept, tensors):
                self._misses = 0
                self.check = self._same_values(kept, params, tensors)
            else:
                self.stale()
                kept = None
        self.armed = repeated and self._rest == 0
        self._rest = max(self._rest - 1, 0)
        return kept

    def stale(self) -> None:
        """A kept pass went unused.

        Recording costs a little more than a plain trial (autograd on): after k
        unused passes in a row, the recording rests 2^k - 1 steps (k at most 4).
        """
        self._misses = min(self._misses + 1, 4)
        self._rest = 2**self._misses - 1

    def _valid(self, kept: _Pass, tensors: list[Tensor]) -> bool:
        """The checks that read no device value: versions, identities, the model."""
        if kept.written is None or len(kept.inputs) != len(tensors):
            return False
        if any(p._version != version for p, version in kept.written):
            return False
        for (held, version), t, value in zip(kept.inputs, tensors, kept.values, strict=True):
            if held is not t or t._version != version:
                return False
            # .data can swap in another shape without moving the version.
            if t.shape != value.shape or t.dtype != value.dtype or t.device != value.device:
                return False
        return self.state() == kept.state

    @staticmethod
    def _same_values(kept: _Pass, params: dict[str, Tensor], tensors: list[Tensor]) -> Tensor:
        """Whether the point and the inputs hold the kept pass's values (a 0-d bool).

        Versions miss writes through ``.data`` and memory shared with NumPy, so the
        values are compared too, on the device; the caller reads the answer with the
        loss (:attr:`~secondorder.lm.linalg.NormalEquations.carry_check`).  Shapes
        match already: the parameters' layout is fixed, and :meth:`_valid` checked the
        inputs'.
        """
        same = torch.ones((), dtype=torch.bool, device=kept.out.device)
        for name, value in params.items():
            same = same & (kept.leaves[name].detach() == value.detach()).all().to(same.device)
        for old, value in zip(kept.values, tensors, strict=True):
            same = same & (old == value.detach()).all().to(same.device)
        return same
