"""The Shampoo family's benchmark: secondorder Shampoo and SOAP against AdamW and PyPI peers.

Problems (``--problems``; mini-batches, the same batches for every method):

* ``shampoo_mnist1d_cnn``: the issue's Conv1d(1,32,5)-Conv1d(32,32,3)-Linear(1280,256)-
  Linear(256,10) (333,802 parameters) on MNIST-1D (``mnist1d``'s offline generator, 4,000
  train / 1,000 test), batches of 128, target 85 % test accuracy;
* ``shampoo_digits_mlp``: scikit-learn digits (1,437 / 360), MLP 64-128-10 (Tanh),
  batches of 64, target 95 % test accuracy.

Methods (``--methods``):

* ``shampoo``: :class:`secondorder.shampoo.Shampoo` with ``precondition_frequency=1``
  (run for fewer steps: it is there for the step-time ratio);
* ``shampoo_f100``: the same with ``precondition_frequency=100``;
* ``soap``: its eigenvalue-corrected variant (``preconditioner="eigenvalue_corrected"``),
  basis refreshed every 10 steps;
* ``shampoo_adamw``: ``torch.optim.AdamW`` over a small learning-rate grid
  (``settings["adamw_lrs"]``);
* ``shampoo_peers``: pytorch-optimizer's ``Shampoo`` and ``SOAP`` and heavyball's
  ``SOAP`` (``torch.compile`` off: eager, like every other row); skipped with the
  import error when a package does not import.

Every Shampoo row times ``step()`` alone next to the whole iteration, and where the step
goes: factor update (with SOAP's eigenbasis second moment), root inverse (or
eigenbasis), preconditioning, grafting, the rest.  Section: each row's step and
iteration time against AdamW's, next to the issue's DistributedShampoo reference
(98x / 15x per step, 14.2x / 2.95x per iteration).  Closing: the 2-process scaling
report (:mod:`benchmarks.shampoo_scaling`) on quick and full runs.  Numbers are
reported, never asserted.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secondorder.shampoo import AdamGraftingConfig, Shampoo

from .core import (
    Closing,
    Column,
    Family,
    Method,
    MethodResult,
    Problem,
    ProblemResult,
    Section,
    Stepper,
    StepReport,
    only_on,
)
from .workloads import digits, mlp, mnist1d, mnist1d_cnn

__all__ = [
    "FAMILY_NAME",
    "METHODS",
    "PROBLEMS",
    "REFERENCE",
    "STAGES",
    "family",
    "make_problem",
    "methods_for",
    "ratios",
    "shampoo_options",
    "stage_timing",
]

FAMILY_NAME = "secondorder Shampoo"
PROBLEMS = ("shampoo_mnist1d_cnn", "shampoo_digits_mlp")
METHODS = ("shampoo", "shampoo_f100", "soap", "shampoo_adamw", "shampoo_peers")
#: Stages of a Shampoo step, as reported (seconds per step; ``other`` is the rest).
STAGES = ("factor", "root", "precondition", "grafting", "other")
#: The issue's DistributedShampoo measurement on this network (ratios to AdamW).
REFERENCE = {1: {"step": 98.0, "iteration": 14.2}, 100: {"step": 15.0, "iteration": 2.95}}

#: Shampoo's settings in every row (DistributedShampoo's names): AdamW-like betas,
#: Adam grafting, decoupled weight decay; ``max_preconditioner_dim`` its default 1024.
SHAMPOO_DEFAULTS: dict[str, Any] = {
    "betas": (0.9, 0.999),
    "epsilon": 1e-12,
    "weight_decay": 1e-4,
    "max_preconditioner_dim": 1024,
}


# ---------------------------------------------------------------------------------------
# Problems


def _ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


def make_problem(key: str, mode: str = "full") -> Problem:
    """The problem ``key`` in ``mode`` (``"full"``, ``"quick"`` or ``"tiny"``)."""
    if key not in PROBLEMS:
        raise ValueError(f"Unknown Shampoo problem key={key!r}; valid choices are {PROBLEMS}.")
    if mode not in ("full", "quick", "tiny"):
        raise ValueError(f"Unknown mode={mode!r}; valid choices are 'full', 'quick', 'tiny'.")
    tiny, quick = mode == "tiny", mode == "quick"
    common: dict[str, Any] = {
        "mode": mode,
        # Every frequency below is shrunk in tiny runs so that preconditioning starts.
        "long_frequency": 4 if tiny else 100,
        "soap_frequency": 4 if tiny else 10,
    }
    if key == "shampoo_mnist1d_cnn":
        train, test = mnist1d(250 if tiny else 5000)
        return Problem(
            key=key,
            title="MNIST-1D (mnist1d, 4,000 / 1,000), CNN Conv1d(1,32,5)-Conv1d(32,32,3)-"
            "Linear(1280,256)-Linear(256,10), cross-entropy"
            + (" [tiny: 200 / 50, 4-channel CNN, hidden 16]" if tiny else ""),
            kind="classification",
            train=train,
            test=test,
            make_model=mnist1d_cnn(channels=4, hidden=16) if tiny else mnist1d_cnn(),
            loss=_ce,
            batch_size=32 if tiny else 128,
            target=0.85,
            max_steps=12 if tiny else 310 if quick else 930,
            budget_s=30.0 if tiny else 90.0 if quick else 600.0,
            eval_every=4 if tiny else 31,
            note="" if tiny else "Batches of 128 (31 per epoch), test accuracy every epoch.",
            settings={
                **common,
                "adamw_lrs": (3e-3,) if tiny else (1e-3, 3e-3, 1e-2),
                "shampoo_lr": 3e-3,
                "freq1_steps": 6 if tiny else 20 if quick else 60,
                "peer_freq1_steps": 6 if tiny else 10 if quick else 30,
            },
        )
    train, test = digits(96 if tiny else None)
    return Problem(
        key=key,
        title="digits (sklearn, 1,437 / 360), MLP 64-128-10 (Tanh), cross-entropy"
        + (" [tiny: 96 / 48, MLP 64-20-10]" if tiny else ""),
        kind="classification",
        train=train,
        test=test,
        # tiny: 20 hidden, not 16, whose (16, 64) weight would merge into one 1024-vector
        # block (a 1024x1024 factor) under the merging rule
        make_model=mlp([64, 20, 10]) if tiny else mlp([64, 128, 10]),
        loss=_ce,
        batch_size=32 if tiny else 64,
        target=0.95,
        max_steps=12 if tiny else 220 if quick else 440,
        budget_s=30.0 if tiny else 60.0 if quick else 300.0,
        eval_every=4 if tiny else 11,
        note="" if tiny else "Batches of 64 (22 per epoch), test accuracy every half epoch.",
        settings={
            **common,
            "adamw_lrs": (3e-3,) if tiny else (1e-3, 3e-3, 1e-2),
            "shampoo_lr": 3e-3,
            "freq1_steps": 6 if tiny else 110 if quick else 220,
            "peer_freq1_steps": 6 if tiny else 110 if quick else 220,
        },
    )


# ---------------------------------------------------------------------------------------
# Timing the stages of a Shampoo step


def _stage_targets() -> list[tuple[Any, str, str]]:
    """``(owner, attribute, stage)`` of each function a Shampoo step's stages go through.

    Looked up by name so that a renamed function in :mod:`secondorder.shampoo` drops
    out of the breakdown (its time lands in ``other``) instead of breaking the run.
    """
    from secondorder.shampoo import preconditioner as pc
    from secondorder.shampoo import update as opt_mod

    wanted = [
        (pc.Preconditioner, "update_factors", "factor"),
        (pc.Preconditioner, "amortize", "root"),
        (pc.EigenvalueCorrectedPreconditioner, "after_amortize", "factor"),
        (pc.RootInversePreconditioner, "precondition", "precondition"),
        (pc.EigenvalueCorrectedPreconditioner, "precondition", "precondition"),
        (opt_mod, "updated_grafting", "grafting"),
        (opt_mod, "grafting_direction", "grafting"),
    ]
    out = []
    for owner, name, stage in wanted:
        where = owner.__dict__ if isinstance(owner, type) else vars(owner)
        if name in where:
            out.append((owner, name, stage))
    return out


@contextlib.contextmanager
def stage_timing(spent: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in each stage of Shampoo steps taken inside to ``spent``.

    Wraps the stage functions (class attributes and module globals of
    :mod:`secondorder.shampoo`) for the duration; the numerics are untouched.  CPU
    kernels are synchronous, so wall time around each call is its cost.
    """
    saved = []
    for owner, name, stage in _stage_targets():
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        def timed(*a: Any, _fn: Any = fn, _stage: str = stage, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_stage] = spent.get(_stage, 0.0) + time.perf_counter() - t0

        saved.append((owner, name, fn))
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


# ---------------------------------------------------------------------------------------
# Methods


def shampoo_options(problem: Problem, frequency: int, eigenvalue_corrected: bool) -> dict[str, Any]:
    """The :class:`~secondorder.shampoo.Shampoo` options of a row on ``problem``."""
    options = dict(SHAMPOO_DEFAULTS)
    options.update(
        lr=problem.setting("shampoo_lr", 3e-3),
        precondition_frequency=frequency,
        grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
    )
    if eigenvalue_corrected:
        options["preconditioner"] = "eigenvalue_corrected"
    return options


def _describe(options: dict[str, Any]) -> str:
    parts = []
    for k, v in options.items():
        if k == "grafting_config":
            parts.append("Adam grafting (beta2 0.999, eps 1e-8)")
        elif k == "betas":
            parts.append(f"betas ({v[0]:g}, {v[1]:g})")
        else:
            parts.append(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}")
    return ", ".join(parts)


def _make(
    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer], profile: bool
) -> Callable[[Problem, nn.Module], Stepper]:
    """A stepper that times ``step()`` alone (stage ``step``) and, if ``profile``, its stages."""

    def make(problem: Problem, model: nn.Module) -> Stepper:
        opt = factory(list(model.parameters()))

        def step(x: Tensor, y: Tensor) -> StepReport:
            opt.zero_grad(set_to_none=True)
            loss = problem.loss(model(x), y)
            loss.backward()
            spent: dict[str, float] = {}
            t0 = time.perf_counter()
            if profile:
                with stage_timing(spent):
                    opt.step()
            else:
                opt.step()
            spent["step"] = time.perf_counter() - t0
            if profile:
                named = sum(spent.get(s, 0.0) for s in STAGES if s != "other")
                spent = {**{s: spent.get(s, 0.0) for s in STAGES}, "step": spent["step"]}
                spent["other"] = max(spent["step"] - named, 0.0)
            return StepReport(float(loss.detach()), stages=spent)

        return step

    return make


def shampoo_method(problem: Problem, frequency: int, eigenvalue_corrected: bool) -> Method:
    """secondorder Shampoo (or SOAP) at ``frequency`` on ``problem``."""
    options = shampoo_options(problem, frequency, eigenvalue_corrected)
    name = "secondorder SOAP" if eigenvalue_corrected else "secondorder Shampoo"
    steps = problem.setting("freq1_steps") if frequency == 1 else None
    return Method(
        name=f"{name} (freq {frequency})",
        family=FAMILY_NAME,
        settings=_describe(options),
        make=_make(lambda ps: Shampoo(ps, **options), profile=True),
        max_steps=steps,
        eval_every=min(problem.eval_every, steps) if steps else None,
        options=options,
    )


def _adamw(ps: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=lr, weight_decay=1e-4)


def adamw_methods(problem: Problem) -> list[Method]:
    """``torch.optim.AdamW`` (weight decay 1e-4) at each learning rate of the grid."""
    lrs = problem.setting("adamw_lrs", (3e-3,))
    return [
        Method(
            name=f"torch.optim.AdamW (lr {lr:g})",
            family="baseline",
            settings=f"weight_decay 1e-4, grid {', '.join(f'{v:g}' for v in lrs)}",
            make=_make(functools.partial(_adamw, lr=lr), profile=False),
        )
        for lr in lrs
    ]


def _skipped(name: str, exc: BaseException) -> Method:
    return Method(name=name, family="peer", skipped=f"{type(exc).__name__}: {exc}"[:160])


def peer_methods(problem: Problem) -> list[Method]:
    """pytorch-optimizer's Shampoo and SOAP, heavyball's SOAP; skipped rows if not importable.

    Their own defaults but for the learning rate (1e-3 for Shampoo, 3e-3 for SOAP, as
    the secondorder rows) and SOAP's ``precondition_frequency`` (the ``soap`` row's).
    """
    freq = problem.setting("soap_frequency", 10)
    out: list[Method] = []
    try:
        import pytorch_optimizer as po

        steps = problem.setting("peer_freq1_steps")
        out.append(
            Method(
                name="pytorch-optimizer Shampoo",
                family="peer",
                settings="lr 1e-3, its defaults (update_freq 1, no blocking)",
                make=_make(lambda ps: po.Shampoo(ps, lr=1e-3), profile=False),
                max_steps=steps,
                eval_every=min(problem.eval_every, steps) if steps else None,
            )
        )
        out.append(
            Method(
                name=f"pytorch-optimizer SOAP (freq {freq})",
                family="peer",
                settings=f"lr 3e-3, precondition_frequency {freq}, its defaults otherwise",
                make=_make(
                    lambda ps: po.SOAP(ps, lr=3e-3, precondition_frequency=freq), profile=False
                ),
            )
        )
    except Exception as exc:  # a peer that does not import is a row that says why
        out.append(_skipped("pytorch-optimizer", exc))
    try:
        import heavyball
        import heavyball.utils

        # heavyball compiles its kernels with torch.compile (max-autotune) by default,
        # minutes of autotuning on a CPU; every other row runs eager, so this one does too.
        heavyball.utils.compile_mode = None
        out.append(
            Method(
                name=f"heavyball SOAP (freq {freq})",
                family="peer",
                settings=f"lr 3e-3, precondition_frequency {freq}, compile_mode None (eager)",
                make=_make(
                    lambda ps: heavyball.SOAP(ps, lr=3e-3, precondition_frequency=freq),
                    profile=False,
                ),
            )
        )
    except Exception as exc:
        out.append(_skipped("heavyball SOAP", exc))
    return out


def methods_for(problem: Problem, keys: Sequence[str] = METHODS) -> list[Method]:
    """The methods the ``--methods`` keys stand for on ``problem`` (none off the family)."""
    makers = _method_makers()
    return [m for key in METHODS if key in keys for m in makers[key](problem)]


def _method_makers() -> dict[str, Callable[[Problem], list[Method]]]:
    return {
        "shampoo": only_on(PROBLEMS, lambda p: [shampoo_method(p, 1, False)]),
        "shampoo_f100": only_on(
            PROBLEMS, lambda p: [shampoo_method(p, p.setting("long_frequency", 100), False)]
        ),
        "soap": only_on(
            PROBLEMS, lambda p: [shampoo_method(p, p.setting("soap_frequency", 10), True)]
        ),
        "shampoo_adamw": only_on(PROBLEMS, adamw_methods),
        "shampoo_peers": only_on(PROBLEMS, peer_methods),
    }


# ---------------------------------------------------------------------------------------
# Columns and sections


def _mean(r: MethodResult, stage: str) -> float:
    # the mean, not the median: roots are computed on one step in precondition_frequency
    v = r.stages.get(stage, [])
    return statistics.fmean(v) if v else math.nan


def _iteration(r: MethodResult) -> float:
    return statistics.fmean(r.step_seconds) if r.step_seconds else math.nan


def stage_cell(r: MethodResult) -> str:
    """Mean ms per step in factor / root / precondition / grafting / other (``-``: no profile)."""
    if "root" not in r.stages:
        return "-"
    return " / ".join(f"{_mean(r, s) * 1e3:.1f}" for s in STAGES)


def step_cell(r: MethodResult) -> str:
    """Mean ``step()`` time alone."""
    t = _mean(r, "step")
    return "-" if not math.isfinite(t) else f"{t * 1e3:.1f} ms"


def ratios(pr: ProblemResult) -> list[dict[str, Any]]:
    """Each non-AdamW row's mean step and iteration time over the AdamW rows' mean.

    Means over every step (roots come once per ``precondition_frequency`` steps, so
    the mean is the amortized cost); AdamW's cost does not depend on its lr, so its
    rows are pooled.  ``reference_*``: the issue's DistributedShampoo ratios at the
    row's frequency, where it measured one.
    """
    adamw = [r for r in pr.methods if r.name.startswith("torch.optim.AdamW") and r.step_seconds]
    if not adamw:
        return []
    p = pr.problem
    measured_reference = p.key == "shampoo_mnist1d_cnn" and p.setting("mode") != "tiny"
    base_step = statistics.fmean(v for r in adamw for v in r.stages.get("step", []))
    base_iter = statistics.fmean(v for r in adamw for v in r.step_seconds)
    out = []
    for r in pr.methods:
        if r in adamw or not r.step_seconds:
            continue
        freq = None
        if "(freq " in r.name:
            freq = int(r.name.rsplit("(freq ", 1)[1].rstrip(")"))
        ours = r.name.startswith("secondorder Shampoo") and measured_reference
        ref = REFERENCE.get(freq or 0, {}) if ours else {}
        # The steps from the first preconditioned one on (start = the frequency, the
        # default): at frequency 100 the first 99 steps are the grafted method's alone,
        # so a window that ends before step 100 never times Shampoo.
        first = (freq or 1) - 1
        pre_step = r.stages.get("step", [])[first:]
        pre_iter = r.step_seconds[first:]
        out.append(
            {
                "method": r.name,
                "steps": len(r.step_seconds),
                "step_s": _mean(r, "step"),
                "iteration_s": _iteration(r),
                "step_ratio": _mean(r, "step") / base_step,
                "iteration_ratio": _iteration(r) / base_iter,
                "reference_step_ratio": ref.get("step"),
                "reference_iteration_ratio": ref.get("iteration"),
                "stages_s": {s: _mean(r, s) for s in STAGES} if "root" in r.stages else None,
                "preconditioned_steps": len(pre_iter),
                "preconditioned_step_ratio": (
                    statistics.fmean(pre_step) / base_step if pre_step else None
                ),
                "preconditioned_iteration_ratio": (
                    statistics.fmean(pre_iter) / base_iter if pre_iter else None
                ),
            }
        )
    return out


def ratio_lines(pr: ProblemResult) -> list[str]:
    """The ratios table of :func:`ratios`, with the issue's reference and target (half)."""
    rows = ratios(pr)
    if not rows or pr.problem.key not in PROBLEMS:
        return []
    lines = [
        "Time per step against AdamW's (means over the run's steps; AdamW rows pooled). "
        "Reference: the issue's DistributedShampoo on this network, 98x step / 14.2x "
        "iteration at frequency 1 and 15x / 2.95x at 100; the aim is at most half. "
        "'preconditioned': the same ratios over the steps from the first preconditioned "
        "one (step = the row's frequency) on; '-' where the run ended before it.",
        "",
        "| method | steps | step() | x AdamW step | iteration | x AdamW iteration "
        "| preconditioned steps: x step / x iteration | reference step / iteration |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ref = (
            f"{r['reference_step_ratio']:g}x / {r['reference_iteration_ratio']:g}x"
            if r["reference_step_ratio"]
            else "-"
        )
        pre = (
            f"{r['preconditioned_steps']}: {r['preconditioned_step_ratio']:.1f}x / "
            f"{r['preconditioned_iteration_ratio']:.2f}x"
            if r["preconditioned_step_ratio"] is not None
            else "-"
        )
        lines.append(
            f"| {r['method']} | {r['steps']} | {r['step_s'] * 1e3:.1f} ms | "
            f"{r['step_ratio']:.1f}x | {r['iteration_s'] * 1e3:.1f} ms | "
            f"{r['iteration_ratio']:.2f}x | {pre} | {ref} |"
        )
    return [*lines, ""]


def versions() -> dict[str, str | None]:
    """Versions of the peers (``None``: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("pytorch_optimizer", "heavyball", "mnist1d"):
        try:
            out[name] = version(name.replace("_", "-"))
        except PackageNotFoundError:
            out[name] = None
    return out


def _scaling_data(results: Sequence[ProblemResult]) -> dict[str, Any] | None:
    from . import shampoo_scaling

    mode = next((pr.problem.setting("mode") for pr in results if pr.problem.key in PROBLEMS), None)
    if mode not in ("quick", "full"):
        return None
    return shampoo_scaling.cached_report(mode)


def _scaling_lines(results: Sequence[ProblemResult]) -> list[str]:
    data = _scaling_data(results)
    if data is None:
        return []
    return ["## Shampoo: 2-process scaling and the all-gather model", "", data["markdown"], ""]


def family() -> Family:
    """The Shampoo suite as a :class:`~benchmarks.core.Family`."""
    section = Section(
        key="shampoo_ratios",
        measure=None,
        summary=lambda pr: {"shampoo_ratios": ratios(pr)} if pr.problem.key in PROBLEMS else {},
        markdown=ratio_lines,
    )
    return Family(
        name=FAMILY_NAME,
        problems={k: functools.partial(make_problem, k) for k in PROBLEMS},
        methods=_method_makers(),
        columns=(
            Column("step() (mean)", step_cell),
            Column("Shampoo factor / root / precond / graft / other (mean ms)", stage_cell),
        ),
        sections=(section,),
        closings=(Closing("shampoo_scaling", _scaling_data, _scaling_lines),),
        versions=versions,
    )
