"""The geodesic acceleration's ingredient: r's second derivative along a step, all ranks.

With ``geodesic=True`` the engine corrects each step ``v`` by the second directional
derivative ``r_vv`` of the residuals along it (Transtrum and Sethna): two nested
forward-mode products per slice, and ``Jᵀr_vv`` from J's stored rows or one more
reverse pass.  A rank whose model raises joins the reduction with zeros and a failure
flag, as the linearisation does: every rank raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import jvp, vjp

from .linalg import NormalEquations
from .model import ModelEvaluator
from .walk import BatchWalk

__all__ = ["second_directional"]


def second_directional(
    problem: BatchWalk, x: Tensor, v: Tensor, system: NormalEquations
) -> tuple[Tensor, Tensor | None]:
    """``(Jᵀr_vv, r_vv)``, ``r_vv`` the second derivative of r along ``v`` (geodesic).

    A rank whose model raises here joins the reduction with zeros and a failure
    flag, as in :meth:`~secondorder.lm.problem.ModelProblem.linearize`: every rank raises.
    """
    error: Exception | None = None
    try:
        b, w = _on_this_rank(problem, x, v, system)
    except Exception as exc:
        error = problem.reducer.hold(exc)
        b, w = _zeros(problem, x, system)
    failed = torch.tensor([float(error is not None)], dtype=b.dtype, device=b.device)
    what = "computing the geodesic acceleration"
    if system.jac is not None and not problem.rows_sharded:
        # J holds every rank's rows: gather r_vv the same way (its flag in a second
        # column, on a rank's first row), and Jᵀr_vv is then the global product.
        flags = torch.zeros_like(w)
        flags[:1] = failed
        w, flags = problem.reducer.gather_rows_together([w, flags])
        problem.reducer.raise_together(error, flags.sum(), what)
        return system.jac.T @ w.to(system.jac.dtype), w
    # Each rank's share of Jᵀr_vv is summed; the flag rides with it.
    packed = torch.cat([b, failed])
    problem.reducer.sum_([packed])
    problem.reducer.raise_together(error, packed[-1], what)
    return packed[:-1], w


def _on_this_rank(
    problem: BatchWalk, x: Tensor, v: Tensor, system: NormalEquations
) -> tuple[Tensor, Tensor]:
    """``(Jᵀr_vv, r_vv)`` on this rank: ``r_vv`` of its rows, ``Jᵀr_vv`` not yet reduced.

    When J holds every rank's rows, ``Jᵀr_vv`` is left to the caller (zeros here).
    """
    group = problem.group
    points = problem.function.points(x)
    tangents = [problem.unflatten(vk) for vk in group.replicate(v)]
    rvvs: list[Tensor] = []
    b = torch.zeros_like(x)
    with problem.function.frozen():
        for k, inputs, targets in group.stage(problem.slices()):
            params, tangent = points[k], tangents[k]

            def f(
                p: dict[str, Tensor],
                inputs: Any = inputs,
                targets: Any = targets,
                ev: ModelEvaluator = problem.replicas[k],
            ) -> Tensor:
                return ev.batch(p, inputs, targets)

            def jv(
                p: dict[str, Tensor],
                f: Callable[..., Tensor] = f,
                tangent: dict[str, Tensor] = tangent,
            ) -> Tensor:
                out: Tensor = jvp(f, (p,), (tangent,))[1]
                return out

            with group.on(k):
                rvv = jvp(jv, (params,), (tangent,))[1].detach()
                if system.jac is None:
                    (ct,) = vjp(f, params)[1](rvv)
                    part = torch.cat([ct[name].reshape(-1) for name in problem.names]).detach()
            rvvs.append(group.gather(rvv))
            if system.jac is None:
                b += group.gather(part)
    w = torch.cat(rvvs)
    if system.jac is not None and problem.rows_sharded:
        b = system.jac.T @ w.to(system.jac.dtype)
    return b, w


def _zeros(problem: BatchWalk, x: Tensor, system: NormalEquations) -> tuple[Tensor, Tensor]:
    """What a rank whose model raised brings to :meth:`second_directional`'s reduction.

    ``Jᵀr_vv`` as zeros of its dtype, and as many zero rows of ``r_vv`` as this rank
    had residuals at the linearisation (at least one, to carry the flag).
    """
    jac = system.jac
    dtype = jac.dtype if jac is not None and problem.rows_sharded else x.dtype
    rows = max(sum(problem.slice_counts or []), 1)
    return (
        torch.zeros(problem.n, dtype=dtype, device=x.device),
        torch.zeros(rows, dtype=x.dtype, device=x.device),
    )
