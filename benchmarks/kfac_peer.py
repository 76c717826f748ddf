"""secondorder's K-FAC and kfac-pytorch (KAISA) side by side, in one process.

Both train the same model from the same initial weights on the same batches, K-FAC then
SGD (momentum 0.9) with the same hyperparameters: KAISA's values, which native
:class:`secondorder.kfac.KFAC` reads with ``loss_reduction="sum"`` (the factors built
from the gradient of the loss as backpropagated, KAISA's scale: see
:mod:`secondorder.compat.kfac`), and the layers KAISA registers (its ``nn.Linear``; it
has no ``nn.Conv1d``).  The timed rounds interleave: each round runs ``steps`` steps of
one side, then of the other (the order alternating), each side continuing its own run;
the ratio is ours/reference per round, and the report gives medians.  A last round
per side is run with its stages timed.  After the rounds, both losses on one fixed
batch are reported: they must agree (the runs coincide up to float32 rounding).

Configurations (:data:`CONFIGS`): the MNIST-1D CNN (Conv1d-Conv1d-Linear(1280,256)-
Linear(256,10), batches of 128) and the Linear layers of a transformer block (d_model
512, MLP 4x, tokens as rows), each with factors and decompositions every 10 steps and
every step, eigen method (KAISA's default).

kfac-pytorch is found as the module ``kfac``, else in the tree ``make bench-peers``
unpacks under ``out/peers/src``; without it the suite's section says how to install it,
and the command line times ours alone.

``--device cuda`` puts models and batches on the GPU and times rounds and stages by the
wall clock between ``torch.cuda.synchronize()`` calls (the thread's CPU time does not see
the GPU's work).  ``--tiny`` runs toy models at a frequency of at most 2 so that every
path runs in seconds (``make gpu-check --dry-run``): its numbers measure nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from secondorder.compat.kfac.arguments import kaisa_modules
from secondorder.kfac import KFAC

from .core import Problem, Section
from .device_timing import Clock, device_words, to_device, warm_up
from .kfac_peer_configs import CONFIGS, PeerConfig, configs, tiny

__all__ = ["CONFIGS", "PeerConfig", "import_kaisa", "markdown", "run", "section", "tiny"]

ROOT = Path(__file__).resolve().parents[1]
#: The stages both sides report, in seconds per step (means over the profiled round).
STAGES = ("fwd+bwd", "factors", "inverses", "precondition", "sgd")
#: The stages' clock on the CPU: the calling thread's CPU time, which other processes on
#: a shared machine disturb far less than the wall clock (with one torch thread, every
#: kernel runs on the calling thread).  On CUDA: :meth:`Clock.now`, synchronised wall time.
CLOCK = time.thread_time


def import_kaisa() -> ModuleType | None:
    """kfac-pytorch's ``kfac`` package, or None (``make bench-peers`` installs it)."""
    try:
        return importlib.import_module("kfac.preconditioner")
    except ImportError:
        pass
    for tree in sorted((ROOT / "out" / "peers" / "src").glob("kfac-pytorch-*/src")):
        if (tree / "kfac" / "preconditioner.py").is_file():
            sys.path.insert(0, str(tree))
            try:
                return importlib.import_module("kfac.preconditioner")
            except ImportError:
                sys.path.remove(str(tree))
    return None


@contextlib.contextmanager
def _timed(
    objs: list[Any],
    names: dict[str, str],
    out: dict[str, float],
    clock: Callable[[], float] = CLOCK,
) -> Iterator[None]:
    """Add the time of every call of ``obj.<attr>`` to ``out[label]`` (instance shadows)."""
    saved: list[tuple[Any, str]] = []
    for obj in objs:
        for attr, label in names.items():
            fn = getattr(obj, attr, None)
            if fn is None:
                continue

            def wrapped(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
                t0 = clock()
                try:
                    return _fn(*a, **k)
                finally:
                    out[_label] += clock() - t0

            setattr(obj, attr, wrapped)
            saved.append((obj, attr))
    try:
        yield
    finally:
        for obj, attr in saved:
            delattr(obj, attr)


class Side:
    """One implementation's run: model, preconditioner, SGD and its place in the batches."""

    def __init__(
        self, cfg: PeerConfig, name: str, kaisa: ModuleType | None, clock: Clock | None = None
    ) -> None:
        self.cfg, self.name = cfg, name
        self.clock = clock or Clock(torch.device("cpu"))
        self.model = cfg.model().to(self.clock.device)
        self.batches = to_device(cfg.batches(), self.clock.device)
        self.i = 0
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        common: dict[str, Any] = {
            "factor_update_steps": cfg.every,
            "inv_update_steps": cfg.every,
            "damping": cfg.damping,
            "factor_decay": cfg.factor_decay,
            "kl_clip": cfg.kl_clip,
            "lr": cfg.lr,
        }
        if kaisa is None:
            self.pre: Any = KFAC(
                self.model,
                **common,
                compute_method=cfg.compute_method,
                modules=kaisa_modules(self.model, []),
                loss_reduction="sum",  # KAISA's factor scale: its damping, its kl_clip
            )
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.pre = kaisa.KFACPreconditioner(
                    self.model, **common, compute_method=cfg.compute_method.upper()
                )

    def steps(self, n: int, stages: dict[str, float] | None = None) -> tuple[float, float]:
        """Run ``n`` steps: their wall and CPU time (stages added into ``stages`` if given)."""
        self.clock.sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            x, y = self.batches[self.i % len(self.batches)]
            self.i += 1
            if stages is None:
                self._step(x, y)
            else:
                self._profiled(x, y, stages)
        self.clock.sync()
        return time.perf_counter() - t0, time.thread_time() - c0

    def _step(self, x: Tensor, y: Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.cfg.loss(self.model(x), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.pre.step()
        self.opt.step()

    def _profiled(self, x: Tensor, y: Tensor, st: dict[str, float]) -> None:
        spent = dict.fromkeys(("hook", "factors", "inverses", "precondition"), 0.0)
        if isinstance(self.pre, KFAC):
            layers = list(self.pre.layers.values())
            objs: list[Any] = [self.pre]
            names = {"_update_factors": "factors", "_update_inverses": "inverses"}
            hooked = {"add_pair": "hook"}
        else:
            layers = [layer for _, layer in self.pre._layers.values()]
            objs = [self.pre]
            names = {}
            hooked = {
                "save_layer_input": "hook",
                "save_layer_grad_output": "hook",
                "update_a_factor": "hook",
                "update_g_factor": "hook",
                "compute_a_inv": "inverses",
                "compute_g_inv": "inverses",
            }
        now = self.clock.now
        with _timed(objs, names, spent, now), _timed(layers, hooked, spent, now):
            t0 = now()
            self.opt.zero_grad(set_to_none=True)
            self.cfg.loss(self.model(x), y).backward()
            t1 = now()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.pre.step()
            t2 = now()
            self.opt.step()
            t3 = now()
        st["fwd+bwd"] += (t1 - t0) - spent["hook"]
        st["factors"] += spent["hook"] + spent["factors"]
        st["inverses"] += spent["inverses"]
        st["precondition"] += (t2 - t1) - spent["factors"] - spent["inverses"]
        st["sgd"] += t3 - t2

    def loss(self) -> float:
        """The loss on the first batch, with the current weights."""
        x, y = self.batches[0]
        with torch.no_grad():
            return float(self.cfg.loss(self.model(x), y))


def run_config(
    cfg: PeerConfig, kaisa: ModuleType | None, rounds: int, clock: Clock | None = None
) -> dict[str, Any]:
    """Interleaved rounds of ``cfg``: per-round times, their ratios and both final losses.

    Without ``kaisa``, ours alone: its times, stages and loss.
    """
    sides = [Side(cfg, "ours", None, clock)]
    if kaisa is not None:
        sides.append(Side(cfg, "kfac-pytorch", kaisa, clock))
    # one round untimed: first-call allocations and lazy set-up on both sides
    for side in sides:
        side.steps(cfg.steps)
    wall: dict[str, list[float]] = {side.name: [] for side in sides}
    cpu: dict[str, list[float]] = {side.name: [] for side in sides}
    for r in range(rounds):
        for side in sides[::-1] if r % 2 else sides:
            a, ca = side.steps(cfg.steps)
            wall[side.name].append(a)
            cpu[side.name].append(ca)
    stages = {side.name: dict.fromkeys(STAGES, 0.0) for side in sides}
    for side in sides:
        side.steps(cfg.steps, stages[side.name])
    out: dict[str, Any] = {
        "key": cfg.key,
        "title": cfg.title,
        "steps_per_round": cfg.steps,
        "rounds": rounds,
        "steps_run": cfg.steps * (rounds + 2),
        "ours_s": statistics.median(wall["ours"]) / cfg.steps,
        "stages_ours": {k: v / cfg.steps for k, v in stages["ours"].items()},
        "loss_ours": sides[0].loss(),
    }
    if kaisa is not None:
        ratio = [a / b for a, b in zip(wall["ours"], wall["kfac-pytorch"], strict=True)]
        cpu_ratio = [a / b for a, b in zip(cpu["ours"], cpu["kfac-pytorch"], strict=True)]
        out |= {
            "ref_s": statistics.median(wall["kfac-pytorch"]) / cfg.steps,
            "ratio_median": statistics.median(ratio),
            "ratios": ratio,
            "cpu_ratio_median": statistics.median(cpu_ratio),
            "cpu_ratios": cpu_ratio,
            "stages_ref": {k: v / cfg.steps for k, v in stages["kfac-pytorch"].items()},
            "loss_ref": sides[1].loss(),
        }
    return out


def run(
    quick: bool = True,
    rounds: int | None = None,
    keys: list[str] | None = None,
    *,
    device: str = "cpu",
    toy: bool = False,
    alone: bool = False,
    budget_s: float | None = None,
    keep_going: bool = False,
) -> dict[str, Any]:
    """Every configuration (or ``keys``) on ``device``; ``toy`` at :func:`tiny` sizes.

    Without kfac-pytorch, ``{"skipped": why}``, or ours timed alone if ``alone``.  No
    configuration starts once ``budget_s`` seconds have passed.  With ``keep_going``, a
    configuration that raises is listed as failed (``"failed": True``) and the next run.
    """
    kaisa = import_kaisa()
    if kaisa is None and not alone:
        return {"skipped": "kfac-pytorch is not importable: run `make bench-peers`."}
    n = rounds if rounds is not None else (1 if toy else 5 if quick else 9)
    clock = Clock(torch.device(device))
    warm_up(clock.device)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    rows, skipped, failed = [], [], False
    for cfg in configs(quick):
        if keys is not None and cfg.key not in keys:
            continue
        if budget_s is not None and time.perf_counter() - started > budget_s:
            skipped.append(f"{cfg.title}: --budget-s {budget_s:g} spent")
            continue
        try:
            rows.append(run_config(tiny(cfg) if toy else cfg, kaisa, n, clock))
        except ModuleNotFoundError as exc:
            if exc.name != "mnist1d":
                raise
            skipped.append(f"{cfg.title}: mnist1d is not installed")
        except Exception as exc:
            if not keep_going:
                raise
            skipped.append(f"{cfg.title}: failed: {type(exc).__name__}: {exc}")
            failed = True
    return {
        "load": [load_before, os.getloadavg()[0]],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "kfac_pytorch": None
        if kaisa is None
        else getattr(sys.modules.get("kfac"), "__version__", "?"),
        "device": device_words(clock.device),
        "clock": clock.name,
        "tiny": toy,
        "skipped_configs": skipped,
        "failed": failed,
        "configs": rows,
    }


def markdown(data: dict[str, Any]) -> list[str]:
    """The side-by-side table and the per-stage table."""
    if "skipped" in data:
        return [f"Side by side with kfac-pytorch (KAISA): skipped ({data['skipped']})", ""]
    cuda = data.get("clock") == "wall"
    peer = data["kfac_pytorch"] is not None
    setting = (
        f"one process, {data['threads']} thread(s), load average {data['load'][0]:.1f} "
        f"before and {data['load'][1]:.1f} after on {data['cores']} cores"
    )
    how = "median over interleaved rounds (each side's steps per round in brackets) by the " + (
        "wall clock between torch.cuda.synchronize() calls"
        if cuda
        else "wall clock and by the thread's CPU time (which other work on a shared machine "
        "disturbs less)"
    )
    if peer:
        on = f" on {data['device']}" if cuda else ""
        lines = [
            f"Side by side with kfac-pytorch (KAISA) {data['kfac_pytorch']}{on}, {setting}: "
            f"ours/reference step time, {how}, and the loss of both on the first batch "
            "after the run."
        ]
    else:
        lines = [
            "kfac-pytorch (KAISA) is not installed (`make bench-peers`, or `make gpu-wheels` "
            f"for `make gpu-check`): ours alone on {data['device']}, {setting}: step time, "
            f"{how}, and the loss on the first batch after the run."
        ]
    if data.get("tiny"):
        lines.append("--tiny: toy models and frequencies, a check of the script; nothing measured.")
    lines += [
        "",
        "| configuration | ours s/step | KAISA s/step | ours / KAISA, wall (rounds) "
        + ("" if cuda else "| ours / KAISA, CPU ")
        + "| loss (ours, KAISA) |",
        "|---|---:|---:|---:|" + ("" if cuda else "---:|") + "---|",
    ]
    for r in data["configs"]:
        head = f"| {r['title']} [{r['steps_per_round']}] | {r['ours_s']:.4f} |"
        if not peer:
            cells = " not installed | - |" + ("" if cuda else " - |")
            lines.append(f"{head}{cells} {r['loss_ours']:.4f}, - |")
            continue
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        cpu = "" if cuda else f" {r['cpu_ratio_median']:.2f} |"
        lines.append(
            f"{head} {r['ref_s']:.4f} | **{r['ratio_median']:.2f}** ({each}) |{cpu} "
            f"{r['loss_ours']:.4f}, {r['loss_ref']:.4f} |"
        )
    lines += [f"| {why} |" for why in data.get("skipped_configs", [])]
    clock = "wall s/step, synchronised around each stage" if cuda else "CPU s/step"
    lines += [
        "",
        f"Stages ({clock}, one profiled round per side; factors include the hooks' statistics):",
        "",
        "| configuration | side | " + " | ".join(STAGES) + " |",
        "|---|---|" + "---:|" * len(STAGES),
    ]
    for r in data["configs"]:
        for side, key in (("ours", "stages_ours"), ("KAISA", "stages_ref")):
            if key in r:
                cells = " | ".join(f"{r[key][s]:.4f}" for s in STAGES)
                lines.append(f"| {r['key']} | {side} | {cells} |")
    return [*lines, ""]


def section() -> Section:
    """The K-FAC family's side-by-side section: run on a problem whose settings ask for it.

    ``make_problem`` sets ``kaisa_side_by_side`` to the mode (``"quick"``, ``"full"``) on
    the MNIST-1D CNN problem, None in tiny mode: the comparison runs once per bench.
    """

    def measure(problem: Problem, methods: Any, results: Any) -> dict[str, Any] | None:
        mode = problem.setting("kaisa_side_by_side")
        return None if mode is None else run(quick=mode != "full")

    return Section(
        key="kaisa_side_by_side",
        measure=measure,
        summary=lambda pr: (
            {"kaisa_side_by_side": pr.sections["kaisa_side_by_side"]}
            if pr.sections.get("kaisa_side_by_side") is not None
            else {}
        ),
        markdown=lambda pr: (
            markdown(pr.sections["kaisa_side_by_side"])
            if pr.sections.get("kaisa_side_by_side") is not None
            else []
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.kfac_peer [--full] [--rounds N] [--threads T] [keys...]``.

    Without kfac-pytorch, ours is timed alone.
    """
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("keys", nargs="*", help="configurations (default: all)")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a check, not a measurement")
    ap.add_argument("--budget-s", type=float, default=None, help="start no config after this")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("Invalid --device=cuda: torch sees no CUDA device; pass --device cpu")
    torch.set_num_threads(args.threads)
    data = run(
        not args.full,
        args.rounds,
        args.keys or None,
        device=args.device,
        toy=args.tiny,
        alone=True,
        budget_s=args.budget_s,
        keep_going=True,
    )
    print("\n".join(markdown(data)))
    return 1 if data.get("failed") else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
