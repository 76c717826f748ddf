"""Faults injected into real K-FAC steps, and the state a failed step must leave alone.

:class:`Fault` is a ``torch.overrides.TorchFunctionMode``: PyTorch's own dispatch hook,
through which every ``torch.linalg.eigh``, ``cholesky_ex`` or ``Tensor.copy_`` of the
step passes.  At the chosen call it raises what a failing LAPACK routine (or a Ctrl-C)
would raise there; every other call runs the real function.  :func:`state_of` reads
everything a step may change, so that a failed step can be compared bitwise with the
state before it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from secondorder.distributed import RankFailedError
from secondorder.kfac import KFAC

__all__ = ["Fault", "LineSweep", "Sweep", "same", "state_of", "writes_a_grad"]

#: A layer's statistics since the last factor update.
STATS = ("a_sum", "g_sum", "a_rows", "g_samples", "forward_calls", "backward_calls", "counted")


class Fault(TorchFunctionMode):
    """Raise ``error`` at the ``at``-th call (1-based) of ``func`` that ``when`` accepts.

    Raises once; ``calls`` counts the accepted calls seen.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        error: BaseException,
        at: int = 1,
        when: Callable[[tuple[Any, ...]], bool] | None = None,
    ) -> None:
        super().__init__()
        self.func, self.error, self.at, self.when = func, error, at, when
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is self.func and (self.when is None or self.when(args)):
            self.calls += 1
            if self.calls == self.at:
                raise self.error
        return func(*args, **(kwargs or {}))


class Sweep(TorchFunctionMode):
    """Count the torch calls of a step; raise ``KeyboardInterrupt`` at call ``at`` (1-based)."""

    def __init__(self, at: int | None = None) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not _out_of_reach(func):
            self.calls += 1
            if self.calls == self.at:
                raise KeyboardInterrupt(f"injected at call {self.at}")
        return func(*args, **(kwargs or {}))


def _out_of_reach(func: Callable[..., Any]) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if "secondorder/distributed/" in code.co_filename.replace("\\", "/"):
            return True
        if code.co_name == "agree" and getattr(func, "__name__", "") in ("cpu", "tolist"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class LineSweep:
    """Count the lines K-FAC runs; raise ``KeyboardInterrupt`` before line ``at`` (1-based).

    A Ctrl-C arrives between two bytecodes, wherever Python is, not only inside a
    torch call: this sweep (``sys.settrace``) reaches the lines that call no torch
    function, such as the assignments of a commit.  Lines of ``secondorder.kfac`` and
    of KAISA's drop-in count when they run inside a function named in ``within``, and
    not inside :func:`~secondorder.kfac.agreement.agree` (its all-reduce is where a
    rank tells the others, and a rank interrupted while reading the result has nobody
    left to tell).
    """

    PARTS = ("secondorder/kfac/", "secondorder/compat/kfac/")

    def __init__(self, at: int | None = None, within: tuple[str, ...] = ()) -> None:
        self.at, self.within, self.calls = at, within, 0

    def __enter__(self) -> LineSweep:
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        path = frame.f_code.co_filename.replace("\\", "/")
        if not any(p in path for p in self.PARTS):
            return None
        names = set()
        caller = frame
        while caller is not None:
            names.add(caller.f_code.co_name)
            caller = caller.f_back
        if "agree" in names or not names & set(self.within):
            return None
        return self._local

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.calls += 1
            if self.calls == self.at:
                raise KeyboardInterrupt(f"injected before line {self.at}")
        return self._local


def writes_a_grad(model: nn.Module) -> Callable[[tuple[Any, ...]], bool]:
    """A ``when`` for ``Tensor.copy_``: the destination is a parameter's ``.grad``."""

    def when(args: tuple[Any, ...]) -> bool:
        return any(p.grad is not None and args[0] is p.grad for p in model.parameters())

    return when


def _copy(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_copy(v) for v in x]
    if isinstance(x, set):
        return sorted(x)
    return x


def state_of(kfac: KFAC, model: nn.Module) -> dict[str, Any]:
    """Everything a K-FAC step may change, copied: its state_dict, the statistics
    gathered since the last step, the hooks' pass records, every parameter and
    ``.grad``."""
    cap = kfac._capture
    return {
        "kfac": _copy(kfac.state_dict()),
        "stats": {
            name: {a: _copy(getattr(layer, a, None)) for a in STATS}
            for name, layer in kfac.layers.items()
        },
        # (not the count of model calls, which a skipped batch or a metric raises)
        "capture": _copy([cap.capturing, cap.layer_pass, getattr(cap, "layer_call", None)]),
        "params": [_copy(p) for p in model.parameters()],
        "grads": [None if p.grad is None else _copy(p.grad) for p in model.parameters()],
    }


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two :func:`state_of` results (dtypes included)."""
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return (
            isinstance(b, list)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def interrupt_each_call(
    calls: int,
    rank: int,
    mode: Callable[[int | None], Any],
    attempt: Callable[[], Callable[[], Any]],
    snapshot: Callable[[], Any],
    done: str,
) -> list[tuple[int, str, bool]]:
    """Interrupt rank 0 at each of its ``calls`` calls in turn: the rounds that went wrong.

    Each round builds ``attempt()`` (outside the fault) and runs it under ``mode(at)``
    on rank 0 and ``mode(None)`` on the others.  Rank 0 must raise the interrupt and
    every other rank :class:`RankFailedError`, each with ``snapshot()`` bitwise as
    before; ``done`` names a round that raised nothing.  The sweep stops at the first
    wrong round: the ranks may no longer be in step.
    """
    expected = "KeyboardInterrupt" if rank == 0 else "RankFailedError"
    wrong: list[tuple[int, str, bool]] = []
    for at in range(1, calls + 1):
        before = snapshot()
        run = attempt()
        try:
            with mode(at if rank == 0 else None):
                run()
            outcome = done
        except KeyboardInterrupt as exc:
            outcome = f"KeyboardInterrupt: {exc}"
        except RankFailedError:
            outcome = "RankFailedError"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        unchanged = same(snapshot(), before)
        if not outcome.startswith(expected) or not unchanged:
            wrong.append((at, outcome[:200], unchanged))
            break
    return wrong


def backprop(net: nn.Module, i: int, rank: int, world: int) -> None:
    """Batch ``i`` (8 float64 samples, 4 → 3): this rank's share, gradients averaged."""
    g = torch.Generator().manual_seed(i)
    dt = torch.float64
    x, y = torch.randn(8, 4, generator=g, dtype=dt), torch.randn(8, 3, generator=g, dtype=dt)
    b = 8 // world
    x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
    net.zero_grad()
    (0.5 * (net(x) - y).pow(2).sum(1).mean()).backward()
    for p in net.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world
