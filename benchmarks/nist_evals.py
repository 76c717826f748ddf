"""Evaluations to the certified values: NIST StRD and MGH10, secondorder against scipy.

For every start of the 27 NIST StRD problems, ``secondorder.least_squares`` (default
damping, exact Jacobian by autograd) and scipy's ``least_squares`` (``method="lm"``,
MINPACK, and ``method="trf"``), both given the same exact Jacobian, run at tolerances
``ftol = xtol = gtol = 1e-15``.  The table gives each solver's evaluations (``nfev``:
residual evaluations; scipy's ``lm`` counts no Jacobian calls in it either) and the
log relative error of its parameters against the certified values (NIST's "LRE",
``-log10 max|b - b*|/|b*|``, capped at 11: the certified values' own precision); a
solver *passes* a start at LRE ≥ 6.

With ``--fd`` both sides get NumPy residuals and no Jacobian instead: forward
differences (MINPACK's ``lmdif`` in scipy's ``lm``, ours with its ``"2-point"``
scheme, MINPACK's step under ``method="lm"``), as in ``benchmarks.nist_time``'s setting
(b); ours then runs ``method="lm"``, and its ``nfev`` counts the difference columns,
which scipy's ``lm`` does not (its trf column is left out).

Not a timed benchmark: evaluations and digits only.  Run it with::

    python -m benchmarks.nist_evals [--max-nfev 20000] [--names MGH10 BoxBOD]
    python -m benchmarks.nist_evals --damping-rule nielsen --damping-matrix more
    python -m benchmarks.nist_evals --fd
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.optimize
import torch
from torch.func import jacfwd

import secondorder as so

from .nist_data import NAMES, PROBLEMS, NistProblem

__all__ = ["Run", "lre", "main", "run_scipy", "run_secondorder"]

TOL = 1e-15


@dataclass(frozen=True)
class Run:
    """One solver on one start: evaluations, Jacobians and digits reached."""

    nfev: int
    njev: int
    lre: float
    rss: float


def lre(b: Sequence[float], certified: Sequence[float]) -> float:
    """NIST's log relative error of ``b``: the digits shared with ``certified`` (≤ 11)."""
    worst = 0.0
    for value, ref in zip(b, certified, strict=True):
        err = abs(value - ref) / abs(ref) if ref != 0 else abs(value)
        worst = max(worst, err) if math.isfinite(err) else math.inf
    return 11.0 if worst == 0 else max(0.0, min(11.0, -math.log10(worst)))


def run_secondorder(
    p: NistProblem, start: int, max_nfev: int, fd: bool = False, **options: Any
) -> Run:
    """``secondorder.least_squares`` from start ``start`` (1 or 2).

    ``fd``: NumPy residuals and finite differences (``method="lm"``), not autograd.
    """
    if fd:
        fun: Any = p.numpy_residuals()
        x0: Any = np.array(p.starts[start - 1], dtype=np.float64)
        options = {"method": "lm", **options}
    else:
        fun, x0 = p.torch_residuals(), torch.tensor(p.starts[start - 1], dtype=torch.float64)
    with np.errstate(all="ignore"):  # a NumPy fun overflowing at a rejected trial point
        res = so.least_squares(fun, x0, ftol=TOL, xtol=TOL, gtol=TOL, max_nfev=max_nfev, **options)
    b = res.x.tolist()
    return Run(res.nfev, res.njev or 0, lre(b, p.certified), 2.0 * res.cost)


def _exact_jacobian(p: NistProblem) -> Callable[[np.ndarray], np.ndarray]:
    fun = p.torch_residuals()

    def jac(b: np.ndarray) -> np.ndarray:
        return jacfwd(fun)(torch.from_numpy(np.array(b, dtype=np.float64))).numpy()

    return jac


def run_scipy(p: NistProblem, start: int, method: str, max_nfev: int, fd: bool = False) -> Run:
    """scipy's ``least_squares(method=method)`` with the exact Jacobian (``fd``: none)."""
    x0 = np.array(p.starts[start - 1], dtype=np.float64)
    # trf: tolerances below machine epsilon are refused; lm takes them as they are.
    tol = TOL if method == "lm" else float(np.finfo(np.float64).eps)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        res = scipy.optimize.least_squares(
            p.numpy_residuals(),
            x0,
            jac="2-point" if fd else _exact_jacobian(p),
            method=method,
            ftol=tol,
            xtol=tol,
            gtol=tol,
            max_nfev=max_nfev,
        )
    njev = int(res.njev) if res.njev is not None else 0
    return Run(int(res.nfev), njev, lre(res.x.tolist(), p.certified), 2.0 * float(res.cost))


def _cell(r: Run) -> str:
    return f"{r.nfev:>6d} {r.lre:>5.1f}"


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table: evaluations and digits per start, ours against scipy's lm and trf."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-nfev", type=int, default=20000)
    parser.add_argument("--names", nargs="*", default=list(NAMES))
    parser.add_argument("--damping-rule", default=None)
    parser.add_argument("--damping-matrix", default=None)
    parser.add_argument("--no-scipy", action="store_true")
    parser.add_argument("--fd", action="store_true", help="NumPy residuals, finite differences")
    args = parser.parse_args(argv)
    options = {}
    if args.damping_rule:
        options["damping_rule"] = args.damping_rule
    if args.damping_matrix:
        options["damping_matrix"] = args.damping_matrix
    head = f"{'problem':<10} st | {'ours':>12} |"
    if not args.no_scipy:
        head += f" {'scipy lm':>12} |" + ("" if args.fd else f" {'scipy trf':>12} |")
    print(f"{head}   (each cell: nfev, LRE digits)")
    passed = {"ours": 0, "lm": 0, "trf": 0}
    total = {"ours": 0, "lm": 0, "trf": 0}
    starts = 0
    for name in args.names:
        p = PROBLEMS[name]
        for start in (1, 2):
            starts += 1
            ours = run_secondorder(p, start, args.max_nfev, args.fd, **options)
            runs = {"ours": ours}
            line = f"{name:<10} {start:>2} | {_cell(ours)} |"
            if not args.no_scipy:
                runs["lm"] = run_scipy(p, start, "lm", args.max_nfev, args.fd)
                line += f" {_cell(runs['lm'])} |"
                if not args.fd:
                    runs["trf"] = run_scipy(p, start, "trf", args.max_nfev)
                    line += f" {_cell(runs['trf'])} |"
            for key, r in runs.items():
                passed[key] += r.lre >= 6
                total[key] += r.nfev
            print(line, flush=True)
    for key in runs:
        print(f"{key}: {passed[key]}/{starts} starts at >= 6 digits, {total[key]} evaluations")


if __name__ == "__main__":
    main()
