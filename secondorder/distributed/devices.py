r"""Several devices in one process: model replicas, slice dispatch, and the gather.

A batch is cut into slices; slice ``i`` is computed on device ``i mod D`` by that
device's replica of the model, and what each slice contributes to the normal
equations is brought to one *solver device*, where the sums are formed and the
linear system is solved:

.. math:: J^\top J = \sum_{d} \sum_{i \equiv d} J_i^\top J_i, \qquad
          J^\top r = \sum_i J_i^\top r_i .

:class:`DeviceGroup` is the only part of :mod:`secondorder` that moves tensors
between the devices of one process, as :class:`~secondorder.distributed.Reducer`
is the only part that talks to other processes; the optimizer's numerics run
unchanged on top of both.  With a single device the group moves nothing, so one
code path serves one device and many.

What travels, per step:

* the parameters (and each trial point) from the solver device to every device:
  ``n`` numbers per device;
* each slice's inputs and targets to its device;
* per slice, the loss and ``Jᵀr`` (and ``diag(JᵀJ)``) to the solver device, and
  added there in slice order, so these sums have the bits of a single-device run;
* in the primal form, one ``n×n`` Gram per device, accumulated on its device over
  its slices and summed on the solver device in device order.  The order of those
  additions differs from a single device's, so the Gram agrees with it to rounding;
* in the dual form and for QR and CG, which need J itself, every slice's rows, in
  slice order (then the whole system is bitwise that of a single device).

On CUDA, a slice's copy to its device is issued ahead of time on that device's copy
stream, from pinned host memory, so it overlaps the computation of the slice before
it; results travel to the solver device asynchronously while the next slices are
computed.  On other device types none of that runs: copies are plain ``.to()``.
A CPU solver device receives each result synchronously, which makes the devices
wait for one another; a GPU solver device keeps them running side by side.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DeviceGroup", "replicate_module", "resolve_devices", "sync_replica"]


def _as_device(value: Any, name: str) -> torch.device:
    """``value`` as a usable ``torch.device``, or an error naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(
            f"{name} must be a torch.device, a device string such as 'cuda:1', or a device "
            f"index, got {type(value).__name__}: {value!r}"
        )
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"Invalid {name}={value!r}: {exc}") from None
    if dev.type == "meta":
        raise ValueError(f"Invalid {name}={value!r}: a meta device holds no values to compute with")
    if dev.type == "cpu":
        # cpu and cpu:0 are the same memory; parameters report plain cpu.
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"Invalid {name}={value!r}: CUDA is not available in this process")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(
                f"Invalid {name}={value!r}: this process sees {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
        return torch.device("cuda", index)
    try:
        torch.empty(0, device=dev)
    except RuntimeError as exc:
        raise ValueError(f"Invalid {name}={value!r}: {exc}") from None
    return dev


def resolve_devices(devices: Any, solver_device: Any, model_device: torch.device) -> DeviceGroup:
    """The :class:`DeviceGroup` of an optimizer, from its ``devices`` and ``solver_device``.

    ``devices=None`` computes on the model's own device.  ``solver_device=None``
    solves on the first device.  Raises :class:`TypeError` or :class:`ValueError`
    naming the argument and the value before anything is built.
    """
    if devices is None:
        entries = [model_device]
    else:
        if not isinstance(devices, (list, tuple)):
            raise TypeError(
                f"devices must be a list of devices such as ['cuda:0', 'cuda:1'], got "
                f"{type(devices).__name__}: {devices!r}"
            )
        if not devices:
            raise ValueError(
                "Invalid devices=[]: give at least one device, or devices=None to compute "
                "on the model's device."
            )
        entries = [_as_device(v, f"devices[{i}]") for i, v in enumerate(devices)]
    solver = entries[0] if solver_device is None else _as_device(solver_device, "solver_device")
    return DeviceGroup(entries, solver)


#: What ``nn.Module`` keeps in its ``__dict__`` for itself (registries, hooks, the mode).
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
#: Immutable values a replica may share with the model.
_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_MISSING = object()
#: Per replica module: the model's tensor attributes (with their version counters) that
#: its own copies were made from, so an unchanged tensor is not copied again.
_COPIED: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[Tensor, int]]] = (
    weakref.WeakKeyDictionary()
)


def _plain(value: Any) -> bool:
    """An immutable value: an atom, or a tuple or frozenset of them."""
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    return isinstance(value, _ATOMS)


def _attributes(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """The module's own attributes: not its parameters, buffers, submodules or hooks."""
    for key, value in module.__dict__.items():
        if key not in _MODULE_INTERNALS:
            yield key, value


def _sync_attributes(source: nn.Module, replica: nn.Module) -> None:
    """Give ``replica`` the plain values and tensors that ``source`` holds as attributes.

    Immutable values (numbers, strings, dtypes, tuples of them) are shared; a tensor
    is copied (as ``copy.deepcopy`` copied it with the model) when it is another
    object than last time or was changed in place.  Other values (lists, dicts,
    objects) are the replica's own since it was made, and not compared.
    """
    own = replica.__dict__
    copied = _COPIED.setdefault(replica, {})
    for key, value in _attributes(source):
        if own.get(key, _MISSING) is value:
            continue
        if _plain(value):
            own[key] = value
        elif isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
            seen = copied.get(key)
            if seen is None or seen[0] is not value or seen[1] != value._version:
                own[key] = copy.deepcopy(value)
                copied[key] = (value, value._version)


def replicate_module(model: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One copy of ``model`` per entry of ``devices``, each on its device.

    The first entry that names the model's own device gets ``model`` itself, so
    that device holds no second copy; every other entry gets ``copy.deepcopy(model)``
    moved to its device (a device listed twice gets two copies).
    """
    home = next(iter(model.parameters())).device
    out: list[nn.Module] = []
    for dev in devices:
        if dev == home and not any(m is model for m in out):
            out.append(model)
            continue
        try:
            replica = copy.deepcopy(model)
        except Exception as exc:
            raise TypeError(
                f"devices={list(map(str, devices))!r}: the model must be copyable with "
                f"copy.deepcopy to be replicated on each device, but it raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        out.append(replica.to(dev))
        for a_mod, b_mod in zip(model.modules(), replica.modules(), strict=True):
            _COPIED[b_mod] = {
                key: (value, value._version)
                for key, value in _attributes(a_mod)
                if isinstance(value, Tensor) and not isinstance(value, nn.Parameter)
            }
    return out


@torch.no_grad()
def sync_replica(source: nn.Module, replica: nn.Module) -> None:
    """Make ``replica`` equal ``source``: parameters, buffers, modes and plain attributes.

    A plain attribute is an immutable value (``self.k = 3.0``, a string, a tuple) or
    a tensor that is not a parameter or buffer; see :func:`_sync_attributes`.
    """
    if replica is source:
        return
    pairs = [
        *zip(source.parameters(), replica.parameters(), strict=True),
        *zip(source.buffers(), replica.buffers(), strict=True),
    ]
    for a, b in pairs:
        b.copy_(a, non_blocking=_non_blocking(b.device))
    for a_mod, b_mod in zip(source.modules(), replica.modules(), strict=True):
        b_mod.training = a_mod.training
        _sync_attributes(a_mod, b_mod)


def _non_blocking(dst: torch.device) -> bool:
    # Into CUDA memory a copy may run behind the host; into host memory it must not,
    # or the host could read a tensor still in flight.
    return dst.type == "cuda"


class DeviceGroup:
    """The devices of one process that share the slices of a batch, and their solver.

    Args:
        devices: one entry per compute device, in dispatch order (repeats allowed).
        solver: where the sums are formed and the linear system is solved.
    """

    def __init__(self, devices: Sequence[torch.device], solver: torch.device) -> None:
        self.devices = tuple(devices)
        self.solver = solver
        self._copy_streams: dict[torch.device, Any] = {}
        self._solver_non_blocking = _non_blocking(solver)
        #: One device that is also the solver device, not CUDA: :meth:`stage` hands each
        #: slice out at once (no copy stream to overlap with), without the pipeline.
        self._local = len(self.devices) == 1 and self.devices[0] == solver and solver.type != "cuda"

    def __len__(self) -> int:
        return len(self.devices)

    def __repr__(self) -> str:
        names = [str(d) for d in self.devices]
        return f"DeviceGroup(devices={names}, solver={str(self.solver)!r})"

    def owner(self, index: int) -> int:
        """The entry that computes slice ``index``: round robin."""
        return index % len(self.devices)

    def on(self, k: int) -> contextlib.AbstractContextManager[Any]:
        """Make entry ``k``'s device current, for operations that allocate on it."""
        dev = self.devices[k]
        if dev.type == "cuda":
            return torch.cuda.device(dev)
        return contextlib.nullcontext()

    def replicate(self, x: Tensor) -> list[Tensor]:
        """``x`` on every entry's device, in entry order (one copy per distinct device)."""
        copies = {x.device: x}
        out = []
        for dev in self.devices:
            if dev not in copies:
                copies[dev] = x.to(dev, non_blocking=_non_blocking(dev))
            out.append(copies[dev])
        return out

    def gather(self, t: Tensor) -> Tensor:
        """``t`` on the solver device (``t`` itself when it is already there)."""
        if t.device == self.solver:
            return t
        return t.to(self.solver, non_blocking=self._solver_non_blocking)

    def sum(self, parts: Sequence[Tensor | None]) -> Tensor | None:
        """``Σ parts`` on the solver device, in entry order; ``None`` entries are skipped.

        The first part that lives on the solver device is added into in place: the
        parts are scratch partial sums.
        """
        total: Tensor | None = None
        for p in parts:
            if p is None:
                continue
            p = self.gather(p)
            total = p if total is None else total.add_(p)
        return total

    def stage(self, slices: Iterable[tuple[Any, Any]]) -> Iterator[tuple[int, Any, Any]]:
        """Yield ``(entry, inputs, targets)`` for each slice, in order, moved to its device.

        Slice ``i`` goes to entry ``i mod D``.  Each device's next slice is sent
        before the current one is handed out, so on CUDA the copy runs while the
        caller computes; no device holds more than two slices at a time.
        """
        if self._local:
            # Nothing to overlap: each slice is moved (where it is not already on the
            # device) and handed out at once.
            move = _mover(self.devices[0])
            for inputs, targets in slices:
                yield 0, _tree_to(inputs, move), _tree_to(targets, move)
            return
        pending: deque[tuple[int, Any, Any, Any]] = deque()
        for i, (inputs, targets) in enumerate(slices):
            pending.append(self._send(self.owner(i), inputs, targets))
            if len(pending) > len(self.devices):
                yield self._receive(*pending.popleft())
        while pending:
            yield self._receive(*pending.popleft())

    # -- CUDA plumbing ---------------------------------------------------------------------
    def _send(self, k: int, inputs: Any, targets: Any) -> tuple[int, Any, Any, Any]:
        dev = self.devices[k]
        if dev.type != "cuda":
            move = _mover(dev)
            return k, tree_map(move, inputs), tree_map(move, targets), None
        stream = self._copy_streams.get(dev)
        if stream is None:
            stream = self._copy_streams[dev] = torch.cuda.Stream(device=dev)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            moved = tree_map(_cuda_mover(dev), (inputs, targets))
            event = torch.cuda.Event()
            event.record(stream)
        return k, moved[0], moved[1], event

    def _receive(self, k: int, inputs: Any, targets: Any, event: Any) -> tuple[int, Any, Any]:
        if event is not None:
            compute = torch.cuda.current_stream(self.devices[k])
            compute.wait_event(event)
            for t in tree_flatten((inputs, targets))[0]:
                if isinstance(t, Tensor) and t.device == self.devices[k]:
                    # Allocated on the copy stream, used on the compute stream: the
                    # allocator must not reuse the memory before the compute is done.
                    t.record_stream(compute)
        return k, inputs, targets


def _mover(dev: torch.device) -> Any:
    def move(t: Any) -> Any:
        return t.to(dev) if isinstance(t, Tensor) and t.device != dev else t

    return move


def _tree_to(tree: Any, move: Any) -> Any:
    """``tree_map(move, tree)``, skipping the walk for a single tensor or None."""
    if tree is None:
        return None
    if type(tree) is Tensor:
        return move(tree)
    return tree_map(move, tree)


def _cuda_mover(dev: torch.device) -> Any:
    def move(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.device == dev:
            return t
        if t.device.type == "cpu" and not t.is_pinned():
            # Only a copy from page-locked memory runs asynchronously to the host.
            t = t.pin_memory()
        return t.to(dev, non_blocking=True)

    return move
