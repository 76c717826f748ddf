"""Shampoo's per-step overhead against AdamW, for :mod:`benchmarks.shampoo_side_by_side`.

DistributedShampoo's paper bounds the cost of a Shampoo iteration at scale by 1.1 times
a diagonal method's, at its recommended preconditioning frequencies.  The side-by-side
trains a third copy of the model with :func:`adamw_like` in the same interleaved rounds
as ours and DistributedShampoo; :func:`overhead_table` reports both ratios, the step
alone and the whole iteration (forward, backward and step, the one the bound is about).
:func:`ops_rows` counts the operations a step dispatches, each a launch on a GPU.
"""

from __future__ import annotations

import statistics
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .ops import count_ops

__all__ = ["adamw_like", "ops_rows", "overhead_table"]


def adamw_like(options: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` with a Shampoo configuration's lr, betas, eps and decay.

    ``options`` are DistributedShampoo's keyword arguments with Adam grafting: β₁ is
    ``betas[0]``, β₂ and ε the grafting's (Shampoo's own ε regularises its factors).
    """
    graft = options["grafting_config"]
    return torch.optim.AdamW(
        model.parameters(),
        lr=options["lr"],
        betas=(options["betas"][0], graft.beta2),
        eps=graft.epsilon,
        weight_decay=options["weight_decay"],
    )


def _median_range(xs: list[float] | None, bold: bool = False) -> str:
    if xs is None:
        return "not installed"
    m = f"{statistics.median(xs):.2f}"
    return f"{f'**{m}**' if bold else m} ({min(xs):.2f}-{max(xs):.2f})"


def overhead_table(results: list[dict[str, Any]], clock: str) -> list[str]:
    """The table of the results that hold an ``"overhead"`` entry (none: no lines).

    Each such entry holds AdamW's median seconds (``adamw_step_s``,
    ``adamw_iteration_s``) and per-round ratios ``ours_step``, ``ours_iteration`` and,
    with the peer, ``theirs_step``, ``theirs_iteration``.
    """
    rows = [r for r in results if "overhead" in r]
    if not rows:
        return []
    lines = [
        "",
        f"Overhead against torch.optim.AdamW (same model, batches, lr, betas, eps and weight "
        f"decay; interleaved rounds), {clock} time, median over rounds (range). The "
        "iteration ratio (forward + backward + step) is the one to hold against "
        "DistributedShampoo's paper (at most 10% per step over diagonal methods, at scale: "
        "target <= 1.1); the step ratio is optimizer.step() alone.",
        "",
        "| configuration | AdamW step | AdamW iteration | ours / AdamW, step "
        "| ours / AdamW, iteration (target <= 1.1) | DistributedShampoo / AdamW, step "
        "| DistributedShampoo / AdamW, iteration |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o = r["overhead"]
        lines.append(
            f"| {r['title']} | {o['adamw_step_s'] * 1e3:.2f} ms "
            f"| {o['adamw_iteration_s'] * 1e3:.2f} ms | {_median_range(o['ours_step'])} "
            f"| {_median_range(o['ours_iteration'], bold=True)} "
            f"| {_median_range(o.get('theirs_step'))} "
            f"| {_median_range(o.get('theirs_iteration'))} |"
        )
    return lines


def ops_rows(
    configs: list[Any], ours_ds: ModuleType, theirs_ds: ModuleType | None, device: torch.device
) -> list[str]:
    """A table of the aten operations one ``optimizer.step()`` dispatches, per side.

    Each side trains past its first root refresh (``precondition_frequency + 2`` steps),
    then its step is counted on one batch's gradients (:func:`~benchmarks.ops.count_ops`):
    on a GPU each operation is a launch, which bounds a small model's step.
    """
    lines = [
        "| configuration | ours | DistributedShampoo | torch.optim.AdamW |",
        "|---|---:|---:|---:|",
    ]
    for c in configs:
        counts: dict[str, str] = {}
        for name, ds in (("ours", ours_ds), ("theirs", theirs_ds), ("adamw", ours_ds)):
            if ds is None:
                counts[name] = "not installed"
                continue
            torch.manual_seed(0)
            model = c.model().to(device)
            options = c.options(ds)
            opt = (
                adamw_like(options, model)
                if name == "adamw"
                else ds.DistributedShampoo(model.parameters(), **options)
            )
            batches = c.batches(options["precondition_frequency"] + 3)
            for i, (x, y) in enumerate(batches):
                opt.zero_grad(set_to_none=True)
                c.loss(model(x.to(device)), y.to(device)).backward()
                if i < len(batches) - 1:  # the last batch's gradients are the counted steps'
                    opt.step()
            counts[name] = str(count_ops(opt.step, warm=0, steps=3))
        lines.append(f"| {c.title} | {counts['ours']} | {counts['theirs']} | {counts['adamw']} |")
    return lines
