"""Steps, not seconds: LM variants on the sinc problem, counted step by step.

    python -m benchmarks.experiments.sinc_steps [--seeds 0 1 2] [--steps 300]
        [--threads 1] [--variants NAME ...] [--points 20000] [--hidden 64]

sinc(10x) on ``points`` evenly spaced x in [-1, 1], Linear(1,hidden)-Tanh-
Linear(hidden,1) in float32 from ``mlp([1, hidden, 1], seed)``, full batch, up to
``steps`` LM steps with ``LevenbergMarquardt(model, mse, **options)``.  For every
variant and seed it prints the first step at which the MSE is at most 1e-6 and 1e-7
("-": not within ``steps``), the MSE after the last step, the attempts rejected on
the way (attempts beyond one per step) and the forward-mode passes geodesic
acceleration adds (one per attempt).  The step count is deterministic for a given
thread count (the rounding of the reductions depends on it), so the load of a shared
machine does not change it; the seconds column is only a rough guide.

Variants are named in :data:`VARIANTS` (public options) and :data:`RULES`
(exploration only: :class:`ShapedRule` is swapped into the optimizer's private
``_rule``, and the ``search_*`` variants wrap the engine's private ``_judge``; neither
is library behaviour).  ``--options JSON`` adds one variant of any options.
Results and their reading: ``benchmarks/notes/NOTES.md``, "Fewer steps on sinc".
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from secondorder.lm import LevenbergMarquardt
from secondorder.lm.damping import DampingRule, DampingState, StepRecord
from secondorder.lm.residuals import mse

from ..workloads import mlp, sinc_data

#: The variants measured (options of ``LevenbergMarquardt``).
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "geodesic": {"geodesic": True},
    "geodesic_a1": {"geodesic": True, "geodesic_alpha": 1.0},
    "geodesic_a05": {"geodesic": True, "geodesic_alpha": 0.5},
    "mult_10_0.1": {"damping_rule": "multiplicative"},
    "mult_2_1/3": {"damping_rule": "multiplicative", "damping_up": 2.0, "damping_down": 1 / 3},
    "mult_3_1/2": {"damping_rule": "multiplicative", "damping_up": 3.0, "damping_down": 0.5},
    "mult_10_1/3": {"damping_rule": "multiplicative", "damping_up": 10.0, "damping_down": 1 / 3},
    "mult_4_1/5": {"damping_rule": "multiplicative", "damping_up": 4.0, "damping_down": 0.2},
    "shrink_5": {"damping_shrink": 5.0},
    "shrink_10": {"damping_shrink": 10.0},
    "shrink_30": {"damping_shrink": 30.0},
    "identity": {"damping_matrix": "identity"},
    "more": {"damping_matrix": "more"},
    "damping_1": {"damping": 1.0},
    "damping_1e-6": {"damping": 1e-6},
    "gram_f64": {"gram_dtype": torch.float64},
    "gram_f32": {"gram_dtype": torch.float32},
    "min_gain_0.1": {"min_gain_ratio": 0.1},
}


class ShapedRule(DampingRule):
    """Exploration only: Nielsen's rule with its constants as parameters.

    On success ``λ ← λ·max(low, 1 - (2·min(1, ρ + shift) - 1)³)`` and, after ``patience``
    consecutive successes, a further ``λ ← λ·probe``; on failure ``λ ← λ·ν``,
    ``ν ← grow·ν`` (ν restarts from ``nu0``).
    """

    name = "shaped"

    def __init__(
        self,
        low: float = 1 / 3,
        shift: float = 0.0,
        nu0: float = 2.0,
        grow: float = 2.0,
        patience: int = 0,
        probe: float = 1.0,
    ) -> None:
        self.low, self.shift, self.nu0, self.grow = low, shift, nu0, grow
        self.patience, self.probe, self.run = patience, probe, 0

    def accept(self, state: DampingState, rho: float, step: StepRecord | None = None) -> None:
        r = min(1.0, rho + self.shift)
        state.damping *= max(self.low, 1.0 - (2.0 * r - 1.0) ** 3)
        state.nu = self.nu0
        self.run += 1
        if self.patience and self.run >= self.patience:
            state.damping *= self.probe
            self.run = 0

    def reject(self, state: DampingState, step: StepRecord | None = None) -> None:
        state.damping *= state.nu
        state.nu *= self.grow
        self.run = 0


#: Exploration rules, swapped into the optimizer after construction (not public API).
RULES: dict[str, dict[str, Any]] = {
    "nielsen_low0.1": {"low": 0.1},
    "nielsen_shift0.25": {"shift": 0.25},
    "nielsen_grow3": {"nu0": 3.0, "grow": 3.0},
    "nielsen_p3_0.5": {"patience": 3, "probe": 0.5},
    "nielsen_p5_0.3": {"patience": 5, "probe": 0.3},
}
VARIANTS.update(
    {
        "search_3": {"search": (3.0, 1 / 3, 0.75)},
        "search_3_up": {"search": (3.0, 3.0, 2.0)},
        "search_3_down": {"search": (1 / 3, 1 / 3, 0.0)},
    }
)


def _search_judge(original: Any, up: float, down: float, high: float) -> Any:
    """Exploration only: after an accepted attempt at λ, also try one more λ.

    ``λ·down`` when ρ ≥ ``high`` (the model was trusted), else ``λ·up``; the lower loss
    wins and the rule then moves λ from the winner's gain ratio.
    """
    import dataclasses

    from secondorder.lm import engine
    from secondorder.lm.measure import measure

    def judge(loop: Any, attempt: int, lam: float, *rest: Any) -> Any:
        out = original(loop, attempt, lam, *rest)
        if out is None or not out.accepted or out.stop:
            return out
        lam2 = lam * (down if out.gain_ratio >= high else up)
        direction = engine._direction(loop, lam2)
        if direction is None:
            return out
        delta = loop.lr * direction
        x2 = loop.x + delta
        values = measure(loop.system, loop.xnorm0, None, delta, x2, None)
        if not values[0] or not values[1] > 0:
            return out
        loss2 = float(loop.problem.loss_sum(x2))
        if not loss2 < out.loss_sum:
            return dataclasses.replace(out, attempts=attempt + 1)
        rho2 = (loop.loss0 - loss2) / values[1]
        loop.state.damping = lam2
        loop.rule.accept(loop.state, rho2)
        loop.state.damping = max(loop.state.damping, loop.config.damping_min)
        return dataclasses.replace(
            out, x=x2, loss_sum=loss2, gain_ratio=rho2, step_norm=values[2], attempts=attempt + 1
        )

    return judge


def run(options: dict[str, Any], seed: int, steps: int, points: int, hidden: int) -> dict[str, Any]:
    """One trajectory: the MSE after every step and the attempts it took."""
    x, y = sinc_data(points)
    model = mlp([1, hidden, 1], seed=seed)()
    from secondorder.lm import engine

    plain = {k: v for k, v in options.items() if k not in ("rule", "search")}
    opt = LevenbergMarquardt(model, mse, **plain)
    if "rule" in options:
        opt._rule = ShapedRule(**options["rule"])  # exploration only
    original = engine._judge
    if "search" in options:
        engine._judge = _search_judge(original, *options["search"])  # exploration only
    losses: list[float] = []
    attempts = 0
    lambdas: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        info = opt.step(x, y)
        losses.append(info.loss)
        attempts += info.attempts
        lambdas.append(info.damping)
        if info.terminated:
            break
    seconds = time.perf_counter() - t0
    engine._judge = original
    with torch.no_grad():
        final = float(((model(x) - y) ** 2).mean())
    return {
        "losses": losses,
        "attempts": attempts,
        "taken": len(losses),
        "final": final,
        "seconds": seconds,
        "lambdas": lambdas,
    }


def first_below(losses: list[float], level: float) -> int | None:
    """The 1-based step after which the MSE is first at most ``level``."""
    return next((i + 1 for i, v in enumerate(losses) if v <= level), None)


def main(argv: list[str] | None = None) -> int:
    """Run every variant on every seed and print one line each, then a summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--points", type=int, default=20_000)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["defaults", "geodesic"])
    ap.add_argument("--options", default=None, help="JSON options: one extra variant 'custom'")
    ap.add_argument("--json", default=None, help="write every trajectory to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    known = {**VARIANTS, **{k: {"rule": v} for k, v in RULES.items()}}
    variants = {k: known[k] for k in args.variants if k != "custom"}
    if args.options is not None:
        variants["custom"] = json.loads(args.options)
    print(
        f"sinc(10x), {args.points} points, Linear(1,{args.hidden})-Tanh-Linear({args.hidden},1), "
        f"float32, {torch.get_num_threads()} threads, {args.steps} steps at most, "
        f"torch {torch.__version__}"
    )
    print(f"{'variant':<14} {'seed':>4} {'1e-6':>5} {'1e-7':>5} {'final':>9} {'rej':>4} {'s':>6}")
    record: dict[str, Any] = {}
    for name, options in variants.items():
        hits6: list[float] = []
        for seed in args.seeds:
            out = run(options, seed, args.steps, args.points, args.hidden)
            record[f"{name}/{seed}"] = out
            s6, s7 = first_below(out["losses"], 1e-6), first_below(out["losses"], 1e-7)
            hits6.append(math.inf if s6 is None else s6)
            rejected = out["attempts"] - out["taken"]
            print(
                f"{name:<14} {seed:>4} {s6 or '-':>5} {s7 or '-':>5} {out['final']:9.2e} "
                f"{rejected:>4} {out['seconds']:6.1f}",
                flush=True,
            )
        ok = [h for h in hits6 if math.isfinite(h)]
        mean = f"{sum(ok) / len(ok):.0f}" if ok else "-"
        print(f"{name:<14} mean steps to 1e-6 over {len(ok)}/{len(hits6)} seeds: {mean}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
