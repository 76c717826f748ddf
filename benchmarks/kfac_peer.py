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
unpacks under ``out/peers/src``; without it the section says how to install it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secondorder.compat.kfac.arguments import kaisa_modules
from secondorder.kfac import KFAC

from .core import Problem, Section
from .workloads import mnist1d, mnist1d_cnn

__all__ = ["CONFIGS", "PeerConfig", "import_kaisa", "markdown", "run", "section"]

ROOT = Path(__file__).resolve().parents[1]
#: The stages both sides report, in seconds per step (means over the profiled round).
STAGES = ("fwd+bwd", "factors", "inverses", "precondition", "sgd")
#: The stages' clock: the calling thread's CPU time, which other processes on a shared
#: machine disturb far less than the wall clock (with one torch thread, every kernel
#: runs on the calling thread).
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


class BlockLinears(nn.Module):
    """A pre-norm transformer block whose Linear layers see tokens as rows.

    ``(B, T, d)`` in and out; the four Linear layers (qkv ``d→3d``, output ``d→d``, MLP
    ``d→4d→d``) are applied to the ``(B·T, d)`` rows, so that each token is one sample
    for both K-FAC implementations (KAISA averages a Linear layer's G over extra
    dimensions where secondorder sums them per sample: with rows, both agree).
    """

    def __init__(self, d: int, heads: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.qkv(self.ln1(x).reshape(b * t, d))
        q, k, v = h.reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b * t, d)).reshape(b, t, d)
        m = self.fc2(F.gelu(self.fc1(self.ln2(x).reshape(b * t, d))))
        return x + m.reshape(b, t, d)


@dataclass(frozen=True)
class PeerConfig:
    """One side-by-side configuration: model, batches and KAISA's hyperparameters."""

    key: str
    title: str
    model: Callable[[], nn.Module]
    batches: Callable[[], list[tuple[Tensor, Tensor]]]
    loss: Callable[[Tensor, Tensor], Tensor]
    every: int
    steps: int  # per side per round (a multiple of ``every``: same work each round)
    lr: float = 0.1
    damping: float = 0.003
    kl_clip: float = 0.001
    factor_decay: float = 0.95
    compute_method: str = "eigen"


def _cnn_batches() -> list[tuple[Tensor, Tensor]]:
    (x, y), _ = mnist1d(5000)
    return [(x[i : i + 128], y[i : i + 128]) for i in range(0, x.shape[0] - 127, 128)]


def _block_model(d: int) -> Callable[[], nn.Module]:
    return lambda: BlockLinears(d, heads=8)


def _block_batches(d: int, b: int = 8, t: int = 64, n: int = 8) -> list[tuple[Tensor, Tensor]]:
    # a fixed random teacher: the block learns to map random inputs to its outputs
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(d, d, generator=gen) / math.sqrt(d)
    out = []
    for _ in range(n):
        x = torch.randn(b, t, d, generator=gen)
        out.append((x, torch.tanh(x @ teacher)))
    return out


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


def configs(quick: bool = True) -> list[PeerConfig]:
    """The configurations; ``quick`` runs fewer steps per round of the slow ones."""
    cnn = mnist1d_cnn()
    d = 512
    out = []
    for method in ("eigen", "inverse"):
        for every, steps in ((10, 20), (1, 4 if quick else 10)):
            out.append(
                PeerConfig(
                    key=f"cnn_{method}_every{every}",
                    title=f"MNIST-1D CNN, batch 128, {method}, every {every}",
                    model=cnn,
                    batches=_cnn_batches,
                    loss=F.cross_entropy,
                    every=every,
                    steps=steps,
                    compute_method=method,
                )
            )
        for every, steps in ((10, 10), (1, 2 if quick else 5)):
            out.append(
                PeerConfig(
                    key=f"block{d}_{method}_every{every}",
                    title=f"transformer block d={d} (MLP 4x), 512 tokens, {method}, every {every}",
                    model=_block_model(d),
                    batches=functools.partial(_block_batches, d),
                    loss=_mse,
                    every=every,
                    steps=steps,
                    lr=0.05,
                    compute_method=method,
                )
            )
    return out


CONFIGS = configs()


@contextlib.contextmanager
def _timed(objs: list[Any], names: dict[str, str], out: dict[str, float]) -> Iterator[None]:
    """Add the time of every call of ``obj.<attr>`` to ``out[label]`` (instance shadows)."""
    saved: list[tuple[Any, str]] = []
    for obj in objs:
        for attr, label in names.items():
            fn = getattr(obj, attr, None)
            if fn is None:
                continue

            def wrapped(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
                t0 = CLOCK()
                try:
                    return _fn(*a, **k)
                finally:
                    out[_label] += CLOCK() - t0

            setattr(obj, attr, wrapped)
            saved.append((obj, attr))
    try:
        yield
    finally:
        for obj, attr in saved:
            delattr(obj, attr)


class Side:
    """One implementation's run: model, preconditioner, SGD and its place in the batches."""

    def __init__(self, cfg: PeerConfig, name: str, kaisa: ModuleType | None) -> None:
        self.cfg, self.name = cfg, name
        self.model = cfg.model()
        self.batches = cfg.batches()
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
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            x, y = self.batches[self.i % len(self.batches)]
            self.i += 1
            if stages is None:
                self._step(x, y)
            else:
                self._profiled(x, y, stages)
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
        with _timed(objs, names, spent), _timed(layers, hooked, spent):
            t0 = CLOCK()
            self.opt.zero_grad(set_to_none=True)
            self.cfg.loss(self.model(x), y).backward()
            t1 = CLOCK()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.pre.step()
            t2 = CLOCK()
            self.opt.step()
            t3 = CLOCK()
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


def run_config(cfg: PeerConfig, kaisa: ModuleType, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of ``cfg``: per-round times, their ratios and both final losses."""
    ours, ref = Side(cfg, "ours", None), Side(cfg, "kfac-pytorch", kaisa)
    # one round untimed: first-call allocations and lazy set-up on both sides
    ours.steps(cfg.steps)
    ref.steps(cfg.steps)
    t_ours, t_ref, ratio, cpu_ratio = [], [], [], []
    for r in range(rounds):
        if r % 2:
            b, cb = ref.steps(cfg.steps)
            a, ca = ours.steps(cfg.steps)
        else:
            a, ca = ours.steps(cfg.steps)
            b, cb = ref.steps(cfg.steps)
        t_ours.append(a / cfg.steps)
        t_ref.append(b / cfg.steps)
        ratio.append(a / b)
        cpu_ratio.append(ca / cb)
    st_ours, st_ref = dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 0.0)
    ours.steps(cfg.steps, st_ours)
    ref.steps(cfg.steps, st_ref)
    loss_ours, loss_ref = ours.loss(), ref.loss()
    return {
        "key": cfg.key,
        "title": cfg.title,
        "steps_per_round": cfg.steps,
        "rounds": rounds,
        "steps_run": cfg.steps * (rounds + 2),
        "ours_s": statistics.median(t_ours),
        "ref_s": statistics.median(t_ref),
        "ratio_median": statistics.median(ratio),
        "ratios": ratio,
        "cpu_ratio_median": statistics.median(cpu_ratio),
        "cpu_ratios": cpu_ratio,
        "stages_ours": {k: v / cfg.steps for k, v in st_ours.items()},
        "stages_ref": {k: v / cfg.steps for k, v in st_ref.items()},
        "loss_ours": loss_ours,
        "loss_ref": loss_ref,
    }


def run(
    quick: bool = True, rounds: int | None = None, keys: list[str] | None = None
) -> dict[str, Any]:
    """Every configuration (or ``keys``); ``{"skipped": why}`` without kfac-pytorch."""
    kaisa = import_kaisa()
    if kaisa is None:
        return {"skipped": "kfac-pytorch is not importable: run `make bench-peers`."}
    n = rounds if rounds is not None else (5 if quick else 9)
    load_before = os.getloadavg()[0]
    rows = [run_config(cfg, kaisa, n) for cfg in configs(quick) if keys is None or cfg.key in keys]
    return {
        "load": [load_before, os.getloadavg()[0]],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "kfac_pytorch": getattr(sys.modules.get("kfac"), "__version__", "?"),
        "configs": rows,
    }


def markdown(data: dict[str, Any]) -> list[str]:
    """The side-by-side table and the per-stage table."""
    if "skipped" in data:
        return [f"Side by side with kfac-pytorch (KAISA): skipped ({data['skipped']})", ""]
    lines = [
        f"Side by side with kfac-pytorch (KAISA) {data['kfac_pytorch']}, one process, "
        f"{data['threads']} thread(s), load average {data['load'][0]:.1f} before and "
        f"{data['load'][1]:.1f} after on {data['cores']} cores: ours/reference step time, "
        "median over interleaved rounds (each side's steps per round in brackets) by the "
        "wall clock and by the thread's CPU time (which other work on a shared machine "
        "disturbs less), and the loss of both on the first batch after the run.",
        "",
        "| configuration | ours s/step | KAISA s/step | ours / KAISA, wall (rounds) "
        "| ours / KAISA, CPU | loss (ours, KAISA) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in data["configs"]:
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        lines.append(
            f"| {r['title']} [{r['steps_per_round']}] | {r['ours_s']:.4f} | {r['ref_s']:.4f} "
            f"| **{r['ratio_median']:.2f}** ({each}) | {r['cpu_ratio_median']:.2f} "
            f"| {r['loss_ours']:.4f}, {r['loss_ref']:.4f} |"
        )
    lines += [
        "",
        "Stages (CPU s/step, one profiled round per side; factors include the hooks' statistics):",
        "",
        "| configuration | side | " + " | ".join(STAGES) + " |",
        "|---|---|" + "---:|" * len(STAGES),
    ]
    for r in data["configs"]:
        for side, key in (("ours", "stages_ours"), ("KAISA", "stages_ref")):
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
    """``python -m benchmarks.kfac_peer [--full] [--rounds N] [--threads T] [keys...]``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("keys", nargs="*", help="configurations (default: all)")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = run(not args.full, args.rounds, args.keys or None)
    print("\n".join(markdown(data)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
