"""``make gpu-check``: the CUDA tests and benchmarks in one run, into ``RESULTS_CUDA.md``.

    python -m benchmarks.gpu_check [--dry-run] [--out PATH] [--budget-s 450] [--only NAME ...]

Runs each entry of :data:`STEPS` in its own process, in order, within one time budget
(an H100 or H200 gives it 8 minutes; the default budget leaves a margin), and writes
what each printed, with the device, the date and the command, to
``benchmarks/RESULTS_CUDA.md``.  Nothing is fetched: a peer missing from the
environment (:data:`PEERS`) is installed from its wheel in ``.whl/`` (``pip
--no-index``; ``make gpu-wheels`` builds them) when there is one, else its rows say it
is not installed.

``--dry-run`` runs the same steps on the CPU with tiny sizes
(``SECONDORDER_TEST_CUDA_DEVICE=cpu`` for the tests) and writes
``out/gpu_check_dry/RESULTS_CUDA.md``: it checks the script, not the GPU.

Other benchmarks join by appending a :class:`Step` to :data:`STEPS`, in priority order:
the last ones (K-FAC and Shampoo against their peers, with Shampoo's overhead over
AdamW) are skipped when the budget is spent.  A step whose module is not in the checkout
is reported as skipped, so a step may be listed before its benchmark lands.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PEERS", "STEPS", "Step", "main"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    """One entry of the check: ``python -m <args>`` on the GPU, ``<dry>`` in a dry run."""

    name: str
    title: str
    args: tuple[str, ...]
    dry: tuple[str, ...]
    timeout_s: float
    #: Environment added in a dry run.
    dry_env: dict[str, str] = field(default_factory=dict)

    @property
    def module(self) -> str:
        """The module the step runs (``pytest`` for the tests)."""
        return self.args[0]


_CPU_TESTS = {"SECONDORDER_TEST_CUDA_DEVICE": "cpu"}
#: The Shampoo side-by-side's configurations on the GPU, the overhead rows (f100) first:
#: a configuration that would start after ``--budget-s`` is listed as skipped.
_SHAMPOO_CONFIGS = (
    "cnn_shampoo_f100", "block1024_f100", "cnn_soap_f10", "block512_dim1024",
    "cnn_shampoo_f1", "block512_dim2048",
)  # fmt: skip
#: K-FAC's, KAISA's default (eigen) first.
_KFAC_CONFIGS = (
    "cnn_eigen_every10", "cnn_eigen_every1", "block512_eigen_every10", "block512_eigen_every1",
    "cnn_inverse_every10", "block512_inverse_every10",
)  # fmt: skip

#: The steps, in order.  Append to add a benchmark to ``make gpu-check``.
STEPS: list[Step] = [
    Step(
        "cuda-tests",
        "CUDA tests (pytest -m cuda)",
        ("pytest", "-q", "-m", "cuda", "-rs", "-p", "no:cacheprovider", "tests/cuda"),
        (
            "pytest", "-q", "-m", "cuda", "-rs", "-p", "no:cacheprovider",
            "tests/cuda/test_cuda_capturable.py", "-k", "eager_reason",
        ),
        100.0,
        _CPU_TESTS,
    ),
    Step(
        "lm-ops",
        "LM: aten operations dispatched per sinc step",
        ("benchmarks.lm_capturable", "--device", "cuda", "--ops-only"),
        ("benchmarks.lm_capturable", "--device", "cpu", "--ops-only", "--tiny"),
        35.0,
    ),
    Step(
        "lm-step-times",
        "LM: time per step, default and capturable, against torch-levenberg-marquardt",
        (
            "benchmarks.lm_capturable", "--device", "cuda", "--step-times", "--threads", "4",
            "--steps", "20", "--problems", "sinc", "sinc_large", "digits_mlp", "digits_cnn",
        ),
        (
            "benchmarks.lm_capturable", "--device", "cpu", "--step-times", "--tiny",
            "--steps", "2", "--problems", "sinc",
        ),
        95.0,
    ),
    Step(
        "lm-candidates",
        "LM: steps and seconds to target with 1, 2 or 4 damping values per capturable step",
        (
            "benchmarks.lm_capturable", "--device", "cuda", "--threads", "4", "--rounds", "1",
            "--problems", "sinc", "digits_mlp", "--candidates", "1", "2", "4",
            "--max-steps", "600",
        ),
        (
            "benchmarks.lm_capturable", "--device", "cpu", "--tiny", "--rounds", "1",
            "--problems", "sinc", "--candidates", "1", "2",
        ),
        45.0,
    ),
    Step(
        "lm-profile",
        "LM: GPU busy during a step (torch.profiler), sinc and sinc_large",
        (
            "benchmarks.profile_cuda", "--problems", "sinc", "sinc_large", "--steps", "5",
            "--top", "8",
        ),
        (
            "benchmarks.profile_cuda", "--device", "cpu", "--tiny", "--problems", "sinc",
            "--steps", "1", "--warm", "1", "--top", "3",
        ),
        55.0,
    ),
    Step(
        "batch-fits",
        "Batched fits on CUDA",
        (
            "benchmarks.batch_fits", "--device", "cuda", "--fits", "1000000", "--scipy", "200",
            "--rounds", "2",
        ),
        (
            "benchmarks.batch_fits", "--device", "cpu", "--fits", "64", "--scipy", "4",
            "--rounds", "1", "--threads", "1",
        ),
        45.0,
    ),
    Step(
        "shampoo-peers",
        "Shampoo and SOAP against DistributedShampoo; the overhead over AdamW at "
        "precondition_frequency 100",
        (
            "benchmarks.shampoo_side_by_side", "--device", "cuda", "--rounds", "3",
            "--budget-s", "35", "--configs", *_SHAMPOO_CONFIGS,
        ),
        (
            "benchmarks.shampoo_side_by_side", "--device", "cpu", "--tiny", "--budget-s", "35",
            "--configs", *_SHAMPOO_CONFIGS,
        ),
        65.0,
    ),
    Step(
        "kfac-peers",
        "K-FAC against kfac-pytorch (KAISA)",
        ("benchmarks.kfac_peer", "--device", "cuda", "--rounds", "3", "--budget-s", "15",
         *_KFAC_CONFIGS),
        ("benchmarks.kfac_peer", "--device", "cpu", "--tiny", "--budget-s", "15",
         *_KFAC_CONFIGS),
        40.0,
    ),
]  # fmt: skip


def _available(module: str) -> bool:
    """``module`` imports from a file (a bare folder of that name, say tests/kfac, does not)."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None


#: What the steps import beyond the GPU machine's own packages (``make gpu-wheels`` puts
#: their wheels in ``.whl/``): module, and the distribution its wheel is named after.
PEERS: tuple[tuple[str, str], ...] = (
    ("torch_levenberg_marquardt", "torch_levenberg_marquardt"),
    ("kfac", "kfac_pytorch"),
    ("distributed_shampoo", "torch_shampoo"),
    ("mnist1d", "mnist1d"),  # the K-FAC and Shampoo steps' data, generated offline
)


def _wheels(
    site: Path, wheel_dir: Path = ROOT / ".whl", peers: Sequence[tuple[str, str]] = PEERS
) -> str:
    """Install the wheels of the missing ``peers`` into ``site``; per peer, what it has.

    Only a missing peer's wheel is installed (an importable one is not shadowed), each
    on its own so that one that does not install leaves the others.
    """
    wheels = {w.name.split("-")[0].lower(): w for w in sorted(wheel_dir.glob("*.whl"))}
    states = []
    for module, dist in peers:
        wheel = wheels.get(dist.lower())
        if _available(module):
            states.append(f"{module}: installed")
        elif wheel is None:
            states.append(f"{module}: not installed (no {dist} wheel in {wheel_dir.name}/)")
        else:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            cmd += ["--no-compile", "--target", str(site), str(wheel)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode == 0:
                states.append(f"{module}: from {wheel_dir.name}/{wheel.name}")
            else:
                why = done.stderr.strip().splitlines()[-1:] or ["?"]
                states.append(f"{module}: {wheel.name} failed to install ({why[0]})")
    return ", ".join(states)


def _device_name(dry: bool) -> str:
    if dry:
        return "the CPU (a dry run: no GPU measured)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"


def _run(step: Step, dry: bool, env: dict[str, str], budget: float) -> tuple[str, str]:
    """``(status, output)`` of one step within ``budget`` seconds."""
    args = step.dry if dry else step.args
    if not _available(step.module):
        return "skipped", f"{step.module} is not in this checkout"
    if budget < 5.0:
        return "skipped", "the time budget is spent"
    cmd = [sys.executable, "-m", *args]
    run_env = {**env, **(step.dry_env if dry else {})}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env=run_env,
            capture_output=True,
            text=True,
            timeout=min(step.timeout_s, budget),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        # What was printed before the kill; bytes even in text mode on POSIX.
        out = exc.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        return f"timed out after {time.perf_counter() - t0:.0f} s", out[-4000:]
    seconds = time.perf_counter() - t0
    output = done.stdout
    if done.returncode != 0:
        output += "\n" + done.stderr[-3000:]
    status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    return f"{status}, {seconds:.0f} s", output.strip()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the steps and write the results file; exit 1 if a step failed."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    p.add_argument("--dry-run", action="store_true", help="the steps on the CPU, tiny sizes")
    p.add_argument("--out", default=None, help="the results file to write")
    p.add_argument("--budget-s", type=float, default=450.0, help="seconds for all the steps")
    p.add_argument("--only", nargs="+", default=None, help="run only these steps (by name)")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="the peers' wheels (a folder)")
    args = p.parse_args(argv)
    names = [s.name for s in STEPS]
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        p.error(f"unknown steps {unknown}; valid choices are {names}")
    dry = args.dry_run
    default_out = "out/gpu_check_dry/RESULTS_CUDA.md" if dry else "benchmarks/RESULTS_CUDA.md"
    out = ROOT / (args.out or default_out)
    started = time.perf_counter()
    site = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))
    wheels = _wheels(site, Path(args.wheels))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    command = "python -m benchmarks.gpu_check " + shlex.join(list(argv or sys.argv[1:]))
    lines = [
        "# secondorder on CUDA: `make gpu-check`",
        "",
        f"- device: {_device_name(dry)}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `{command.strip()}`",
        f"- peers: {wheels}",
        "",
    ]
    failed = False
    for step in STEPS:
        if args.only is not None and step.name not in args.only:
            continue
        remaining = args.budget_s - (time.perf_counter() - started)
        status, output = _run(step, dry, env, remaining)
        print(f"[gpu-check] {step.name}: {status}", flush=True)
        failed |= status.startswith(("failed", "timed out"))
        shown = " ".join(step.dry if dry else step.args)
        lines += [f"## {step.title}", "", f"`python -m {shown}`: {status}", ""]
        if output:
            # The benchmarks print Markdown; the tests' output is shown as it is.
            fence = ["```"] if step.module == "pytest" else []
            lines += [*fence, output, *fence, ""]
    shutil.rmtree(site, ignore_errors=True)
    total = time.perf_counter() - started
    lines.append(f"All steps: {total:.0f} s.")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"[gpu-check] wrote {out} ({total:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
