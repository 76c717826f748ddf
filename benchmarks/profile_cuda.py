"""Where an LM step's time goes on a GPU: kernels against the host.

    python -m benchmarks.profile_cuda [--steps 5] [--problems sinc sinc_large wide_dual]

For each problem of the quick suite, secondorder LM (defaults and ``capturable=True``)
and, when installed, torch-levenberg-marquardt take a few warm-up steps on the GPU
and then ``--steps`` steps under ``torch.profiler``.  Printed per optimizer: the
wall time of a step, the time the GPU spent in kernels and copies during it (the sum
over them; work on overlapping streams would count twice), their ratio (below 1
means the GPU waits for the host: Python, launches, host reads) and the operators
that take most of the GPU's time and of the host's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from .core import Problem, Stepper, batches, resolve_device, sync
from .lm_methods import lm_method, tlm_method
from .lm_problems import make_problem


def _steppers(problem: Problem) -> list[tuple[str, Stepper]]:
    out = []
    capturable = lm_method("secondorder LM (capturable)", {"capturable": True, "check_every": 0})
    for method in (lm_method("secondorder LM (defaults)", {}), capturable, tlm_method(problem)):
        if method.make is not None:
            out.append((method.name, method.make(problem, problem.make_model())))
    return out


def _kernel_ms(prof: profile) -> float:
    """Milliseconds the GPU spent in kernels and copies over the profiled steps."""
    total_us = 0.0
    for e in prof.key_averages():
        # A user annotation (the optimizer's step range) spans its kernels on the GPU's
        # timeline too: counting it would count them twice.
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False):
            total_us += e.self_device_time_total
    return total_us / 1e3


def profile_one(name: str, step: Stepper, data: Sequence[tuple[torch.Tensor, torch.Tensor]],
                device: str, steps: int, warm: int, top: int) -> str:  # fmt: skip
    """Profile ``steps`` steps of ``step`` after ``warm`` unprofiled ones."""
    for k in range(warm):
        step(*data[k % len(data)])
    walls = []
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for k in range(steps):
            sync(device)
            t0 = time.perf_counter()
            step(*data[k % len(data)])
            sync(device)
            walls.append(time.perf_counter() - t0)
    wall_ms = statistics.median(walls) * 1e3
    gpu_ms = _kernel_ms(prof) / steps
    lines = [
        f"### {name}: {wall_ms:.2f} ms a step (median of {steps}, under the profiler); "
        f"kernels {gpu_ms:.2f} ms a step; GPU busy {gpu_ms / wall_ms:.0%} of the step",
        "",
        "```",
        prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top),
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top),
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.profile_cuda``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_cuda")
    parser.add_argument("--problems", nargs="+", default=["sinc", "sinc_large", "wide_dual"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny problems (a dry run)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if device is None:
        return 2
    cuda = device != "cpu"
    name = torch.cuda.get_device_name(device) if cuda else "the CPU (no kernels: a dry run)"
    print(f"# LM steps on {name} (torch {torch.__version__})\n")
    for key in args.problems:
        problem = make_problem(key, "tiny" if args.tiny else "quick").on(device)
        data = batches(problem, 0)[: args.warm + args.steps]
        print(f"## {key}: {problem.title}\n")
        for label, step in _steppers(problem):
            print(profile_one(label, step, data, device, args.steps, args.warm, args.top))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
