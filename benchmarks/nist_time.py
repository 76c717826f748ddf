"""Wall time on NIST StRD: secondorder.least_squares against scipy's MINPACK.

Both solvers run in this process on the 27 StRD problems from both starts (float64,
``ftol = xtol = gtol = 1e-15``, ``max_nfev = 20000``, ``method="lm"`` on both sides) in
two settings:

* **(a) exact Jacobian.**  Torch residuals; ours differentiates them with ``jac``
  (``--jac``, default ``"auto"``); scipy gets a ``jac`` callable that runs *the same*
  torch transform (:func:`secondorder.fitting.functions.jacobian_function`) and
  returns a NumPy array, so a Jacobian costs both sides the same and the difference is
  what each does around it.  Scipy's time inside that callable is printed too.  In
  reverse mode (``"auto"`` here) ours evaluates each trial point by ``torch.func.vjp``
  and takes an accepted point's J from that forward pass, which two separate
  callables cannot share: its Jacobians then cost less than scipy's callable.
  ``--jac fwd`` is the setting first measured (``jacfwd`` on both sides).
* **(b) finite differences.**  NumPy residuals, no ``jac``: scipy's MINPACK (``lmdif``)
  differences in Fortran, ours with its ``"2-point"`` scheme (MINPACK's step under
  ``method="lm"``).

Every start is timed ``--rounds`` times; within a round the solvers take turns at going
first, so a burst of load on a shared machine hits all alike.  ``--base DIR`` adds an
older copy of the package, ``DIR/secondorder_base`` (``git archive <commit> secondorder
| tar -x -C DIR``, then renamed), timed in the same rounds: before and after side by
side, each against scipy in the same process.  The totals are the
sums over starts of each start's minimum (the least disturbed run) and of its median;
the ratio is ours over scipy.  Digits are NIST's log relative error (LRE) of the
parameters against the certified values (capped at 11); a start *passes* at LRE ≥ 6.
Run with::

    python -m benchmarks.nist_time [--quick] [--rounds 5] [--threads 1]
        [--names Misra1a MGH10] [--table] [--jac auto|fwd|rev] [--settings exact fd]
        [--base DIR] [--clock wall|process]

``--clock process`` times this process's CPU time instead of the wall clock: on a
machine shared with other jobs, time spent descheduled is then left out (both sides
alike); cache and frequency effects of the other jobs remain.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import scipy
import scipy.optimize
import torch

import secondorder as so
from secondorder.fitting.functions import jacobian_function

from .nist_data import NAMES, PROBLEMS, NistProblem
from .nist_evals import lre

__all__ = ["QUICK", "Timing", "main", "run_once"]

TOL = 1e-15
MAX_NFEV = 20000
#: ``--quick``: one problem of each kind and difficulty, 3 rounds.
QUICK = ("Misra1a", "Chwirut2", "Lanczos3", "MGH09", "Thurber", "Eckerle4")
SETTINGS = ("exact", "fd")
SIDES = ("ours", "scipy")


@dataclass
class Timing:
    """One side of one setting on one start: seconds per round and what it reached."""

    seconds: list[float] = field(default_factory=list)
    lre: float = 0.0
    nfev: int = 0
    #: scipy only, setting (a): seconds inside the Jacobian callable, per round.
    jac_seconds: list[float] = field(default_factory=list)


def _torch_jacobian(p: NistProblem, jac: str) -> Callable[[np.ndarray], np.ndarray]:
    """Scipy's ``jac``: secondorder's own ``jac`` transform of the torch residuals."""
    fun = p.torch_residuals()
    transform = jacobian_function(jac, fun, numpy_fun=False, shape=(p.m, p.n), args=(), kwargs={})

    def jac(b: np.ndarray) -> np.ndarray:
        return transform(torch.from_numpy(np.array(b, dtype=np.float64))).numpy()

    return jac


def run_once(
    p: NistProblem,
    start: int,
    setting: str,
    side: str,
    jac: str = "auto",
    package: ModuleType | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float, int, float]:
    """One timed fit: ``(seconds, lre, nfev, seconds inside scipy's jac)``.

    ``jac``: the torch transform both sides use in setting (a): ``"auto"``, ``"fwd"``
    or ``"rev"``.  ``side``: ``"scipy"``, or ``"ours"`` run by ``package`` (default
    this ``secondorder``; ``--base`` passes the older copy).  ``clock``: wall time
    (``time.perf_counter``) or this process's CPU time (``time.process_time``).
    """
    x0 = p.starts[start - 1]
    tight = {"ftol": TOL, "xtol": TOL, "gtol": TOL, "max_nfev": MAX_NFEV, "method": "lm"}
    jac_time = [0.0]
    if side != "scipy":
        if setting == "exact":
            fun: Any = p.torch_residuals()
            start_point: Any = torch.tensor(x0, dtype=torch.float64)
            tight["jac"] = jac
        else:
            fun, start_point = p.numpy_residuals(), np.array(x0, dtype=np.float64)
        with np.errstate(all="ignore"):  # a NumPy fun overflowing at a rejected trial point
            t0 = clock()
            res = (package or so).least_squares(fun, start_point, **tight)
            seconds = clock() - t0
        x = res.x.tolist()
    else:
        options: dict[str, Any] = {}
        if setting == "exact":
            inner = _torch_jacobian(p, jac)

            def timed(b: np.ndarray) -> np.ndarray:
                t = clock()
                out = inner(b)
                jac_time[0] += clock() - t
                return out

            options["jac"] = timed
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            t0 = clock()
            res = scipy.optimize.least_squares(
                p.numpy_residuals(), np.array(x0, dtype=np.float64), **tight, **options
            )
            seconds = clock() - t0
        x = res.x.tolist()
    return seconds, lre(x, p.certified), int(res.nfev), jac_time[0]


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores visible"


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def main(argv: Sequence[str] | None = None) -> dict[tuple[str, str], dict[tuple[str, int], Timing]]:
    """Time both solvers on every start, print the totals and ratios; return the timings."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{len(QUICK)} problems, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed runs per start (5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--names", nargs="*", default=None)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--table", action="store_true", help="print every start's figures")
    parser.add_argument(
        "--jac", default="auto", choices=("auto", "fwd", "rev"), help="(a)'s transform, both sides"
    )
    parser.add_argument("--base", default=None, help="folder holding secondorder_base")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "process"),
        help="wall time, or this process's CPU time (less disturbed on a shared machine)",
    )
    args = parser.parse_args(argv)
    packages: dict[str, ModuleType] = {"ours": so}
    if args.base:
        sys.path.insert(0, args.base)
        packages["base"] = importlib.import_module("secondorder_base")
    sides = (*SIDES, "base") if args.base else SIDES
    names = args.names or (list(QUICK) if args.quick else list(NAMES))
    rounds = args.rounds or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    starts = [(name, s) for name in names for s in (1, 2)]
    cmd = "python -m benchmarks.nist_time " + " ".join(sys.argv[1:])
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {cmd.strip()}")
    print(
        f"{now:%Y-%m-%d %H:%M} UTC, {_machine()}, torch {torch.__version__} with "
        f"torch.set_num_threads({args.threads}), scipy {scipy.__version__}, numpy "
        f"{np.__version__}, Python {platform.python_version()}"
    )
    print(
        f"load average at start: {_load()}; {len(starts)} starts x {rounds} rounds; "
        f"(a) with jac={args.jac!r} on both sides; {args.clock} time"
    )
    timings = {
        (setting, side): {key: Timing() for key in starts}
        for setting in args.settings
        for side in sides
    }
    # Warm-up: the first torch.func transform and scipy call in a process cost seconds.
    for setting in args.settings:
        for side in sides:
            run_once(
                PROBLEMS[starts[0][0]],
                starts[0][1],
                setting,
                side,
                args.jac,
                packages.get(side),
                clock,
            )
    for r in range(rounds):
        for i, (name, s) in enumerate(starts):
            for setting in args.settings:
                turn = (r + i) % len(sides)
                for side in sides[turn:] + sides[:turn]:
                    sec, digits, nfev, jac_s = run_once(
                        PROBLEMS[name], s, setting, side, args.jac, packages.get(side), clock
                    )
                    t = timings[setting, side][name, s]
                    t.seconds.append(sec)
                    t.jac_seconds.append(jac_s)
                    t.lre, t.nfev = digits, nfev
    print(f"load average at end: {_load()}")
    if args.table:
        _print_table(timings, starts, args.settings, sides)
    _print_summary(timings, starts, args.settings)
    if args.base:
        _print_base(timings, starts, args.settings)
    return timings


def _print_table(
    timings: dict[tuple[str, str], dict[tuple[str, int], Timing]],
    starts: list[tuple[str, int]],
    settings: Sequence[str],
    sides: Sequence[str] = SIDES,
) -> None:
    head = f"{'problem':<10} st"
    for setting in settings:
        head += f" | {setting}: " + "  ".join(f"{side} ms (nfev, LRE)" for side in sides)
    print(head)
    for key in starts:
        line = f"{key[0]:<10} {key[1]:>2}"
        for setting in settings:
            line += " |"
            for side in sides:
                t = timings[setting, side][key]
                line += f" {1e3 * min(t.seconds):8.2f} ({t.nfev:>5d}, {t.lre:4.1f})"
        print(line)


def _print_summary(
    timings: dict[tuple[str, str], dict[tuple[str, int], Timing]],
    starts: list[tuple[str, int]],
    settings: Sequence[str],
) -> None:
    labels = {
        "exact": "(a) exact Jacobian (same torch transform)",
        "fd": "(b) NumPy residuals, finite differences",
    }
    targets = {"exact": 1.5, "fd": 2.0}
    print()
    print(
        "| setting | ours s (min / median) | scipy s (min / median) | ours/scipy (min / median)"
        " | target | starts >= 6 digits (ours, scipy) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for setting in settings:
        tot: dict[str, tuple[float, float]] = {}
        passed: dict[str, int] = {}
        for side in SIDES:
            ts = timings[setting, side]
            tot[side] = (
                sum(min(ts[k].seconds) for k in starts),
                sum(statistics.median(ts[k].seconds) for k in starts),
            )
            passed[side] = sum(ts[k].lre >= 6 for k in starts)
        ratio = (tot["ours"][0] / tot["scipy"][0], tot["ours"][1] / tot["scipy"][1])
        print(
            f"| {labels[setting]} | {tot['ours'][0]:.3f} / {tot['ours'][1]:.3f} | "
            f"{tot['scipy'][0]:.3f} / {tot['scipy'][1]:.3f} | {ratio[0]:.2f} / {ratio[1]:.2f} | "
            f"<= {targets[setting]:g} | {passed['ours']}, {passed['scipy']} of {len(starts)} |"
        )
    if "exact" in settings:
        ts = timings["exact", "scipy"]
        # In the fastest round of each start, as the minimum total is counted.
        jac_s = sum(ts[k].jac_seconds[ts[k].seconds.index(min(ts[k].seconds))] for k in starts)
        print(
            f"\n(a): scipy's time inside the torch Jacobian callable: {jac_s:.3f} s of its minimum"
        )
    for setting in settings:
        low = [
            f"{k[0]}/{k[1]} ({timings[setting, 'ours'][k].lre:.1f})"
            for k in starts
            if timings[setting, "ours"][k].lre < 6
        ]
        if low:
            print(f"{setting}: ours below 6 digits: {', '.join(low)}")
    for setting in settings:
        nfev = {side: sum(timings[setting, side][k].nfev for k in starts) for side in SIDES}
        note = " (ours counts finite-difference calls, scipy's lm does not)"
        print(
            f"{setting}: nfev ours {nfev['ours']}, scipy {nfev['scipy']}{note * (setting == 'fd')}"
        )


def _print_base(
    timings: dict[tuple[str, str], dict[tuple[str, int], Timing]],
    starts: list[tuple[str, int]],
    settings: Sequence[str],
) -> None:
    """``--base``: the older package against this one and scipy, from the same rounds."""
    print()
    print(
        "| setting | base s (min / median) | ours s (min / median) | base/ours (min / median)"
        " | base/scipy (min / median) | starts >= 6 digits (base) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for setting in settings:
        tot = {
            side: (
                sum(min(timings[setting, side][k].seconds) for k in starts),
                sum(statistics.median(timings[setting, side][k].seconds) for k in starts),
            )
            for side in ("base", "ours", "scipy")
        }
        b, o, sc = tot["base"], tot["ours"], tot["scipy"]
        passed = sum(timings[setting, "base"][k].lre >= 6 for k in starts)
        print(
            f"| {setting} | {b[0]:.3f} / {b[1]:.3f} | {o[0]:.3f} / {o[1]:.3f} | "
            f"{b[0] / o[0]:.2f} / {b[1] / o[1]:.2f} | {b[0] / sc[0]:.2f} / {b[1] / sc[1]:.2f} | "
            f"{passed} of {len(starts)} |"
        )


if __name__ == "__main__":
    main()
