"""Numerical faults on one rank only: every rank rejects, and the run goes on.

A NaN in one rank's residuals, in its Jacobian only, or at one trial point reaches
the other ranks through the summed loss, ``Jᵀr`` and ``JᵀJ``: every rank must take
the same decision, leave its parameters bitwise unchanged for a rejected attempt,
and train on at the next step.  The reference is one process fed the concatenated
batch with the same rows poisoned at the same call.  One launch of two gloo ranks
runs every case (starting processes costs more than the training).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from lm_cases import RTOL, SCENARIOS, flat, global_batch, info_dict, model_for, shard
from torch import Tensor

import secondorder as so
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 3
FAULTY_STEP = 0  # every clean run accepts its first step at the first attempt
#: With ``jacobian="batch_reverse"`` one step calls the residual function once to
#: validate the batch, once to linearise and once per trial point.
CALL = {"residual": 2, "jacobian": 2, "trial": 3}
FAULT_KINDS = tuple(CALL)
CASES = ("primal-cholesky", "primal-cg", "dual-cholesky")


class RowFault:
    """``outputs - targets`` with the rows ``start:`` poisoned at one call of one step.

    ``residual``: those residuals are NaN.  ``jacobian``: the residuals are exact but
    their derivatives are NaN (``0·sqrt(z)`` at ``z = 0``).  ``trial``: the residuals
    at the first trial point are NaN.
    """

    def __init__(self, kind: str, start: int) -> None:
        self.kind, self.start = kind, start
        self.armed = False
        self.calls = 0
        self.hits = 0

    def __call__(self, out: Tensor, target: Tensor) -> Tensor:
        self.calls += self.armed
        r = out - target
        if not (self.armed and self.calls == CALL[self.kind]) or self.start >= r.shape[0]:
            return r
        self.hits += 1
        mask = (torch.arange(r.shape[0]) >= self.start).reshape(-1, *([1] * (r.ndim - 1)))
        if self.kind == "jacobian":
            z = (out - out) + (~mask).to(out.dtype)
            return r + 0.0 * torch.sqrt(z)
        return torch.where(mask, torch.full_like(r, math.nan), r)


def run_case(name: str, kind: str, x: Tensor, y: Tensor, start: int) -> dict[str, Any]:
    options, _ = SCENARIOS[name]
    model = model_for(seed=0)
    fault = RowFault(kind, start)
    opt = so.LevenbergMarquardt(model, fault, jacobian="batch_reverse", **options)
    params, infos = [flat(model)], []
    for step in range(STEPS):
        fault.armed, fault.calls = step == FAULTY_STEP, 0
        infos.append(info_dict(opt.step(x, y)))
        params.append(flat(model))
    return {"params": params, "infos": infos, "hits": fault.hits}


def same_info(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal step records, a NaN gain ratio (no attempt evaluated) equal to itself."""
    nan = [k for k, v in a.items() if isinstance(v, float) and math.isnan(v)]
    return a.keys() == b.keys() and all(math.isnan(b[k]) if k in nan else a[k] == b[k] for k in a)


@functools.cache
def clean_run(name: str) -> list[dict[str, Any]]:
    """One process, the concatenated batch, no fault."""
    infos: list[dict[str, Any]] = run_case(name, "trial", *global_batch(SCENARIOS[name][1]), 10**9)[
        "infos"
    ]
    return infos


def job_faults(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name in CASES:
        x, y = shard(SCENARIOS[name][1], rank, world)
        for kind in FAULT_KINDS:
            # Rank 1 poisons all of its rows, rank 0 none.
            out[name, kind] = run_case(name, kind, x, y, 0 if rank == 1 else x.shape[0])
    return out


@pytest.fixture(scope="module")
def faulted() -> dict[int, Any]:
    # Generous limits: the ranks share this machine's cores with whatever else runs.
    results = run_ranks(job_faults, WORLD, timeout_s=120.0, deadline_s=300.0)
    return {r: res.value for r, res in results.items()}


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("name", CASES)
def test_a_fault_on_one_rank_is_rejected_on_every_rank(faulted, name: str, kind: str) -> None:
    got = [faulted[r][name, kind] for r in range(WORLD)]
    assert got[0]["hits"] == 0 and got[1]["hits"] == 1  # rank 1 only, once
    # Every rank took the same decisions and holds the same bits.
    for step in range(STEPS + 1):
        assert torch.equal(got[0]["params"][step], got[1]["params"][step]), step
    for a, b in zip(got[0]["infos"], got[1]["infos"], strict=True):
        assert same_info(a, b), (a, b)
    infos, params = got[0]["infos"], got[0]["params"]
    faulty = infos[FAULTY_STEP]
    clean = clean_run(name)
    assert clean[FAULTY_STEP]["accepted"] and clean[FAULTY_STEP]["attempts"] == 1
    assert faulty["damping"] > clean[FAULTY_STEP]["damping"]
    if kind == "trial":
        # The poisoned attempt is rejected and λ raised; the next attempt succeeds.
        assert faulty["attempts"] == clean[FAULTY_STEP]["attempts"] + 1
    else:
        assert not faulty["accepted"] and not faulty["terminated"]
        assert "non-finite residuals or Jacobian" in faulty["reason"]
        assert torch.equal(params[FAULTY_STEP + 1], params[FAULTY_STEP])
    assert all(i["accepted"] for i in infos[FAULTY_STEP + 1 :])
    assert all(bool(torch.isfinite(p).all()) for p in params)
    # One process fed the concatenated batch, rank 1's rows poisoned at the same call.
    x, y = global_batch(SCENARIOS[name][1])
    ref = run_case(name, kind, x, y, start=shard(SCENARIOS[name][1], 0, WORLD)[0].shape[0])
    assert ref["hits"] == 1
    for step, (a, b) in enumerate(zip(infos, ref["infos"], strict=True)):
        for key in ("accepted", "attempts", "status", "terminated", "form", "solver"):
            assert a[key] == b[key], f"step {step}: {key}"
        assert a["damping"] == pytest.approx(b["damping"], rel=10 * RTOL)
        if a["accepted"]:
            assert a["loss"] == pytest.approx(b["loss"], rel=10 * RTOL)
    for p, q in zip(params, ref["params"], strict=True):
        assert float((p - q).abs().max()) <= RTOL * float(q.abs().max())
