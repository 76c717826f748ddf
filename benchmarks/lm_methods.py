"""The LM family's benchmark: secondorder LM and its peers, its sections (problems: lm_problems).

Methods, by ``--methods`` key:

* ``lm``, ``lm_fast``: secondorder LM with its default settings, and with the fastest
  settings measured for the problem (``settings["lm_fast"]``, plus the variants in
  ``settings["lm_extra"]``);
* ``tlm``: torch-levenberg-marquardt (``pip install 'secondorder[bench]'``), through its
  own ``LevenbergMarquardtModule.training_step`` with its defaults; skipped with a note
  when it is not installed;
* ``adam``: ``torch.optim.Adam`` with a learning rate tuned per problem
  (``settings["adam_lr"]``, stated in the report);
* ``scipy``: ``scipy.optimize.least_squares`` (``"lm"`` and ``"trf"``) on the
  curve-fitting problems, in float64, with the Jacobian from torch autograd and a cap.

Its sections: LM's column (median ``linearize`` / ``solve_and_trials``), the comparisons
of each LM config with the peers, the floor (:mod:`benchmarks.lm_floor`) and, across
problems, sinc_large against sinc scaled by the Gram's flops.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from secondorder import LevenbergMarquardt
from secondorder.lm.residuals import cross_entropy, mse

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
    batches,
    fmt_s,
    machine,
    only_on,
    settled_heap,
    sync,
    torch_optimizer,
    where,
)
from .lm_floor import describe, floor_markdown, measure_floors, stage_cell
from .lm_problems import PROBLEMS, build_problems, lm_problem, make_problem

__all__ = [
    "FAMILY_NAME",
    "METHODS",
    "PROBLEMS",
    "LMProblemResult",
    "build_problems",
    "comparisons",
    "family",
    "flop_scaling",
    "lm_problem",
    "methods_for",
    "peer_targets",
    "run_scipy",
    "run_tlm",
    "scaling_lines",
]

METHODS = ("lm", "lm_fast", "tlm", "adam", "scipy")
FAMILY_NAME = "secondorder LM"


# ---------------------------------------------------------------------------------------
# Methods


def _residual_fn(problem: Problem) -> Callable[[Tensor, Tensor], Tensor]:
    default = cross_entropy if problem.kind == "classification" else mse
    fn: Callable[[Tensor, Tensor], Tensor] = problem.setting("residual", default)
    return fn


def lm_method(label: str, options: dict[str, Any]) -> Method:
    """secondorder's LevenbergMarquardt with ``options`` (its row: ``label``)."""

    def make(problem: Problem, model: nn.Module) -> Stepper:
        opt = LevenbergMarquardt(model, _residual_fn(problem), **options)
        slice_size = problem.setting("slice_size")
        first = [True]

        def step(x: Tensor, y: Tensor) -> StepReport:
            info = opt.step(x, y, slice_size=slice_size)
            resolved = ""
            if first[0]:
                first[0] = False
                resolved = (
                    f"resolved: jacobian={info.jacobian}, solver={info.solver}, form={info.form}"
                )
            stages = {k: v for k, v in info.timings.items() if k != "total"}
            stages["attempts"] = float(info.attempts)
            return StepReport(float(info.loss), info.terminated, stages, resolved)

        return step

    return Method(
        name=label, family=FAMILY_NAME, settings=describe(options), make=make, options=options
    )


def _lm_configs(problem: Problem, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {}
    if "lm" in keys:
        configs["secondorder LM (defaults)"] = {}
    if "lm_fast" in keys:
        configs["secondorder LM (fastest)"] = problem.setting("lm_fast", {})
        configs.update(problem.setting("lm_extra", {}))
    return configs


def tlm_method(problem: Problem) -> Method:
    """torch-levenberg-marquardt 1.2.3 through its own training step, its defaults."""
    try:
        from torch_levenberg_marquardt import loss as tlm_loss
        from torch_levenberg_marquardt.training import LevenbergMarquardtModule
    except ImportError:
        return Method(
            name="torch-levenberg-marquardt",
            family="peer",
            skipped="not installed: pip install 'secondorder[bench]'",
        )
    slice_size = problem.setting("slice_size")

    def make(problem: Problem, model: nn.Module) -> Stepper:
        cls = problem.kind == "classification"
        loss_fn = tlm_loss.CrossEntropyLoss() if cls else tlm_loss.MSELoss()
        module = LevenbergMarquardtModule(model, loss_fn=loss_fn, max_batch_size=slice_size)

        def step(x: Tensor, y: Tensor) -> StepReport:
            _, loss, stop, _ = module.training_step(x, y)
            return StepReport(float(loss), bool(stop))

        return step

    settings = "defaults (solve_method='qr', StandardDampingStrategy)"
    if slice_size is not None:
        settings += f", max_batch_size={slice_size}"
    return Method(
        name="torch-levenberg-marquardt 1.2.3", family="peer", settings=settings, make=make
    )


def run_tlm(problem: Problem) -> MethodResult:
    """torch-levenberg-marquardt on ``problem`` (a skipped result when not installed)."""
    from .core import run_method

    return run_method(problem, tlm_method(problem))


def adam_method(problem: Problem) -> Method:
    """torch.optim.Adam on the same batches with the problem's tuned learning rate."""
    lr = problem.setting("adam_lr", 1e-3)
    steps = problem.setting("adam_steps", problem.max_steps)
    return Method(
        name=f"torch.optim.Adam (lr {lr:g})",
        family="peer",
        settings=problem.setting("adam_note", "not tuned"),
        make=torch_optimizer(lambda ps: torch.optim.Adam(ps, lr=lr)),
        max_steps=steps,
        eval_every=max(problem.eval_every, steps // 200),
    )


class _TimeCapError(Exception):
    pass


def run_scipy(problem: Problem, method: str, result: MethodResult) -> None:
    """scipy.optimize.least_squares on the flat float64 parameter vector, into ``result``.

    Residuals and the Jacobian come from torch (``vmap`` of ``jacrev`` per sample) on
    a float64 copy of the model.  The clock covers scipy and every callback; a
    callback past the time cap raises, and the best point evaluated so far is kept.
    Steps are Jacobian evaluations; the curve is the best loss evaluated so far.
    """
    from scipy.optimize import least_squares as sp_least_squares

    model = problem.make_model().double()
    names = [k for k, p in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    numels = [p.numel() for p in model.parameters()]
    x_all = problem.train[0].double()
    y_all = problem.train[1].double()
    m = x_all.shape[0]

    def unflatten(p: Tensor) -> dict[str, Tensor]:
        return {k: c.view(s) for k, c, s in zip(names, torch.split(p, numels), shapes, strict=True)}

    def per_sample(p: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
        out: Tensor = functional_call(model, unflatten(p), (xi.unsqueeze(0),))
        return (out - yi.unsqueeze(0)).reshape(-1)

    jac_fn = vmap(jacrev(per_sample), in_dims=(None, 0, 0))
    t_start = time.perf_counter()
    best: dict[str, Any] = {"loss": math.inf, "x": None}
    njev = [0]
    last_jac = [t_start]

    def check() -> None:
        if time.perf_counter() - t_start > problem.budget_s:
            raise _TimeCapError

    def fun(p: Any) -> Any:
        check()
        pt = torch.from_numpy(p)
        with torch.no_grad():
            r = (functional_call(model, unflatten(pt), (x_all,)) - y_all).reshape(-1)
        loss = float((r * r).mean())
        now = time.perf_counter() - t_start
        if loss < best["loss"]:
            best.update(loss=loss, x=p.copy())
        result.add(njev[0], now, best["loss"], None)
        return r.numpy()

    def jac(p: Any) -> Any:
        check()
        now = time.perf_counter()
        if njev[0] > 0:
            result.step_seconds.append(now - last_jac[0])
        last_jac[0] = now
        njev[0] += 1
        with torch.no_grad():
            jm = jac_fn(torch.from_numpy(p), x_all, y_all).reshape(m, -1)
        return jm.numpy()

    x0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    try:
        res = sp_least_squares(fun, x0, jac=jac, method=method, max_nfev=problem.max_steps * 5)
        result.note = f"{res.message} nfev={res.nfev} njev={res.njev}"
    except _TimeCapError:
        result.status = "time cap"
        result.note = f"stopped at the {problem.budget_s:g} s cap after {njev[0]} Jacobians"
    if best["x"] is not None:
        p = torch.from_numpy(best["x"])
        final = problem.make_model()
        with torch.no_grad():
            for q, c in zip(final.parameters(), torch.split(p, numels), strict=True):
                q.copy_(c.view_as(q).float())
        result.final_state = {k: v.clone() for k, v in final.state_dict().items()}
        result.reported_loss = best["loss"]
    if not result.step_seconds and njev[0]:
        result.step_seconds.append(time.perf_counter() - t_start)


def scipy_methods(problem: Problem) -> list[Method]:
    """scipy's ``"lm"`` and ``"trf"`` on the curve-fitting problems (none elsewhere)."""
    if not problem.setting("scipy", False):
        return []
    skipped = (
        ""
        if problem.device == "cpu"
        else (f"scipy runs on the CPU; not part of a run on {problem.device}")
    )
    return [
        Method(
            name=f"scipy least_squares ({name})",
            family="peer",
            settings="float64, torch autograd Jacobian, x_scale=1, default tolerances",
            run=None if skipped else functools.partial(_run_scipy_into, name),
            skipped=skipped,
        )
        for name in ("lm", "trf")
    ]


def _run_scipy_into(method: str, problem: Problem, result: MethodResult) -> None:
    run_scipy(problem, method, result)


def methods_for(problem: Problem, keys: Sequence[str] = METHODS) -> list[Method]:
    """The methods the ``--methods`` keys stand for on ``problem``, in the report's order."""
    makers = _method_makers()
    return [m for key in METHODS if key in keys for m in makers[key](problem)]


def _method_makers() -> dict[str, Callable[[Problem], list[Method]]]:
    # "lm" and "lm_fast" are selected together: "lm_fast" also brings the extras.
    def lm(problem: Problem) -> list[Method]:
        return [lm_method(k, v) for k, v in _lm_configs(problem, ["lm"]).items()]

    def lm_fast(problem: Problem) -> list[Method]:
        return [lm_method(k, v) for k, v in _lm_configs(problem, ["lm_fast"]).items()]

    return {
        "lm": only_on(PROBLEMS, lm),
        "lm_fast": only_on(PROBLEMS, lm_fast),
        "tlm": only_on(PROBLEMS, lambda p: [tlm_method(p)]),
        "adam": only_on(PROBLEMS, lambda p: [adam_method(p)]),
        "scipy": only_on(PROBLEMS, scipy_methods),
    }


# ---------------------------------------------------------------------------------------
# Sections


def comparisons(pr: ProblemResult) -> list[dict[str, Any]]:
    """Each secondorder LM config against the peers, measured in this run.

    ``step_speedup_vs_tlm``: torch-levenberg-marquardt's median seconds per step
    over this config's.  ``time_to_target_speedup``: the fastest peer's time to
    the target over this config's, among the peers that reached it (``None`` if
    this config or no peer reached it; ``peers_reaching_target`` says which did).
    """
    p = pr.problem
    if p.key not in PROBLEMS:
        return []  # another family's problem: LM's comparisons do not apply
    ran = [m for m in pr.methods if m.status != "skipped" and m.step_seconds]
    ours = [m for m in ran if m.name.startswith("secondorder")]
    peers = [m for m in ran if not m.name.startswith("secondorder")]
    tlm = next((m for m in peers if m.name.startswith("torch-levenberg")), None)
    reached = {m.name: m.time_to(p.target, p.kind) for m in peers}
    reached = {k: v for k, v in reached.items() if math.isfinite(v)}
    best_peer = min(reached.values()) if reached else math.nan
    out = []
    for m in ours:
        mine = m.time_to(p.target, p.kind)
        out.append(
            {
                "config": m.name,
                "step_speedup_vs_tlm": (tlm.median_step / m.median_step) if tlm else None,
                "time_to_target_s": mine if math.isfinite(mine) else None,
                "peers_reaching_target": sorted(reached),
                "time_to_target_speedup": (
                    best_peer / mine if math.isfinite(mine) and math.isfinite(best_peer) else None
                ),
            }
        )
    return out


def comparison_lines(pr: ProblemResult) -> list[str]:
    """One bullet per LM config: its speed-ups over the peers."""
    lines = []
    for c in comparisons(pr):
        speed, tt = c["step_speedup_vs_tlm"], c["time_to_target_speedup"]
        if speed is None:
            per_step = "torch-levenberg-marquardt did not run"
        else:
            per_step = f"torch-levenberg-marquardt's s/step over this config's: {speed:.2f}"
        if c["time_to_target_s"] is None:
            target = "target not reached by this config"
        elif tt is None:
            target = "reaches the target; no peer does"
        else:
            target = f"fastest peer's time to target over this config's: {tt:.2f}"
        lines.append(f"- {c['config']}: {per_step}; {target}.")
    return [*lines, ""]


def _floor(pr: ProblemResult) -> list[dict[str, Any]]:
    floor: list[dict[str, Any]] = pr.sections.get("floor", [])
    return floor


def _summary(pr: ProblemResult) -> dict[str, Any]:
    p = pr.problem
    return {
        "slice_size": p.setting("slice_size"),
        "adam_lr": p.setting("adam_lr"),
        "adam_lr_choice": p.setting("adam_note"),
        "floor": _floor(pr),
        "comparisons": comparisons(pr),
    }


def flop_scaling(results: Sequence[ProblemResult]) -> list[dict[str, Any]]:
    """Problem 2's seconds per step against problem 1's scaled by the Gram's flops.

    An LM step on a tall J (m x n) is dominated by ``JᵀJ``, ``m·n²`` multiply-adds, so
    problem 1's median step times ``(m₂n₂²)/(m₁n₁²)`` is what problem 2 should take;
    ``ratio`` above 1 means problem 2 is slower than that scaling predicts.
    """
    by_key = {pr.problem.key: pr for pr in results}
    small, large = by_key.get("sinc"), by_key.get("sinc_large")
    if small is None or large is None:
        return []

    def size(pr: ProblemResult) -> float:
        return float(pr.problem.train[0].shape[0]) * pr.problem.num_parameters**2

    factor = size(large) / size(small)
    steps = {m.name: m.median_step for m in small.methods if m.step_seconds}
    out = []
    for m in large.methods:
        if m.name in steps and m.step_seconds and m.name.startswith(("secondorder", "torch-lev")):
            expected = steps[m.name] * factor
            out.append(
                {
                    "method": m.name,
                    "flops_factor": factor,
                    "expected_s": expected,
                    "measured_s": m.median_step,
                    "ratio": m.median_step / expected,
                }
            )
    return out


def scaling_lines(results: Sequence[ProblemResult]) -> list[str]:
    """The markdown of :func:`flop_scaling` (nothing unless both sinc problems ran)."""
    rows = flop_scaling(results)
    if not rows:
        return []
    lines = [
        "## sinc_large against sinc, scaled by the Gram's flops",
        "",
        f"m·n² grows {rows[0]['flops_factor']:.1f}x from sinc to sinc_large.",
        "",
        "| method | sinc s/step x flops | sinc_large s/step | ratio |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {fmt_s(r['expected_s'])} | {fmt_s(r['measured_s'])} | "
            f"{r['ratio']:.2f} |"
        )
    return [*lines, ""]


#: The problems whose time per step is compared with torch-levenberg-marquardt side by side.
SIDE_BY_SIDE_PROBLEMS = ("sinc", "wide_dual", "digits_cnn")
#: Steps of each optimizer in the side-by-side run (fewer if the problem's budget is).
SIDE_BY_SIDE_STEPS = 60


def side_by_side(
    problem: Problem, methods: Sequence[Method], steps: int = SIDE_BY_SIDE_STEPS
) -> dict[str, Any] | None:
    """LM with its defaults and torch-levenberg-marquardt trained in alternation.

    Each optimizer trains its own copy of the model on the same batches, one step of
    each in turn (who goes first alternates), so a change in the machine's speed hits
    both alike; the methods table times each method in a stretch of its own, minutes
    apart.  Returns the median seconds per step of each and ``speedup`` (the peer's
    over ours), or ``None`` where either method is not in the run.
    """
    if problem.key not in SIDE_BY_SIDE_PROBLEMS:
        return None
    ours = next((m for m in methods if m.name == "secondorder LM (defaults)"), None)
    peer = next((m for m in methods if m.name.startswith("torch-levenberg")), None)
    if ours is None or peer is None or ours.make is None or peer.make is None:
        return None
    with settled_heap():
        steppers = [
            ours.make(problem, problem.make_model()),
            peer.make(problem, problem.make_model()),
        ]
        times: list[list[float]] = [[], []]
        steps = min(steps, problem.max_steps)
        epoch, queue = 0, batches(problem, 0)
        for k in range(steps):
            if not queue:
                epoch += 1
                queue = batches(problem, epoch)
            x, y = queue.pop(0)
            for i in (0, 1) if k % 2 == 0 else (1, 0):
                sync(problem.device)
                t0 = time.perf_counter()
                steppers[i](x, y)
                sync(problem.device)
                times[i].append(time.perf_counter() - t0)
    ours_s, peer_s = statistics.median(times[0]), statistics.median(times[1])
    return {"steps": steps, "ours_s": ours_s, "peer_s": peer_s, "speedup": peer_s / ours_s}


def side_by_side_lines(pr: ProblemResult) -> list[str]:
    """One bullet with :func:`side_by_side`'s figures."""
    r = pr.sections.get("side_by_side")
    if not r:
        return []
    return [
        f"- Side by side ({r['steps']} steps of each, in alternation): secondorder LM "
        f"(defaults) {fmt_s(r['ours_s'])}/step, torch-levenberg-marquardt "
        f"{fmt_s(r['peer_s'])}/step: {r['speedup']:.2f}x.",
        "",
    ]


#: The LM targets against the peer: (problem, what is measured, target, larger is better).
PEER_TARGETS: tuple[tuple[str, str, float, bool], ...] = (
    ("sinc", "step_speedup_vs_tlm", 2.5, True),
    ("sinc", "step_speedup_side_by_side", 2.5, True),
    ("sinc", "time_to_target_s", 3.0, False),
    ("wide_dual", "step_speedup_vs_tlm", 1.5, True),
    ("wide_dual", "step_speedup_side_by_side", 1.5, True),
    ("digits_cnn", "step_speedup_vs_tlm", 1.5, True),
    ("digits_cnn", "step_speedup_side_by_side", 1.5, True),
)


def peer_targets(results: Sequence[ProblemResult]) -> list[dict[str, Any]]:
    """The defaults' ratios against torch-levenberg-marquardt in this run, and their targets.

    ``step_speedup_vs_tlm`` is torch-levenberg-marquardt's median s/step over
    secondorder LM's with its defaults (both in this process, on the same data);
    ``step_speedup_side_by_side`` the same ratio from :func:`side_by_side`, where the two
    trained in alternation; ``time_to_target_s`` the defaults' time to the problem's
    target (MSE 1e-6 on sinc).  Problems that did not run (``ran`` False), a peer that
    did not, or a target not reached give ``None``.
    """
    by_key = {pr.problem.key: pr for pr in results}
    out = []
    for key, what, target, larger in PEER_TARGETS:
        pr = by_key.get(key)
        value: float | None
        if what == "step_speedup_side_by_side":
            both = pr.sections.get("side_by_side") if pr is not None else None
            value = both["speedup"] if both else None
        else:
            rows = comparisons(pr) if pr is not None else []
            value = next((c[what] for c in rows if c["config"].endswith("(defaults)")), None)
        met = None if value is None else (value >= target if larger else value <= target)
        out.append(
            {
                "problem": key,
                "measure": what,
                "ran": pr is not None,
                "value": value,
                "target": target,
                "met": met,
            }
        )
    return out


def peer_targets_lines(results: Sequence[ProblemResult]) -> list[str]:
    """The markdown of :func:`peer_targets`, with the machine, threads, load and date."""
    rows = peer_targets(results)
    if not any(r["ran"] for r in rows):
        return []
    now = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    host = where(machine(), results[0].problem.device)
    lines = [
        "## Targets: secondorder LM (defaults) against torch-levenberg-marquardt",
        "",
        f"{now:%Y-%m-%d %H:%M} UTC on {host}, {torch.get_num_threads()} torch "
        f"threads, load average {load:.2f} at the end of the run.",
        "",
        "| problem | measure | this run | target | met |",
        "|---|---|---:|---:|---|",
    ]
    names = {
        "step_speedup_vs_tlm": "peer s/step over ours (methods table)",
        "step_speedup_side_by_side": "peer s/step over ours (side by side)",
        "time_to_target_s": "time to the target (s)",
    }
    for r in rows:
        if r["value"] is not None:
            value = f"{r['value']:.2f}"
        elif not r["ran"]:
            value = "not run"
        elif r["measure"] == "time_to_target_s":
            value = "not reached"
        else:
            value = "peer not run"
        sign = "<=" if r["measure"] == "time_to_target_s" else ">="
        met = "-" if r["met"] is None else ("yes" if r["met"] else "no")
        lines.append(
            f"| {r['problem']} | {names[r['measure']]} | {value} | {sign} {r['target']:g} | {met} |"
        )
    lines += [
        "",
        "Small problems (NIST StRD, `least_squares` against scipy's MINPACK in one "
        "process): `python -m benchmarks.nist_time`; figures in benchmarks/notes/NOTES.md, "
        "'Small problems'.",
    ]
    return [*lines, ""]


def versions() -> dict[str, str | None]:
    """The version of torch-levenberg-marquardt, ``None`` when it is not installed."""
    try:
        import torch_levenberg_marquardt as tlm
    except ImportError:
        return {"torch_levenberg_marquardt": None}
    return {"torch_levenberg_marquardt": getattr(tlm, "__version__", "installed")}


def family(floor_reps: int = 5) -> Family:
    """The LM suite as a :class:`~benchmarks.core.Family`; the floor repeats each timing."""

    def measure(
        problem: Problem, methods: Sequence[Method], results: Sequence[MethodResult]
    ) -> list[dict[str, Any]]:
        return measure_floors(problem, methods, floor_reps, _residual_fn(problem), FAMILY_NAME)

    section = Section(
        key="floor",
        measure=measure,
        summary=_summary,
        markdown=lambda pr: comparison_lines(pr) + floor_markdown(pr, _floor(pr)),
    )
    alternating = Section(
        key="side_by_side",
        measure=lambda problem, methods, results: side_by_side(problem, methods),
        summary=lambda pr: {"side_by_side": pr.sections.get("side_by_side")},
        markdown=side_by_side_lines,
    )
    return Family(
        name=FAMILY_NAME,
        problems={k: functools.partial(make_problem, k) for k in PROBLEMS},
        methods=_method_makers(),
        columns=(Column("LM linearize / solve+trials (median)", stage_cell),),
        sections=(section, alternating),
        closings=(
            Closing("flop_scaling", flop_scaling, scaling_lines),
            Closing("peer_targets", peer_targets, peer_targets_lines),
        ),
        versions=versions,
    )


class LMProblemResult(ProblemResult):
    """A :class:`~benchmarks.core.ProblemResult` built as before the split.

    ``LMProblemResult(problem, methods, floor)``, with :meth:`comparisons`.
    """

    def __init__(
        self,
        problem: Problem,
        methods: list[MethodResult],
        floor: Sequence[dict[str, Any]] = (),
    ) -> None:
        super().__init__(problem, methods, {"floor": list(floor)})

    def comparisons(self) -> list[dict[str, Any]]:
        """See :func:`comparisons`."""
        return comparisons(self)
