"""Benchmark suite: ``python -m benchmarks.bench [--quick|--tiny]``.

Runs each family's methods against their peers in one process, on the same data, from
the same initial weights, with the same thread count, and reports time per step, time
to the target and the curves (:mod:`benchmarks.core`).  ``--family`` picks whose
problems run by default: ``lm`` (the default), ``kfac`` (:mod:`benchmarks.kfac_methods`:
K-FAC + SGD against SGD, AdamW and asdfghjkl on MNIST-1D, digits and a deep autoencoder,
then the COMM-OPT / MEM-OPT / HYBRID-OPT scaling report of :mod:`benchmarks.kfac_scaling`)
or ``all``; each problem runs only its own family's methods.  The LM family
(:mod:`benchmarks.lm_methods`):

* secondorder LM with its default settings, and with the fastest settings measured
  for the problem (stated in the output);
* torch-levenberg-marquardt (``pip install 'secondorder[bench]'``), through its own
  ``LevenbergMarquardtModule.training_step`` with its defaults; skipped with a note
  when it is not installed;
* ``torch.optim.Adam`` with a learning rate tuned per problem (stated in the output);
* ``scipy.optimize.least_squares`` (``"lm"`` and ``"trf"``) on the curve-fitting
  problems, in float64, with the Jacobian from torch autograd and a time cap.

Every method is timed on its own work only: the loss and accuracy curves are
evaluated outside the clock.  For each problem the suite also measures the floor of
an LM step on this machine, in the same process (:mod:`benchmarks.lm_floor`): a plain
``JᵀJ`` product of the Jacobian's shape (and ``?syrk``, which computes it with half
the flops) and one forward plus backward pass of the model on the batch.  The ratios
``(Gram + solve) / GEMM`` and ``Jacobian / (forward + backward)`` are what to compare
across machines; absolute seconds on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import kfac_methods, kfac_scaling, lm_methods, shampoo_methods
from . import scaling as scaling_module
from .core import (
    Family,
    MethodResult,
    Problem,
    evaluate,
    finite_or_none,
    machine,
    plot,
    resolve_device,
    where,
)
from .core import ProblemResult as CoreProblemResult
from .core import markdown as core_markdown
from .core import run_problem as core_run_problem
from .lm_methods import LMProblemResult, flop_scaling, run_tlm, scaling_lines

__all__ = [
    "FAMILIES",
    "METHODS",
    "PROBLEMS",
    "MethodResult",
    "Problem",
    "ProblemResult",
    "add_bench_parser",
    "build_problems",
    "evaluate",
    "flop_scaling",
    "machine",
    "markdown",
    "plot",
    "run_bench",
    "run_problem",
    "run_tlm",
    "scaling_lines",
]

#: The families in the suite, each built for a run (its sections take run options).
#: A new family adds its builder here (see :mod:`benchmarks.core`).
FAMILIES: tuple[Callable[[int], Family], ...] = (
    lambda floor_reps: lm_methods.family(floor_reps=floor_reps),
    lambda floor_reps: kfac_methods.family(),
    lambda floor_reps: shampoo_methods.family(),
)
#: ``--family`` keys, one per entry of :data:`FAMILIES`; ``lm`` (the default) keeps the
#: suite's problems as they were before other families joined.
FAMILY_KEYS: tuple[str, ...] = ("lm", "kfac", "shampoo")


def families(floor_reps: int = 5) -> list[Family]:
    """Every family of the suite, built for a run."""
    return [build(floor_reps) for build in FAMILIES]


PROBLEMS: tuple[str, ...] = tuple(k for f in families() for k in f.problems)
#: The problems of each ``--family`` key (``all``: every family's).
FAMILY_PROBLEMS: dict[str, tuple[str, ...]] = {
    **{key: tuple(f.problems) for key, f in zip(FAMILY_KEYS, families(), strict=True)},
    "all": PROBLEMS,
}
METHODS: tuple[str, ...] = tuple(k for f in families() for k in f.methods)

#: Kept for callers of the pre-split API: ``ProblemResult(problem, methods, floor)``.
ProblemResult = LMProblemResult


def build_problems(
    quick: bool = False, tiny: bool = False, keys: Sequence[str] = PROBLEMS
) -> dict[str, Problem]:
    """The problems named in ``keys``, built (and their data loaded) on demand.

    ``quick`` shrinks the budgets to a few minutes in all on 2 cores; ``tiny`` shrinks
    everything to seconds (for tests).
    """
    unknown = [k for k in keys if k not in PROBLEMS]
    if unknown:
        raise ValueError(f"Unknown problems {unknown}; valid choices are {PROBLEMS}.")
    mode = "tiny" if tiny else "quick" if quick else "full"
    makers = {k: build for f in families() for k, build in f.problems.items()}
    return {k: makers[k](mode) for k in keys}


def run_problem(
    problem: Problem,
    *,
    methods: Sequence[str] = METHODS,
    floor_reps: int = 5,
    log: Callable[[str], None] = print,
) -> CoreProblemResult:
    """Run the selected methods of the family that owns ``problem``, then the sections.

    A problem no family owns gets every family's selected methods.
    """
    fams = families(floor_reps)
    owners = [f for f in fams if problem.key in f.problems]
    chosen = [
        m
        for f in owners or fams
        for key, make in f.methods.items()
        if key in methods
        for m in make(problem)
    ]
    sections = [s for f in fams for s in f.sections]
    return core_run_problem(problem, chosen, sections, log)


def markdown(results: Sequence[CoreProblemResult], header: str) -> str:
    """The report: per problem the methods table and the sections, then the closings."""
    return core_markdown(results, header, families())


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on a ``parser.add_subparsers()`` object; return its parser."""
    b: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="each family against its peers (LM: torch-levenberg-marquardt, Adam, scipy)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--quick", action="store_true", help="small budgets: a few minutes on 2 cores")
    b.add_argument("--tiny", action="store_true", help="tiny sizes, seconds (for tests)")
    b.add_argument(
        "--family",
        choices=(*FAMILY_KEYS, "all"),
        default="lm",
        help="whose problems run by default and whose scaling report follows (default lm)",
    )
    b.add_argument(
        "--problems",
        nargs="+",
        choices=PROBLEMS,
        default=None,
        metavar="NAME",
        help=f"problems to run (default: the --family's): {', '.join(PROBLEMS)}",
    )
    b.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        metavar="NAME",
        help=f"methods to run (default all): {', '.join(METHODS)}",
    )
    b.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    b.add_argument(
        "--device",
        default="cpu",
        help="where the data and models live: cpu (default), cuda, cuda:1, ...; scipy stays "
        "on the CPU and is left out of a GPU run",
    )
    b.add_argument("--out", default="out/bench", help="folder for bench.md and the plots")
    b.add_argument("--json", default=None, help="write the results as JSON to this file")
    b.add_argument("--floor-reps", type=int, default=5, help="repetitions per floor timing")
    b.add_argument(
        "--no-scaling",
        action="store_true",
        help="skip the scaling table (1, 2, 4 gloo processes) and the communication model",
    )
    return b


def run_bench(args: argparse.Namespace) -> int:
    """Run the suite as ``args`` says; print and write the report."""
    if args.threads < 1:
        print(f"--threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    if args.floor_reps < 1:
        print(f"--floor-reps must be >= 1, got {args.floor_reps}", file=sys.stderr)
        return 2
    device = resolve_device(args.device)
    if device is None:
        return 2
    torch.set_num_threads(args.threads)
    if args.problems is None:
        args.problems = list(FAMILY_PROBLEMS[args.family])
    fams = families(args.floor_reps)
    problems = build_problems(quick=args.quick, tiny=args.tiny, keys=args.problems)
    problems = {k: p.on(device) for k, p in problems.items()}
    info = machine(fams)
    info["device"] = device
    host = where(info, device)
    started = datetime.datetime.now(datetime.timezone.utc)
    command = _command(args)
    print(f"bench on {host}, {info['threads']} threads, torch {info['torch']}")
    results = []
    for key in args.problems:
        problem = problems[key]
        print(f"{key}: {problem.title} ({problem.num_parameters} parameters)")
        results.append(
            run_problem(problem, methods=args.methods, floor_reps=args.floor_reps, log=print)
        )
    peers = ", ".join(
        f"{name.replace('_', '-')} {info[name] or 'not installed'}"
        for f in fams
        for name in f.versions()
    )
    header = (
        f"# secondorder bench ({'tiny' if args.tiny else 'quick' if args.quick else 'full'})\n\n"
        f"{started:%Y-%m-%d %H:%M} UTC; {host}, {info['cores_visible']} cores visible, "
        f"{info['threads']} torch threads; torch {info['torch']}, Python {info['python']}; "
        f"{peers}.\n"
        f"Command: `{command}`. Times are the optimizer's own (curve evaluations excluded)."
    )
    report = core_markdown(results, header, fams)
    scaling: dict[str, Any] | None = None
    # The scaling reports run gloo processes on the CPU, whatever --device says.
    if not (args.tiny or args.no_scaling) and args.family in ("lm", "all"):
        scaling_problem = scaling_module.QUICK if args.quick else scaling_module.FULL
        text, scaling = scaling_module.report(
            scaling_problem, (1, 2, 4), scaling_module.ModelAssumptions()
        )
        report += "\n\n## Scaling: processes, forms and communication\n\n" + text
    if not (args.tiny or args.no_scaling) and args.family in ("kfac", "all"):
        kfac_problem = kfac_scaling.QUICK if args.quick else kfac_scaling.FULL
        text, kfac_data = kfac_scaling.report(kfac_problem, (1, 2))
        scaling = {**(scaling or {}), "kfac": kfac_data}
        report += "\n\n## K-FAC scaling: COMM-OPT, MEM-OPT, HYBRID-OPT\n\n" + text
    print()
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(report + "\n")
    for pr in results:
        plot(pr, out / f"bench_{pr.problem.key}.png")
        if pr.problem.key in kfac_methods.PROBLEMS:
            kfac_methods.plot_steps(pr, out / f"bench_{pr.problem.key}_steps.png")
    print(f"wrote {out / 'bench.md'} and the plots of {len(results)} problems in {out}")
    if args.json:
        sections = [sec for f in fams for sec in f.sections]
        payload = {
            "date": started.isoformat(timespec="seconds"),
            "command": command,
            "mode": "tiny" if args.tiny else "quick" if args.quick else "full",
            "machine": info,
            "problems": {pr.problem.key: pr.summary(sections) for pr in results},
            **{c.key: c.data(results) for f in fams for c in f.closings},
            "scaling": scaling,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(finite_or_none(payload), indent=1, allow_nan=False)
        Path(args.json).write_text(text)
        print(f"wrote {args.json}")
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run."""
    parts = ["python -m benchmarks.bench"]
    if args.quick:
        parts.append("--quick")
    if args.tiny:
        parts.append("--tiny")
    if args.family != "lm":
        parts.append(f"--family {args.family}")
    if list(args.problems) != list(FAMILY_PROBLEMS[args.family]):
        parts.append("--problems " + " ".join(args.problems))
    if list(args.methods) != list(METHODS):
        parts.append("--methods " + " ".join(args.methods))
    if args.threads != 2:
        parts.append(f"--threads {args.threads}")
    if args.device != "cpu":
        parts.append(f"--device {args.device}")
    parts.append(f"--out {args.out}")
    if args.json:
        parts.append(f"--json {args.json}")
    return " ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.bench`` (from the repository's root)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run_bench(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
