"""Data-parallel Shampoo under faults on real gloo ranks: every rank refuses together.

Each case breaks one rank (a root that fails, a gradient that would overflow only
the owner's factors, an interrupt, a bad checkpoint) or makes the ranks disagree (lr,
another hyperparameter, which parameters have a gradient).  Every rank must raise,
the faulty one with its own error and the others with ``RankFailedError`` or the
same ``ValueError``, with parameters and state bitwise as before; the next steps must
then equal a twin optimizer that never saw the fault.  All cases run in one launch
of 2 ranks, with a collective timeout, so a rank that hangs fails the test instead
of stalling it.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

import secondorder.shampoo.root_inverse as ri
from secondorder.shampoo import AdamGraftingConfig, Shampoo
from secondorder.testing import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Weight (4, 3) and bias (4,): with 2 ranks rank 0 owns the weight, rank 1 the bias.
    return nn.Linear(3, 4)


def _shampoo(model: nn.Module, **kw: Any) -> Shampoo:
    return Shampoo(model.parameters(), lr=0.05, grafting_config=AdamGraftingConfig(), **kw)


def _backward(model: nn.Module, opt: Shampoo, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)  # the same batch on every rank
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def _snapshot(model: nn.Module, opt: Shampoo) -> tuple[list[torch.Tensor], dict[str, Any]]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _fault(case: str, rank: int, model: nn.Module, opt: Shampoo) -> None:
    """Break this rank (or make the ranks disagree) and call what must refuse."""
    if case == "root_fails_on_one_rank":
        if rank == 0:

            def broken(A: torch.Tensor) -> Any:
                raise RuntimeError("linalg.eigh: failed to converge")

            ri._eigh = broken
        _backward(model, opt, 2)
        opt.step()
    elif case == "overflow_on_the_owner_only":
        _backward(model, opt, 2)
        model.weight.grad.fill_(1e21)  # every rank; only rank 0 owns the weight's block
        opt.step()
    elif case == "interrupt_on_one_rank":
        if rank == 1:

            def interrupted(A: torch.Tensor) -> Any:
                raise KeyboardInterrupt

            ri._eigh = interrupted
        _backward(model, opt, 2)
        opt.step()
    elif case == "lr_differs":
        opt.param_groups[0]["lr"] = 0.01 if rank == 0 else 0.02
        _backward(model, opt, 2)
        opt.step()
    elif case == "weight_decay_differs":
        opt.param_groups[0]["weight_decay"] = 0.0 if rank == 0 else 0.1
        _backward(model, opt, 2)
        opt.step()
    elif case == "gradient_on_one_rank_only":
        _backward(model, opt, 2)
        if rank == 1:
            model.bias.grad = None
        opt.step()
    elif case == "bad_checkpoint_on_one_rank":
        saved = copy.deepcopy(opt.state_dict())
        if rank == 0:
            saved["state"][0]["block0.factor0"][0, 0] = float("nan")
        opt.load_state_dict(saved)
    elif case == "indefinite_factor_on_one_rank":
        saved = copy.deepcopy(opt.state_dict())
        if rank == 0:  # diagonal kept, one off-diagonal pair past √(F00·F11)
            F = saved["state"][0]["block0.factor0"]
            F[0, 1] = F[1, 0] = 2 * (F[0, 0] * F[1, 1]).sqrt() + 1e-3
        opt.load_state_dict(saved)
    else:
        raise AssertionError(case)


def _restore(case: str, opt: Shampoo, real_eigh: Any) -> None:
    ri._eigh = real_eigh
    group = opt.param_groups[0]
    group["lr"], group["weight_decay"] = 0.05, 0.0


CASES = [
    "root_fails_on_one_rank",
    "overflow_on_the_owner_only",
    "interrupt_on_one_rank",
    "lr_differs",
    "weight_decay_differs",
    "gradient_on_one_rank_only",
    "bad_checkpoint_on_one_rank",
    "indefinite_factor_on_one_rank",
]


def fault_job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    real_eigh = ri._eigh
    for case in CASES:
        kw = {"num_tolerated_failed_amortized_computations": 0}
        a, b = _model(), _model()
        oa, ob = _shampoo(a, **kw), _shampoo(b, **kw)
        for s in range(2):
            for m, o in ((a, oa), (b, ob)):
                _backward(m, o, s)
                o.step()
        before = _snapshot(a, oa)
        result: dict[str, Any] = {"error_type": None, "error": None}
        try:
            _fault(case, rank, a, oa)
        except BaseException as exc:  # KeyboardInterrupt included: reported, not raised
            result["error_type"], result["error"] = type(exc).__name__, str(exc)
        _restore(case, oa, real_eigh)
        result["unchanged"] = _same(_snapshot(a, oa), before)
        for s in range(2, 4):
            for m, o in ((a, oa), (b, ob)):
                _backward(m, o, s)
                o.step()
        result["like_twin"] = _same(_snapshot(a, oa), _snapshot(b, ob))
        result["params"] = torch.cat([p.detach().reshape(-1) for p in a.parameters()])
        out[case] = result
    # Refused before the first step: the state is built (a collective) only by the
    # ranks that passed validation, so the refusal must travel through the build.
    m = _model()
    o = _shampoo(m)
    o.param_groups[0]["lr"] = -1.0 if rank == 0 else 0.05
    _backward(m, o, 0)
    try:
        o.step()
        out["first_step"] = {"error_type": None, "error": None}
    except (ValueError, RuntimeError) as exc:
        out["first_step"] = {"error_type": type(exc).__name__, "error": str(exc)}
    o.param_groups[0]["lr"] = 0.05
    o.step()  # the group is still in step: the retry succeeds on every rank
    out["first_step"]["params"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # Interrupted in its final writes, after the ranks agreed: rank 1 puts its own step
    # back while rank 0 keeps it, and the next step must say so on both.
    m = _model()
    o = _shampoo(m)
    _backward(m, o, 0)
    o.step()
    real_copy = torch.Tensor.copy_
    fired = []

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        if rank == 1 and not fired and self.data_ptr() == m.weight.data_ptr():
            fired.append(True)
            raise KeyboardInterrupt
        return real_copy(self, src, non_blocking)

    torch.Tensor.copy_ = copy_  # type: ignore[method-assign]
    _backward(m, o, 1)
    try:
        o.step()
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    finally:
        torch.Tensor.copy_ = real_copy  # type: ignore[method-assign]
    _backward(m, o, 2)
    try:
        o.step()
        error = ""
    except ValueError as exc:
        error = str(exc)
    out["commit_interrupt"] = {"interrupted": interrupted, "next_step": error}
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    got = run_ranks(fault_job, WORLD, timeout_s=60.0, deadline_s=240.0)
    return {r: res.value for r, res in got.items()}


# (case, rank 0's error, rank 1's error): type and message pattern.
FAILED_ELSEWHERE = r"rank\(s\) \[{}\] of 2 refused this Shampoo step .*no rank changed its"
EXPECTED: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "root_fails_on_one_rank": (
        ("RuntimeError", r"failed 1 times in a row, .*; no state was changed"),
        ("RankFailedError", FAILED_ELSEWHERE.format(0)),
    ),
    "overflow_on_the_owner_only": (
        ("FloatingPointError", r"the gradient of parameter .* \(shape \(4, 3\)\) is finite but"),
        ("RankFailedError", FAILED_ELSEWHERE.format(0)),
    ),
    "interrupt_on_one_rank": (
        ("RankFailedError", FAILED_ELSEWHERE.format(1)),
        ("KeyboardInterrupt", r"^$"),
    ),
    "lr_differs": (
        ("ValueError", r"param_groups\[0\]\['lr'\] differs across ranks \(rank 0: 0.01, rank 1: "),
        ("ValueError", r"param_groups\[0\]\['lr'\] differs across ranks \(rank 0: 0.01, rank 1: "),
    ),
    "weight_decay_differs": (
        (
            "ValueError",
            r"hyperparameters of param_groups\[0\] must be the same on all 2 ranks.*"
            r"weight_decay differs \(rank 0: '0.0', rank 1: '0.1'\)",
        ),
        ("ValueError", r"weight_decay differs \(rank 0: '0.0', rank 1: '0.1'\)"),
    ),
    "gradient_on_one_rank_only": (
        (
            "ValueError",
            r"\['params'\]\[1\] \(shape \(4,\)\) has a gradient on rank\(s\) \[0\] "
            r"but not on rank\(s\) \[1\]",
        ),
        ("ValueError", r"has a gradient on rank\(s\) \[0\] but not on rank\(s\) \[1\]"),
    ),
    "bad_checkpoint_on_one_rank": (
        ("ValueError", r"the saved state 'block0.factor0' of .* holds NaN or Inf"),
        ("RankFailedError", r"rank\(s\) \[0\] of 2 refused to build or load its Shampoo state"),
    ),
    "indefinite_factor_on_one_rank": (
        ("ValueError", r"the saved state 'block0.factor0' of .* is not positive semidefinite"),
        ("RankFailedError", r"rank\(s\) \[0\] of 2 refused to build or load its Shampoo state"),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_every_rank_refuses_and_nothing_changes(results: dict[int, Any], case: str) -> None:
    for rank in range(WORLD):
        got = results[rank][case]
        want_type, want = EXPECTED[case][rank]
        assert got["error_type"] == want_type, (rank, got["error"])
        assert re.search(want, got["error"], re.S), (rank, got["error"])
        assert got["unchanged"], f"rank {rank} changed its parameters or state"
        assert got["like_twin"], f"rank {rank} differs from the twin that never saw the fault"
    assert torch.equal(results[0][case]["params"], results[1][case]["params"])


def test_refusal_before_the_first_step_reaches_every_rank(results: dict[int, Any]) -> None:
    r0, r1 = results[0]["first_step"], results[1]["first_step"]
    assert r0["error_type"] == "ValueError"
    assert "Invalid lr=-1.0: must be a finite number >= 0" in r0["error"]
    assert r1["error_type"] == "RankFailedError"
    assert "rank(s) [0] of 2 refused to build or load its Shampoo state" in r1["error"]
    assert torch.equal(r0["params"], r1["params"])


def test_an_interrupt_in_one_ranks_final_writes_is_named_at_the_next_step(
    results: dict[int, Any],
) -> None:
    assert [results[r]["commit_interrupt"]["interrupted"] for r in range(WORLD)] == [False, True]
    for rank in range(WORLD):
        got = results[rank]["commit_interrupt"]["next_step"]
        assert re.search(
            r"the step count of param_groups\[0\] differs across ranks \(rank 0: 2, rank 1: 1\)"
            r".*a step interrupted on some ranks only",
            got,
            re.S,
        ), got


def save_on_rank_zero_job(rank: int, world: int, save: bool) -> dict[str, Any]:
    """DDP training where rank 0 alone saves the optimizer before the first step."""
    torch.manual_seed(0)
    model = nn.Linear(3, 4).double()
    net = nn.parallel.DistributedDataParallel(model)
    opt = Shampoo(model.parameters(), lr=0.05, max_preconditioner_dim=4)
    saved = None
    if save and rank == 0:
        # The usual "rank 0 writes the checkpoint" pattern: the other rank is already in
        # DDP's gradient all-reduce, so a collective here would meet that one instead.
        saved = copy.deepcopy(opt.state_dict())
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = (torch.randn(4, n, generator=g, dtype=torch.float64) for n in (3, 4))
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out: dict[str, Any] = {"params": flat, "saved": saved}
    # Built alone by state_dict(), refused at its first step: every rank still refuses.
    fresh = Shampoo(nn.Linear(3, 4).double().parameters(), lr=0.05)
    if rank == 0:
        fresh.state_dict()
        fresh.param_groups[0]["lr"] = -1.0
    for p in fresh.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    try:
        fresh.step()
        out["refused"] = None
    except (ValueError, RuntimeError) as exc:
        out["refused"] = f"{type(exc).__name__}: {exc}"
    return out


def test_state_dict_on_one_rank_before_the_first_step_needs_no_peer() -> None:
    # state_dict() before the first step builds the state; a collective in that build,
    # called on rank 0 alone, paired with DDP's all-reduce on rank 1 (gloo aborted on
    # the size mismatch).  It must build locally and leave the agreement to the step.
    plain = run_ranks(save_on_rank_zero_job, WORLD, args=(False,), timeout_s=30.0)
    saving = run_ranks(save_on_rank_zero_job, WORLD, args=(True,), timeout_s=30.0)
    for rank in range(WORLD):
        assert torch.equal(saving[rank].value["params"], plain[rank].value["params"])
    assert torch.equal(saving[0].value["params"], saving[1].value["params"])
    saved = saving[0].value["saved"]
    assert (saved["shampoo"]["rank"], saved["shampoo"]["world_size"]) == (0, WORLD)
    # Rank 0 of 2 owns the weight's block: its zero state, and step 0, are in the file.
    state = saved["state"][0]
    assert torch.equal(state["block0.factor0"], torch.zeros(4, 4, dtype=torch.float64))
    assert int(state["step"]) == 0
    assert saving[0].value["refused"].startswith("ValueError: Invalid lr=-1.0")
    assert re.match(
        r"RankFailedError: rank\(s\) \[0\] of 2 refused to build", saving[1].value["refused"]
    )


def narrow_wire_job(rank: int, world: int) -> dict[str, Any]:
    """Directions beyond float16's range, sent with communication_dtype=torch.float16."""
    from secondorder.shampoo import SGDGraftingConfig

    def build() -> tuple[nn.Module, Shampoo]:
        model = _model()
        opt = Shampoo(
            model.parameters(),
            lr=1e-6,
            grafting_config=SGDGraftingConfig(),
            communication_dtype=torch.float16,
        )
        return model, opt

    (a, oa), (b, ob) = build(), build()
    for m, o in ((a, oa), (b, ob)):
        _backward(m, o, 0)
        o.step()
    before = _snapshot(a, oa)
    _backward(a, oa, 1)
    for p in a.parameters():  # SGD grafting: directions of the gradients' norm, > 65504
        p.grad.mul_(1e5)
    out: dict[str, Any] = {}
    try:
        oa.step()
        out["error"] = None
    except FloatingPointError as exc:
        out["error"] = str(exc)
    out["unchanged"] = _same(_snapshot(a, oa), before)
    out["finite"] = all(bool(p.isfinite().all()) for p in a.parameters())
    for m, o in ((a, oa), (b, ob)):
        _backward(m, o, 2)
        o.step()
    out["like_twin"] = _same(_snapshot(a, oa), _snapshot(b, ob))
    return out


def test_directions_beyond_the_communication_dtype_are_refused_on_every_rank() -> None:
    # A float16 wire turned an entry beyond 65504 into Inf, and every rank set the
    # parameter to -Inf. Every rank reads the same bytes, so all refuse alike.
    got = run_ranks(narrow_wire_job, WORLD, timeout_s=30.0)
    for rank in range(WORLD):
        out = got[rank].value
        assert out["error"] is not None, f"rank {rank} took the step"
        assert re.search(
            r"the direction of parameter param_groups\[0\]\['params'\]\[0\] \(shape \(4, 3\)\) "
            r"has an entry beyond the range of "
            r"communication_dtype=torch.float16 \(largest 65504\), so it arrived as Inf; no "
            r"rank changed .* Use communication_dtype=torch.bfloat16",
            out["error"],
        ), out["error"]
        assert out["unchanged"] and out["finite"] and out["like_twin"], (rank, out)
