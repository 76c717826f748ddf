"""What raising glibc's allocator thresholds gains a full-batch CPU fit, step by step.

    python -m benchmarks.experiments.host_memory [--rounds 4] [--warm 150] [--steps 40]
        [--points 20000] [--threads 2]

The sinc fit of the LM suite (``Linear(1,64)-Tanh-Linear(64,1)``, float32, full
batch, defaults) in fresh processes, alternately with the thresholds raised (what
:class:`~secondorder.lm.LevenbergMarquardt` does on CPU,
:mod:`secondorder._host_memory`) and left where a fresh process has them.  Each
process takes ``--warm`` steps, then times ``--steps`` consecutive steps, as a
training loop runs them, and counts their page faults (``ru_minflt``).  Prints
each process's ms per step and faults per step, then the medians.  A process is
the unit: the thresholds are process state, so the two cannot share one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch
    import secondorder._host_memory as host
    from secondorder.lm import LevenbergMarquardt
    from benchmarks.workloads import mlp, sinc_data

    raised, warm, steps, points, threads = sys.argv[1] == "raised", *map(int, sys.argv[2:])
    torch.set_num_threads(threads)
    if raised:
        host.raise_allocator_thresholds()  # the user's opt-in (secondorder.tuning)
    x, y = sinc_data(points)
    opt = LevenbergMarquardt(mlp([1, 64, 1])())
    for _ in range(warm):
        opt.step(x, y)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(steps):
        info = opt.step(x, y)
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(json.dumps({"ms": 1e3 * seconds / steps, "faults": faults / steps,
                      "loss": info.loss}))
    """
)


def run(raised: bool, warm: int, steps: int, points: int, threads: int) -> dict[str, float]:
    """One process: ms and page faults per step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    env["PYTHONPATH"] = str(ROOT)
    args = ["raised" if raised else "low", str(warm), str(steps), str(points), str(threads)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    """Alternate the two settings over ``--rounds`` rounds and print the medians."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warm", type=int, default=150)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"{now:%Y-%m-%d %H:%M} UTC, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
    results: dict[str, list[dict[str, float]]] = {"low": [], "raised": []}
    for i in range(args.rounds):
        # Alternate which goes first, so a drift in the machine's speed hits both.
        for name in ("low", "raised") if i % 2 == 0 else ("raised", "low"):
            r = run(name == "raised", args.warm, args.steps, args.points, args.threads)
            results[name].append(r)
            print(f"  {name:6s} {r['ms']:6.2f} ms/step, {r['faults']:7.0f} faults/step")
    med = {k: statistics.median(r["ms"] for r in v) for k, v in results.items()}
    faults = {k: statistics.median(r["faults"] for r in v) for k, v in results.items()}
    for k in results:
        print(f"{k:6s} median {med[k]:6.2f} ms/step, {faults[k]:7.0f} faults/step")
    print(f"low / raised: {med['low'] / med['raised']:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
