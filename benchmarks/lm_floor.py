"""LM's stage breakdown: each stage of one step against the floor of this machine.

For one batch, the Jacobian (per slice), the Gram (with its dtype conversion), the
whole ``linearize``, ``factor`` + one ``solve`` and one trial evaluation are timed by
calling the optimizer's parts on the same point, next to a plain ``JᵀJ`` GEMM of the
Jacobian's shape (and ``?syrk``, half the flops) and one forward plus backward pass.
The ratios ``(Gram + solve) / GEMM`` and ``Jacobian / (forward + backward)`` are what
to compare across machines.  :class:`~secondorder.lm.StepInfo` reports only
``linearize`` and ``solve_and_trials``, hence the reach inside, all of it through
:func:`lm_internals`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from secondorder import LevenbergMarquardt
from secondorder.lm.linalg import gram_update

from .core import Method, MethodResult, Problem, ProblemResult, batches, fmt_s, sync

__all__ = ["LMView", "floor_markdown", "lm_internals", "measure_floor"]


@dataclass(frozen=True)
class LMView:
    """What the floor needs from inside an LM optimizer.

    ``problem``: the per-batch problem of the last step (Jacobian strategy, slices,
    ``linearize``, solver, ``loss_sum``); ``damping_matrix``: the rule that gives ``D``;
    ``damping_state``: its state (λ and the running scale); ``damping``: λ now.
    """

    problem: Any
    damping_matrix: Any
    damping_state: Any
    damping: float


def lm_internals(opt: LevenbergMarquardt) -> LMView:
    """The one place the benchmark reaches inside :class:`LevenbergMarquardt`.

    Reads the parts of the last step through ``opt.internals()`` (a frozen record with
    ``problem``, ``damping_matrix``, ``damping_rule``, ``damping_state``).
    """
    inner = opt.internals()
    return LMView(
        problem=inner.problem,
        damping_matrix=inner.damping_matrix,
        damping_state=inner.damping_state,
        damping=float(inner.damping_state.damping),
    )


def median_time(fn: Callable[[], object], reps: int, device: str = "cpu") -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call.

    Each call is timed from an idle ``device`` until its work there is done.
    """
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _syrk_time(shape: tuple[int, int], reps: int, device: str) -> float | None:
    """``JᵀJ`` by BLAS ``ssyrk`` (half the flops of a general product), or None.

    None on a GPU too: torch has no symmetric rank-k product to call there.
    """
    if device != "cpu":
        return None
    try:
        from scipy.linalg.blas import ssyrk
    except ImportError:  # pragma: no cover - scipy is a test dependency
        return None
    a = torch.randn(shape).numpy()  # C order (m, n) is Fortran order (n, m): no copy.
    return median_time(lambda: ssyrk(1.0, a.T, trans=0), reps)


def describe(options: dict[str, Any]) -> str:
    """LM options as one line (``defaults`` for none)."""
    if not options:
        return "defaults"
    return ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in options.items())


def measure_floor(
    problem: Problem,
    label: str,
    options: dict[str, Any],
    reps: int,
    residual_fn: Callable[[Tensor, Tensor], Tensor],
) -> dict[str, Any]:
    """Time each stage of one LM step, and the hardware floor, on the first batch."""
    model = problem.make_model()
    dev = problem.device
    x, y = batches(problem, 0)[0]
    slice_size = problem.setting("slice_size")
    opt = LevenbergMarquardt(model, residual_fn, **options)
    info = opt.step(x, y, slice_size=slice_size)  # configures strategy and solver
    view = lm_internals(opt)
    prob = view.problem
    with torch.no_grad():
        xv = torch.cat([p.detach().reshape(-1) for p in prob.params])
    params = prob.unflatten(xv)
    slices = list(prob.slices())
    # The dtype the step just taken formed its normal matrix in (under "auto" it
    # follows λ; CG forms none and reports "").
    gdt = getattr(torch, info.gram_dtype) if info.gram_dtype else (prob.gram_dtype or xv.dtype)

    def jac_all() -> list[Tensor]:
        return [prob.strategy(prob.program, params, a, b)[0].detach() for a, b in slices]

    jacs = jac_all()
    m, n = sum(j.shape[0] for j in jacs), jacs[0].shape[1]
    t_jac = median_time(jac_all, reps, dev)

    def gram() -> Tensor:
        if prob.form == "dual":
            j = torch.cat(jacs).to(gdt)
            return j @ j.T
        g: Tensor | None = None
        for j in jacs:
            g = gram_update(g, j, gdt)  # what linearize does, conversion included
        assert g is not None
        return g

    t_gram = median_time(gram, reps, dev)
    t_lin = median_time(lambda: prob.linearize(xv), reps, dev)
    system = prob.linearize(xv)
    d = view.damping_matrix.diagonal(
        system.col_sq if system.scale_sq is None else system.scale_sq, view.damping_state
    )
    w = None if system.residuals is None else -system.residuals
    lam = view.damping

    def factor_solve() -> None:
        prob.solver.factor(system, d).solve(lam, -system.grad, w)

    t_solve = median_time(factor_solve, reps, dev)
    t_trial = median_time(lambda: prob.loss_sum(xv), reps, dev)
    shape = (m, n) if prob.form != "dual" else (n, m)
    j32 = torch.randn(shape, device=dev)
    t_gemm32 = median_time(lambda: j32.T @ j32, reps, dev)
    j64 = j32.double()
    t_gemm64 = median_time(lambda: j64.T @ j64, reps, dev)
    t_syrk = _syrk_time(shape, reps, dev)
    fb_model = problem.make_model()

    def fwd_bwd() -> None:
        fb_model.zero_grad(set_to_none=True)
        problem.loss(fb_model(x), y).backward()

    t_fb = median_time(fwd_bwd, reps, dev)
    gemm_same = t_gemm64 if gdt == torch.float64 else t_gemm32
    # What the step itself spends on the normal matrix and its solution: the dual
    # Cholesky/eigh forms J D⁻¹Jᵀ inside ``factor``, and CG never forms a Gram.
    gram_in_step = prob.form == "primal" and not prob.solver.needs_jacobian
    numerator = t_solve + (t_gram if gram_in_step else 0.0)
    if prob.form == "dual":
        note = "dual form: J D⁻¹Jᵀ (m×m) is formed inside factor+solve; GEMM of shape (n, m)"
    elif not gram_in_step:
        note = f"{prob.solver.name}: no Gram is formed; the ratio is factor+solve over GEMM"
    else:
        note = ""
    return {
        "config": label,
        "settings": describe(options),
        "jacobian": info.jacobian,
        "solver": info.solver,
        "form": info.form,
        "gram_dtype": str(gdt).replace("torch.", ""),
        "jacobian_shape": [m, n],
        "slices": len(slices),
        "jacobian_s": t_jac,
        "gram_s": t_gram,
        "linearize_s": t_lin,
        "linearize_other_s": t_lin - t_jac - t_gram,
        "factor_solve_s": t_solve,
        "trial_s": t_trial,
        "gemm_f32_s": t_gemm32,
        "gemm_f64_s": t_gemm64,
        "syrk_f32_s": t_syrk,
        "forward_backward_s": t_fb,
        "gram_in_step": gram_in_step,
        "gram_solve_over_gemm_f32": numerator / t_gemm32,
        "gram_solve_over_gemm_same_dtype": numerator / gemm_same,
        "jacobian_over_forward_backward": t_jac / t_fb,
        "notes": note,
    }


def measure_floors(
    problem: Problem,
    methods: Sequence[Method],
    reps: int,
    residual_fn: Callable[[Tensor, Tensor], Tensor],
    family: str,
) -> list[dict[str, Any]]:
    """The floor of every method of ``family`` that ran on ``problem`` (by its options)."""
    return [
        measure_floor(problem, m.name, dict(m.options), reps, residual_fn)
        for m in methods
        if m.family == family and not m.skipped
    ]


def floor_markdown(pr: ProblemResult, floor: Sequence[dict[str, Any]]) -> list[str]:
    """The floor table of one problem (nothing when no LM config ran)."""
    if not floor:
        return []
    lines = [
        "| LM config | J shape | Jacobian | Gram (dtype) | factor+solve | trial | "
        "GEMM f32 | GEMM f64 | ssyrk f32 | fwd+bwd | (Gram+solve)/GEMM f32 | "
        "(Gram+solve)/GEMM same dtype | Jacobian/(fwd+bwd) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in floor:
        lines.append(
            f"| {f['config']} ({f['jacobian']}, {f['solver']}, {f['form']}) | "
            f"{f['jacobian_shape'][0]}×{f['jacobian_shape'][1]} | "
            f"{fmt_s(f['jacobian_s'])} | {fmt_s(f['gram_s'])} ({f['gram_dtype']}) | "
            f"{fmt_s(f['factor_solve_s'])} | {fmt_s(f['trial_s'])} | "
            f"{fmt_s(f['gemm_f32_s'])} | {fmt_s(f['gemm_f64_s'])} | "
            f"{fmt_s(f['syrk_f32_s'])} | {fmt_s(f['forward_backward_s'])} | "
            f"{f['gram_solve_over_gemm_f32']:.2f} | "
            f"{f['gram_solve_over_gemm_same_dtype']:.2f} | "
            f"{f['jacobian_over_forward_backward']:.1f} |"
        )
    return [*lines, ""]


def stage_cell(r: MethodResult) -> str:
    """LM's column: median ``linearize`` / ``solve_and_trials`` and attempts per step."""
    st = {k: statistics.median(v) for k, v in r.stages.items() if v}
    if "linearize" not in st:
        return "-"
    return (
        f"{fmt_s(st.get('linearize'))} / {fmt_s(st.get('solve_and_trials'))}"
        f" ({st.get('attempts', 0):.0f} attempts)"
    )
