"""Shampoo under faults on one process: a failed or interrupted step and a refused load
change nothing; half-precision, transposed and ``channels_last`` parameters train; SOAP
ignores the rounding noise in the factors' null space.

"Nothing changed" is checked bitwise: the full state dict and every parameter before
and after, then the next steps against a twin optimizer that never saw the fault.
"""

from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import secondorder.shampoo.root_inverse as ri
from secondorder.shampoo import (
    AdamGraftingConfig,
    CoupledNewtonConfig,
    EigenConfig,
    SGDGraftingConfig,
    Shampoo,
)


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    # Blocks of three shapes (max_preconditioner_dim=4): several batches per step.
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype)


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x = torch.randn(16, 3, generator=g).to(dtype)
    y = torch.randn(16, 2, generator=g).to(dtype)
    return ((model(x) - y) ** 2).mean()


def _backward(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    _loss(model, seed).backward()


def _pair(**kw: Any) -> tuple[nn.Module, Shampoo, nn.Module, Shampoo]:
    options = dict(grafting_config=AdamGraftingConfig(), max_preconditioner_dim=4, **kw)
    a, b = _model(), _model()
    return a, Shampoo(a.parameters(), **options), b, Shampoo(b.parameters(), **options)


def _snapshot(model: nn.Module, opt: Shampoo) -> tuple[list[torch.Tensor], dict[str, Any]]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _assert_same(a: Any, b: Any) -> None:
    """Equal bit for bit: tensors with torch.equal (same dtype), the rest with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _assert_unchanged(model: nn.Module, opt: Shampoo, before: Any) -> None:
    _assert_same(_snapshot(model, opt), before)


def _assert_twins(a: nn.Module, oa: Shampoo, b: nn.Module, ob: Shampoo, seeds: range) -> None:
    """Both take the same steps and stay equal bit for bit."""
    for s in seeds:
        for m, o in ((a, oa), (b, ob)):
            _backward(m, o, s)
            o.step()
    _assert_same(_snapshot(a, oa), _snapshot(b, ob))


# -- a failed or interrupted step ---------------------------------------------------------
def test_roots_failing_past_the_tolerance_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    a, oa, b, ob = _pair(num_tolerated_failed_amortized_computations=0)
    _assert_twins(a, oa, b, ob, range(2))
    before = _snapshot(a, oa)

    def broken(A: torch.Tensor) -> Any:
        raise RuntimeError("linalg.eigh: failed to converge")

    monkeypatch.setattr(ri, "_eigh", broken)
    _backward(a, oa, 2)
    with pytest.raises(RuntimeError, match=r"failed 1 times in a row, .*; no state was changed"):
        oa.step()
    _assert_unchanged(a, oa, before)
    monkeypatch.undo()
    _assert_twins(a, oa, b, ob, range(2, 4))


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, MemoryError])
def test_interrupt_in_a_later_block_batch_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException]
) -> None:
    a, oa, b, ob = _pair()
    _assert_twins(a, oa, b, ob, range(2))
    before = _snapshot(a, oa)
    calls = []
    real = ri._eigh

    def late(A: torch.Tensor) -> Any:
        calls.append(A.shape)
        if len(calls) == 4:  # past the first batch's two factors
            raise interrupt()
        return real(A)

    monkeypatch.setattr(ri, "_eigh", late)
    _backward(a, oa, 2)
    with pytest.raises(interrupt):
        oa.step()
    assert len(oa._batches) >= 3 and len(calls) == 4
    _assert_unchanged(a, oa, before)
    monkeypatch.undo()
    _assert_twins(a, oa, b, ob, range(2, 4))


@pytest.mark.parametrize("where", ["state", "parameters"])
def test_interrupt_inside_the_commit_puts_everything_back(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # The commit points the state at the new tensors (unbind makes each block's view)
    # and copies the parameters' new values; an interrupt between two of those must
    # leave the old state and values in place.
    a, oa, b, ob = _pair(precondition_frequency=2)
    _assert_twins(a, oa, b, ob, range(2))
    before = _snapshot(a, oa)
    second = list(a.parameters())[1]
    calls = []
    real_unbind, real_copy = torch.Tensor.unbind, torch.Tensor.copy_

    def unbind(self: torch.Tensor, dim: int = 0) -> Any:
        calls.append("unbind")
        if where == "state" and calls.count("unbind") == 3:
            raise KeyboardInterrupt
        return real_unbind(self, dim)

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        if where == "parameters" and self.data_ptr() == second.data_ptr():
            calls.append("copy")
            if calls.count("copy") == 1:  # once: the restore copies it back
                raise KeyboardInterrupt
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "unbind", unbind)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    _backward(a, oa, 2)
    with pytest.raises(KeyboardInterrupt):
        oa.step()
    monkeypatch.undo()
    assert ("copy" in calls) == (where == "parameters") and calls.count("unbind") >= 3
    _assert_unchanged(a, oa, before)
    _assert_twins(a, oa, b, ob, range(2, 5))


@pytest.mark.parametrize(
    ("config", "method"),
    [
        (CoupledNewtonConfig(), "the coupled Newton iteration in torch.float32"),
        (
            EigenConfig(retry_double_precision=False),
            "eigh in torch.float32, retry_double_precision=False",
        ),
    ],
)
def test_a_tolerated_root_failure_names_how_the_root_was_computed(
    monkeypatch: pytest.MonkeyPatch, config: Any, method: str
) -> None:
    # The warning said "failed even in float64" for every method, but only eigh with
    # retry_double_precision retries in float64: the coupled Newton iteration fails
    # in float32 (its iterates turn NaN on a rank-deficient factor with a small
    # epsilon), where raising epsilon or factor_dtype=torch.float64 is the remedy.
    if isinstance(config, CoupledNewtonConfig):
        real = torch.linalg.matrix_power

        def diverged(M: torch.Tensor, n: int) -> torch.Tensor:
            return real(M, n) * float("nan")

        monkeypatch.setattr(torch.linalg, "matrix_power", diverged)
    else:

        def unconverged(A: torch.Tensor) -> Any:
            raise RuntimeError("linalg.eigh: failed to converge")

        monkeypatch.setattr(ri, "_eigh", unconverged)
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5, 3))
    opt = Shampoo([p], root_inv_config=config, max_preconditioner_dim=8)
    p.grad = torch.randn(5, 3)
    with pytest.warns(RuntimeWarning) as caught:
        opt.step()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert re.search(
        rf"block 0 \(factors \[0, 1\]\) of parameter .* failed at step 1 \({re.escape(method)}\); "
        r"keeping its previous root \(1 failure\(s\) in a row, 3 tolerated\)",
        messages[0],
    ), messages[0]
    assert "float64" not in messages[0]


def test_tolerated_root_failure_warns_only_when_the_step_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first batch's roots fail (tolerated: a warning), a later batch is interrupted:
    # the step is refused, so no failure was kept and nothing may be reported.
    a, oa, b, ob = _pair(num_tolerated_failed_amortized_computations=1)
    _assert_twins(a, oa, b, ob, range(2))
    before = _snapshot(a, oa)
    shapes: list[tuple[int, ...]] = []
    real = ri._eigh
    second = (1, 3, 3)  # the first batch's factors are 4x4, then 3x3

    def flaky(A: torch.Tensor) -> Any:
        shapes.append(tuple(A.shape))
        if second not in shapes:  # the first factor, and its float64 retry
            raise RuntimeError("linalg.eigh: failed to converge")
        if interrupt and shapes[-1] != second:  # the next batch
            raise KeyboardInterrupt
        return real(A)

    monkeypatch.setattr(ri, "_eigh", flaky)
    interrupt = True
    _backward(a, oa, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            oa.step()
    assert not [w for w in caught if "keeping its previous root" in str(w.message)]
    assert second in shapes and shapes[-1] not in ((1, 4, 4), second)  # a later batch
    _assert_unchanged(a, oa, before)
    shapes.clear()
    interrupt = False
    with pytest.warns(
        RuntimeWarning, match=r"failed at step 3 \(eigh, even in float64\); keeping its"
    ):
        oa.step()


def test_soap_keeps_the_previous_basis_of_the_one_block_whose_eigh_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two (3, 4) blocks in one stack: the batched eigh fails, the matrix-by-matrix
    # fallback fails for the first block only.  That block keeps its eigenvectors (with
    # a warning), the other's are refreshed exactly as on their own.
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(3, 4, dtype=torch.float64)) for _ in range(2)]
    opt = Shampoo(ps, lr=0.01, preconditioner="eigenvalue_corrected", max_preconditioner_dim=4)
    for p in ps:
        p.grad = torch.randn(3, 4, dtype=torch.float64)
    opt.step()
    for p in ps:
        p.grad = torch.randn(3, 4, dtype=torch.float64)
    real = ri._eigh
    stacks: list[torch.Tensor] = []

    def first_fails(A: torch.Tensor) -> Any:
        if A.shape[0] > 1:
            stacks.append(A)
            raise RuntimeError("linalg.eigh: failed to converge")
        if torch.equal(A[0], stacks[-1][0]):
            raise RuntimeError("linalg.eigh: failed to converge")
        return real(A)

    before = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    monkeypatch.setattr(ri, "_eigh", first_fails)
    with pytest.warns(RuntimeWarning, match=r"block 0 \(factors \[0, 1\]\) of parameter"):
        opt.step()
    assert len(stacks) == 2  # both factors' stacks fell back
    for k, A in enumerate(stacks):
        key = f"block0.eigenvectors{k}"
        assert torch.equal(opt.state[ps[0]][key], before[0][key])
        want = real(A[1:])[1][0]
        assert torch.equal(opt.state[ps[1]][key], want)
        assert not torch.equal(want, before[1][key])


def test_refused_structure_change_and_bad_lr_change_nothing() -> None:
    a, oa, b, ob = _pair()
    _assert_twins(a, oa, b, ob, range(2))
    before = _snapshot(a, oa)
    _backward(a, oa, 2)
    oa.param_groups[0]["lr"] = -0.5
    with pytest.raises(ValueError, match=r"Invalid lr=-0.5: must be a finite number >= 0"):
        oa.step()
    oa.param_groups[0]["lr"] = 1e-2
    _assert_unchanged(a, oa, before)
    _assert_twins(a, oa, b, ob, range(2, 3))


# -- checkpoints ------------------------------------------------------------------------
def _first(sd: dict[str, Any], key: str) -> torch.Tensor:
    """The first parameter's saved entry ``key`` (``block0.<key>``, or ``step``)."""
    entry = "step" if key == "step" else f"block0.{key}"
    return sd["state"][0][entry]


def _set(key: str, fill: Any) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        t = _first(sd, key)
        t.view(-1)[0] = fill

    return edit


def _indefinite(key: str) -> Callable[[dict[str, Any]], None]:
    """Set F[0, 1] = F[1, 0] past √(F[0, 0]·F[1, 1]): diagonal fine, matrix indefinite."""

    def edit(sd: dict[str, Any]) -> None:
        F = _first(sd, key)
        F[0, 1] = F[1, 0] = 2 * (F[0, 0] * F[1, 1]).sqrt() + 1e-3

    return edit


def _remove(key: str) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        del sd["state"][0][f"block0.{key}"]

    return edit


def _replace(key: str, make: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        sd["state"][0][key] = make(sd["state"][0][key])

    return edit


W0 = r"of parameter param_groups\[0\]\['params'\]\[0\] \(shape \(5, 3\)\)"
BAD_CHECKPOINTS = {
    "nan_root": (
        dict(precondition_frequency=10),
        _set("root1", float("nan")),
        ValueError,
        rf"the saved state 'block0.root1' {W0} holds NaN or Inf",
    ),
    "inf_filtered_grad": (
        {},
        _set("filtered_grad", float("inf")),
        ValueError,
        rf"'block0.filtered_grad' {W0} holds NaN or Inf",
    ),
    "negative_corrected_eigenvalues": (
        dict(preconditioner="eigenvalue_corrected"),
        _set("corrected_eigenvalues", -1.0),
        ValueError,
        rf"'block0.corrected_eigenvalues' {W0} holds values below 0",
    ),
    "negative_grafting_state": (
        {},
        _set("grafting_state", -1.0),
        ValueError,
        rf"'block0.grafting_state' {W0} holds values below 0",
    ),
    "negative_factor_diagonal": (
        {},
        _set("factor0", -1.0),
        ValueError,
        rf"'block0.factor0' {W0} holds a diagonal entry below 0",
    ),
    "indefinite_factor": (
        {},
        _indefinite("factor0"),
        ValueError,
        rf"'block0.factor0' {W0} is not positive semidefinite: \|F\[0, 1\]\| = .* exceeds "
        r"√\(F\[0, 0\]·F\[1, 1\]\)",
    ),
    "negative_step": (
        {},
        _replace("step", lambda t: torch.tensor(-3)),
        ValueError,
        r"Invalid saved step=-3 in param_groups\[0\]: must be a whole number >= 0",
    ),
    "fractional_step": (
        {},
        _replace("step", lambda t: torch.tensor(2.5)),
        ValueError,
        r"Invalid saved step=2.5 in param_groups\[0\]",
    ),
    "missing_factor": (
        {},
        _remove("factor0"),
        ValueError,
        rf"the saved state lacks 'block0.factor0' {W0}, which this optimizer keeps",
    ),
    "lossy_dtype": (
        {},
        _replace("block0.factor0", lambda t: t.double()),
        ValueError,
        r"'block0.factor0' .* has dtype torch.float64, which torch.float32 cannot hold exactly",
    ),
    "meta_tensor": (
        {},
        _replace("block0.factor0", lambda t: torch.empty_like(t, device="meta")),
        TypeError,
        r"Invalid saved state 'block0.factor0' of parameter id 0: must be a tensor with data, "
        "got a meta tensor",
    ),
    "not_a_tensor": (
        {},
        _replace("block0.factor0", lambda t: t.tolist()),
        TypeError,
        r"Invalid saved state 'block0.factor0' of parameter id 0: must be a tensor with data, "
        "got list",
    ),
    "not_a_state_dict": (
        {},
        lambda sd: sd.pop("state"),
        ValueError,
        r"Invalid state_dict \(keys \['param_groups', 'shampoo'\]\): must be a dict with 'state'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_impossible_checkpoint_is_refused_and_changes_nothing(case: str) -> None:
    kw, edit, exc, match = BAD_CHECKPOINTS[case]
    a, oa, b, ob = _pair(**kw)
    _assert_twins(a, oa, b, ob, range(3))
    saved = copy.deepcopy(oa.state_dict())
    edit(saved)
    before = _snapshot(a, oa)
    with pytest.raises(exc, match=match):
        oa.load_state_dict(saved)
    _assert_unchanged(a, oa, before)
    _assert_twins(a, oa, b, ob, range(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_one_factors_at_the_cauchy_schwarz_bound_load(dtype: torch.dtype) -> None:
    # Gradients along one direction: the factor is v vᵀ times a sum, every 2x2 minor is 0
    # in exact arithmetic and off by rounding here; the off-diagonal check must allow it.
    v = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=dtype)
    p = nn.Parameter(torch.zeros(64, dtype=dtype))
    opt = Shampoo([p], betas=(0.9, 0.999), precondition_frequency=10)
    for t in range(30):
        p.grad = v * (1.0 + 0.37 * t)
        opt.step()
    F = opt.state_dict()["state"][0]["block0.factor0"]
    d = F.diagonal()
    assert bool((F.abs() > (d[:, None] * d[None, :]).sqrt()).any())  # rounding past the bound
    fresh = Shampoo([nn.Parameter(p.detach().clone())], betas=(0.9, 0.999))
    fresh.load_state_dict(opt.state_dict())
    assert torch.equal(fresh.state_dict()["state"][0]["block0.factor0"], F)


def test_another_optimizers_state_dict_is_named() -> None:
    a, oa, b, ob = _pair()
    _assert_twins(a, oa, b, ob, range(2))
    adam = torch.optim.Adam(a.parameters())
    _backward(a, adam, 0)
    adam.step()
    a.load_state_dict(b.state_dict())  # undo Adam's step on the model
    before = _snapshot(a, oa)
    with pytest.raises(
        ValueError,
        match=r"this is not a Shampoo state dict: its param_groups\[0\] lacks \['epsilon', "
        r"'momentum', .* and holds \['amsgrad', .*; it was saved by another optimizer "
        r"\(torch.optim.Adam's looks like this\)",
    ):
        oa.load_state_dict(adam.state_dict())
    _assert_unchanged(a, oa, before)
    _assert_twins(a, oa, b, ob, range(2, 4))


def test_half_precision_checkpoint_entries_load_upcast_exactly() -> None:
    # A bfloat16 entry fits a float32 buffer exactly: accepted, and equal after loading.
    a, oa, b, ob = _pair()
    _assert_twins(a, oa, b, ob, range(2))
    saved = copy.deepcopy(oa.state_dict())
    half = saved["state"][0]["block0.filtered_grad"].to(torch.bfloat16)
    saved["state"][0]["block0.filtered_grad"] = half
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    oa.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(oa.state[a[0].weight]["block0.filtered_grad"], half.float())


# -- parameters of every dtype and layout -----------------------------------------------
def test_a_float16_direction_beyond_its_range_is_refused() -> None:
    # A float16 parameter's direction is computed in float32 and rounded to float16;
    # an entry beyond 65504 (SGD grafting of gradients near float16's limit) became
    # Inf and the parameter ±Inf, silently. bfloat16 (float32's range) holds it.
    def build(dtype: torch.dtype) -> tuple[nn.Parameter, Shampoo]:
        p = nn.Parameter(torch.ones(4, 3, dtype=dtype))
        opt = Shampoo([p], lr=1e-6, grafting_config=SGDGraftingConfig(), max_preconditioner_dim=4)
        return p, opt

    grad = torch.full((4, 3), 6e4)
    grad[0, 0] = 1e3
    p, opt = build(torch.float16)
    p.grad = grad.half()
    before = (p.detach().clone(), copy.deepcopy(opt.state_dict()))
    with pytest.raises(
        FloatingPointError,
        match=r"the direction of parameter param_groups\[0\]\['params'\]\[0\] \(shape "
        r"\(4, 3\)\) has an entry beyond the range of its dtype torch.float16 \(largest "
        r"65504\); no state was changed. Use AdamGraftingConfig",
    ):
        opt.step()
    _assert_same((p.detach(), opt.state_dict()), before)
    # The float32 step it would have rounded: W − lr·P, with P's largest entry > 65504.
    q, oq = build(torch.float32)
    q.grad = grad.half().float()
    oq.step()
    assert ((1.0 - q.detach()) / 1e-6).abs().max() > 65504
    b, ob = build(torch.bfloat16)
    b.grad = grad.bfloat16()
    ob.step()
    r, orr = build(torch.float32)  # the same step on the same (bfloat16) gradient
    r.grad = grad.bfloat16().float()
    orr.step()
    torch.testing.assert_close(b.detach().float(), r.detach(), rtol=1e-2, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_train_like_float32(dtype: torch.dtype) -> None:
    # Default settings (no grafting, epsilon 1e-12): half-precision factors made bfloat16
    # diverge (loss 1e16 after 20 steps) and float16 fail its root at step 4.
    losses = {}
    for dt in (dtype, torch.float32):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype).to(dt)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        x, y = x.to(dtype).to(dt), y.to(dtype).to(dt)
        opt = Shampoo(m.parameters(), lr=0.01)
        for _ in range(20):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
        losses[dt] = float(loss.detach())
        for key, t in opt.state[m[0].weight].items():
            if key != "step" and t.is_floating_point():
                assert t.dtype == torch.float32, key
    # float32 goes from 1.23 to 1.15; half precision tracks it to its own rounding.
    assert abs(losses[dtype] - losses[torch.float32]) < 0.02, losses


def test_transposed_and_channels_last_parameters_step_like_contiguous_ones() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    twin = copy.deepcopy(conv)
    conv = conv.to(memory_format=torch.channels_last)
    w = torch.randn(4, 6)
    t_param = w.t().contiguous().t().requires_grad_()  # (4, 6) with strides (1, 4)
    c_param = w.clone().requires_grad_()
    oa = Shampoo([*conv.parameters(), t_param])  # each parameter merges into one dimension
    ob = Shampoo([*twin.parameters(), c_param])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 3, 6, 6, generator=g)
        gw = torch.randn(4, 6, generator=g)
        for m, p, o, xx in (
            (conv, t_param, oa, x.to(memory_format=torch.channels_last)),
            (twin, c_param, ob, x),
        ):
            o.zero_grad()
            m(xx).square().sum().backward()
            p.grad = gw.clone()
            o.step()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert t_param.stride() == (1, 4)
    assert torch.equal(conv.weight, twin.weight) and torch.equal(conv.bias, twin.bias)
    assert torch.equal(t_param, c_param)


# -- SOAP in the factors' null space ------------------------------------------------------
def _one_soap_step(g: torch.Tensor, dtype: torch.dtype, **kw: Any) -> torch.Tensor:
    p = torch.zeros_like(g, dtype=dtype, requires_grad=True)
    opt = Shampoo([p], lr=1.0, preconditioner="eigenvalue_corrected", **kw)
    p.grad = g.to(dtype)
    opt.step()
    return p.detach().double()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shape", [(4,), (3, 4)])
def test_soap_step_in_the_null_space_matches_float64(seed: int, shape: tuple[int, ...]) -> None:
    # One step from a fresh state on a rank-one gradient: every factor has rank one, so
    # in exact arithmetic the step is -lr·G/‖G‖ (the rotated gradient has one nonzero
    # coordinate, divided by its own magnitude).  With epsilon 1e-12 the other
    # coordinates were rounding noise over rounding noise: float32 moved up to
    # thousands of times further than float64.
    gen = torch.Generator().manual_seed(seed)
    vecs = [torch.randn(d, generator=gen, dtype=torch.float64) for d in shape]
    g = vecs[0] if len(vecs) == 1 else torch.outer(vecs[0], vecs[1])
    exact = -g / g.norm()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        got = _one_soap_step(g, dtype)
        torch.testing.assert_close(got, exact, rtol=0, atol=tol)


def test_soap_null_space_cutoff_follows_rank_rtol() -> None:
    # rank_rtol=0 keeps every coordinate with E > 0: the rounding noise is back.
    g = torch.tensor([1.0, 2.0, -0.5, 0.25], dtype=torch.float64)
    exact = -g / g.norm()
    kept = _one_soap_step(g, torch.float32, root_inv_config=EigenConfig(rank_rtol=0.0))
    cut = _one_soap_step(g, torch.float32)
    torch.testing.assert_close(cut, exact, rtol=0, atol=1e-5)
    assert (kept - exact).abs().max() > 1e-2


def test_soap_null_space_cutoff_is_rank_rtol_squared_times_the_blocks_sum_of_e() -> None:
    # The documented rule (EigenConfig, the guide): E ≤ rank_rtol² · ΣE is the null
    # space.  E = 0.05 is kept (above 0.1² · 1.56) although it is below 0.1 · max E
    # (the guide's former wording); E = 0.01 is cut.  Identity basis, M = 1: each kept
    # coordinate is 1/sqrt(E).
    from secondorder.shampoo.preconditioner import EigenvalueCorrectedPreconditioner

    pre = EigenvalueCorrectedPreconditioner(
        shape=(4,), beta2=0.999, epsilon=0.0, use_bias_correction=False,
        root_inv_config=EigenConfig(rank_rtol=0.1),
    )  # fmt: skip
    state = pre.init_state(1, torch.float64, torch.device("cpu"))
    E = torch.tensor([[1.0, 0.5, 0.05, 0.01]], dtype=torch.float64)
    state["corrected_eigenvalues"] = E
    assert 0.1**2 * E.sum() < 0.05 < 0.1 * E.max() and 0.1**2 * E.sum() > 0.01
    got = pre.precondition(state, torch.ones(1, 4, dtype=torch.float64), step=1)
    want = torch.tensor([[1.0, 0.5**-0.5, 0.05**-0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
