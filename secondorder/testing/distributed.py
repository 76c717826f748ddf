"""A launcher that runs one function on several ranks, each in a new process.

Why new processes and not threads: ``torch.distributed`` allows one default group per
process, and a rank that hangs or dies must not take the test runner with it.  Why
``spawn`` and not ``fork``: forking a process that already ran torch's thread pools
can deadlock.  The rank function is therefore named by reference (an importable
module-level function), and its arguments and result must pickle.

Example::

    def job(rank: int, world: int, steps: int) -> torch.Tensor:
        ...  # build the model and optimizer, train on this rank's shard
        return flat_parameters

    results = run_ranks(job, world=2, args=(5,))
    torch.testing.assert_close(results[0].value, results[1].value, rtol=0, atol=0)

The ranks join a gloo group, which runs on any machine (and takes CUDA tensors too);
``backend="nccl"`` starts an NCCL group instead, for CUDA tensors on GPUs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["RankError", "RankResult", "run_ranks"]

#: The ``torch.distributed`` backends :func:`run_ranks` starts its ranks with.
_BACKENDS = ("gloo", "nccl")


class RankError(RuntimeError):
    """A rank raised, wrote no result, or was still running at the deadline."""


@dataclass(frozen=True)
class RankResult:
    """What one rank's function did: returned ``value``, or raised ``error``.

    ``error`` is ``"TypeName: message"`` and ``error_type`` the exception's class name;
    both are ``None`` when the function returned.
    """

    rank: int
    value: Any = None
    error: str | None = None
    error_type: str | None = None

    def unwrap(self) -> Any:
        """The returned value; :class:`RankError` if the rank raised."""
        if self.error is not None:
            raise RankError(f"rank {self.rank} raised {self.error}")
        return self.value


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    init: str,
    out: str,
    timeout_s: float,
    threads: int,
    args: tuple[Any, ...],
    backend: str,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        # Inside the try: a rendezvous that fails is reported as this rank's error.
        dist.init_process_group(
            backend,
            init_method=init,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        if backend == "gloo":
            # A rank's init can return before its peers have finished connecting to it;
            # one that then finished fn and left would break a slower peer's init
            # ("connectFullMesh failed") on a loaded machine. (NCCL ranks set their
            # device in fn first, so they meet in their first collective instead.)
            dist.barrier()
        result: dict[str, Any] = {"value": fn(rank, world, *args)}
    except BaseException as exc:  # reported to the parent, which decides what it means
        result = {
            "error": f"{type(exc).__name__}: {exc}",
            "error_type": type(exc).__name__,
            "traceback": traceback.format_exc(),
        }
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    # A rank whose peers died cannot leave the group cleanly; its result is written.
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 60.0,
    deadline_s: float = 120.0,
    wait_for: Sequence[int] | None = None,
    threads: int = 1,
    check: bool = True,
    backend: str = "gloo",
) -> dict[int, RankResult]:
    """Call ``fn(rank, world, *args)`` on ``world`` ranks; each rank's result by rank.

    Args:
        fn: a module-level function (spawned processes import it by name).
        world: the number of ranks, at least 1.
        args: further positional arguments, the same on every rank; they must pickle.
        timeout_s: the process group's collective timeout: a rank waiting longer on a
            dead or stalled peer raises.
        deadline_s: how long the parent waits for the ranks in ``wait_for`` before it
            kills every rank and raises :class:`RankError`.
        wait_for: the ranks to wait for (default all); the others are killed once
            these have finished (a test of a rank that stalls on purpose).
        threads: torch threads per rank; 1 keeps ranks from competing for cores.
        check: raise :class:`RankError` if a waited-for rank raised or wrote nothing.
            With ``check=False`` the caller inspects each :class:`RankResult`.
        backend: the process group's backend, ``"gloo"`` (CPU and CUDA tensors) or
            ``"nccl"`` (CUDA tensors, one GPU per rank: ``fn`` calls
            ``torch.cuda.set_device`` before its first collective).

    Raises:
        ValueError: a bad ``world``, ``fn`` or ``backend``, before any rank starts.
        RankError: a rank ran past ``deadline_s``; with ``check``, also a rank that
            raised (its traceback is in the message) or wrote no result.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"Invalid world={world!r}: must be an integer >= 1.")
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(
            f"Invalid backend={backend!r}: must be one of {_BACKENDS}; pass backend='gloo' "
            "for CPU (or CUDA) tensors, or backend='nccl' for CUDA tensors on one GPU per rank."
        )
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"fn must be a module-level function that spawned ranks can import, got {fn!r}"
        )
    waited = list(range(world)) if wait_for is None else list(wait_for)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="secondorder-ranks-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, r, world, init, tmp, float(timeout_s), threads, tuple(args), backend),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for r in waited:
            procs[r].join(max(0.0, end - time.monotonic()))
        hung = [r for r in waited if procs[r].is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if hung:
            raise RankError(f"ranks {hung} of {world} were still running after {deadline_s} s")
        exit_codes = [p.exitcode for p in procs]
        return _collect(Path(tmp), world, waited, exit_codes, check)


def _collect(
    tmp: Path, world: int, waited: Sequence[int], exit_codes: Sequence[int | None], check: bool
) -> dict[int, RankResult]:
    """Read each rank's pickled result; with ``check``, raise for a waited-for failure."""
    results: dict[int, RankResult] = {}
    for r in range(world):
        path = tmp / f"rank{r}.pkl"
        if not path.exists():
            if check and r in waited:
                raise RankError(f"rank {r} of {world} wrote no result (exit code {exit_codes[r]})")
            continue
        payload = pickle.loads(path.read_bytes())
        results[r] = RankResult(
            rank=r,
            value=payload.get("value"),
            error=payload.get("error"),
            error_type=payload.get("error_type"),
        )
        if check and r in waited and "error" in payload:
            raise RankError(
                f"rank {r} of {world} raised {payload['error']}\n{payload['traceback']}"
            )
    return results
