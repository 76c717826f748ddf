"""Property-based tests (hypothesis) of the inputs ``least_squares`` and
``LevenbergMarquardt`` accept.

Every drawn input either works, checked against a reference (``torch.linalg.lstsq``
on the problem's exact Jacobian, and a run on clean contiguous copies of the same
data), or raises a ``ValueError``/``TypeError`` whose message names the argument,
with nothing changed.  Inputs that currently fail that contract are pinned by the
strict ``xfail`` tests at the end, one per bug, and are left out of the strategies
so that the properties keep testing everything else.

The examples are derandomised and no example database is written, so a run is
reproducible and leaves no files behind.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.checkpoint import entries

F64 = torch.float64
DTYPES = (torch.float32, F64)


def profile(examples: int) -> Any:
    """Few, derandomised examples per category (the categories are pytest parameters)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- least_squares --------------------------------------------------------------------------

X0_KINDS = ("tensor64", "tensor32", "strided", "expanded", "requires_grad", "numpy", "list")
# A 0-d x0 is accepted, as scipy accepts it (tests/fitting test it).
X0_BAD = ("matrix", "empty", "nan", "inf")
OUT_KINDS = ("flat", "column", "transposed", "float32", "numpy-list")


def _make_x0(kind: str, n: int, values: Tensor) -> Any:
    """``values`` (float64, length n) in the layout ``kind``."""
    if kind == "tensor64":
        return values.clone()
    if kind == "tensor32":
        return values.float()
    if kind == "strided":
        big = torch.zeros(2 * n, dtype=F64)
        big[::2] = values
        x0 = big[::2]
        assert not x0.is_contiguous() or n == 1
        return x0
    if kind == "expanded":
        return values[:1].expand(n)
    if kind == "requires_grad":
        return values.clone().requires_grad_(True)
    if kind == "numpy":
        return values.numpy().copy()
    if kind == "list":
        return [float(v) for v in values]
    if kind == "matrix":
        return values.reshape(n, 1)
    if kind == "scalar":
        return values[0].clone()
    if kind == "empty":
        return values[:0].clone()
    if kind == "nan":
        out = values.clone()
        out[-1] = math.nan
        return out
    if kind == "inf":
        out = values.clone()
        out[0] = -math.inf
        return out
    raise AssertionError(kind)


def _x0_effective(kind: str, x0: Any) -> Tensor:
    return torch.as_tensor(np.asarray(x0.detach() if isinstance(x0, Tensor) else x0, dtype=float))


@st.composite
def ls_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "m": draw(st.integers(1, 9)),
        "n": draw(st.integers(1, 5)),
        "seed": draw(st.integers(0, 2**16)),
        "a_dtype": draw(st.sampled_from(DTYPES)),
        "out": draw(st.sampled_from(OUT_KINDS)),
        "solver": draw(st.sampled_from(("qr", "cholesky", "eigh", "cg"))),
    }


@pytest.mark.parametrize("x0_kind", X0_KINDS + X0_BAD)
@profile(6)
@given(case=ls_cases())
def test_least_squares_linear_problems_match_lstsq_or_name_x0(x0_kind, case):
    case = {**case, "x0": x0_kind}
    m, n, g = case["m"], case["n"], _rng(case["seed"])
    event(f"out={case['out']}")
    A = torch.randn(m, n, generator=g, dtype=F64).to(case["a_dtype"])
    b = torch.randn(m, generator=g, dtype=F64).to(case["a_dtype"])
    A64, b64 = A.double(), b.double()
    out = case["out"]

    def fun(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            r_np = A64.numpy() @ x - b64.numpy()
            return [float(v) for v in r_np] if out == "numpy-list" else r_np
        r = A.to(x.dtype) @ x - b.to(x.dtype)
        if out == "column":
            return r.reshape(-1, 1)
        if out == "transposed":
            return r.reshape(1, -1).expand(2, m).T  # non-contiguous, every residual twice
        if out == "float32":
            return r.float()
        return r

    x0 = _make_x0(case["x0"], n, 0.1 * torch.randn(n, generator=g, dtype=F64))
    snapshot = copy.deepcopy(x0)
    if case["x0"] in X0_BAD:
        with pytest.raises(ValueError, match=r"^x0 must be"):
            so.least_squares(fun, x0, solver=case["solver"])
        return
    res = so.least_squares(fun, x0, solver=case["solver"])

    # x0 is never modified, and the result has x0's kind, in float64.
    if isinstance(x0, Tensor):
        assert torch.equal(x0, snapshot) and isinstance(res.x, Tensor)
        assert res.x.dtype == F64 and res.x.shape == (n,) and not res.x.requires_grad
    else:
        assert np.array_equal(np.asarray(x0), np.asarray(snapshot))
        assert isinstance(res.x, np.ndarray) and res.x.dtype == np.float64
    x = torch.as_tensor(res.x)
    repeat = 2 if (out == "transposed" and isinstance(x0, Tensor)) else 1
    ref = torch.linalg.lstsq(A64, b64.unsqueeze(-1)).solution[:, 0]
    ref_cost = 0.5 * repeat * float(((A64 @ ref - b64) ** 2).sum())
    cost0 = 0.5 * repeat * float(((A64 @ _x0_effective(case["x0"], x0) - b64) ** 2).sum())
    # res.cost is the cost at res.x, and no worse than the least-squares optimum.
    assert res.cost == pytest.approx(0.5 * repeat * float(((A64 @ x - b64) ** 2).sum()), rel=1e-5)
    rounding = 1e-6 if out == "float32" else 1e-10
    assert res.cost <= ref_cost * (1 + rounding) + rounding * cost0 + 1e-30
    if out != "float32" and m >= n and float(torch.linalg.cond(A64)) < 1e3:
        if res.status == 2:
            # Stopped by ftol (relative cost reduction < 1e-8, scipy's default): the cost
            # is that close to optimal, so ½σ_min²‖x - x*‖² ≤ 1e-8·cost* bounds the error.
            sigma_min = float(torch.linalg.svdvals(A64)[-1])
            bound = math.sqrt(2 * 1e-8 * ref_cost) / sigma_min
            assert float((x - ref).norm()) <= bound + 1e-8
        else:
            torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-8)


# Options of least_squares with the values a user might pass by mistake.
GARBAGE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.floats(-1, 1), max_size=2),
)
LS_OPTIONS = ("ftol", "xtol", "gtol", "f_scale", "max_nfev", "damping", "loss", "jac", "solver")
LS_OPTIONS += ("damping_rule", "damping_matrix")


@pytest.mark.parametrize("name", LS_OPTIONS)
@profile(8)
@given(value=GARBAGE)
def test_least_squares_options_work_or_name_the_option(name, value):
    A = torch.tensor([[1.0, 0.5], [0.0, 2.0], [1.0, 1.0]], dtype=F64)
    b = torch.tensor([1.0, -1.0, 0.5], dtype=F64)
    try:
        res = so.least_squares(lambda x: A @ x - b, torch.zeros(2, dtype=F64), **{name: value})
    except (ValueError, TypeError) as exc:
        event("refused")
        assert name in str(exc), f"{name}={value!r}: {exc}"
        return
    event("accepted")
    # Accepted: it must be a documented value, and the fit must be right.
    ref = torch.linalg.lstsq(A, b.unsqueeze(-1)).solution[:, 0]
    if name in ("ftol", "xtol", "gtol") and value is None:
        pass  # None disables that test, as in scipy; the fit below must still be right
    elif name in ("ftol", "xtol", "gtol", "damping"):
        assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
        if value > (1e3 if name == "damping" else 1e-6):
            return  # loose tolerances stop early and a huge λ crawls, by design
    if name == "f_scale":
        assert isinstance(value, (int, float)) and value > 0
    if name == "max_nfev":
        assert value is None or (isinstance(value, int) and value >= 1)
        if value is not None and value < 20:
            return  # a small budget may stop early, by design
    if name == "loss" and value != "linear":
        return
    torch.testing.assert_close(torch.as_tensor(res.x), ref, rtol=1e-5, atol=1e-6)


# -- LevenbergMarquardt ---------------------------------------------------------------------


class Affine(nn.Module):
    """``x ↦ W x + c`` with optional structure: frozen parts, a buffer, a tied branch."""

    def __init__(self, d_in: int, d_out: int, bias: bool, structure: str) -> None:
        super().__init__()
        self.main = nn.Linear(d_in, d_out, bias=bias)
        self.structure = structure
        if structure == "buffer":
            self.register_buffer("offset", torch.linspace(-1, 1, d_out))
        if structure == "tied":
            self.branch = nn.Linear(d_in, d_out, bias=False)
            self.branch.weight = self.main.weight  # one Parameter in two modules
        if structure == "frozen-weight":
            self.main.weight.requires_grad_(False)
        if structure == "frozen-bias" and bias:
            self.main.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.main(x)
        if self.structure == "buffer":
            out = out * 2.0 + self.offset
        if self.structure == "tied":
            out = out + 0.5 * self.branch(x)
        return out


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def exact_jacobian(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """J and r(0) of r(θ) = model_θ(x) - y for a model linear in θ, in float64.

    Built from unit vectors, without autograd: r(eᵢ) - r(0) is column i.
    """
    ref = copy.deepcopy(model).double()
    xs, ys = x.detach().double(), y.detach().double()
    params = _trainable(ref)

    def r(theta: Tensor) -> Tensor:
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(theta[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            out = ref(xs)
        return (out - ys.reshape(out.shape)).reshape(-1)

    n = sum(p.numel() for p in params)
    r0 = r(torch.zeros(n, dtype=F64))
    eye = torch.eye(n, dtype=F64)
    J = torch.stack([r(eye[i]) - r0 for i in range(n)], dim=1)
    return J, r0


INPUT_LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "requires_grad")
TARGET_LAYOUTS = ("matching", "flat", "strided", "requires_grad", "other-dtype")
STRUCTURES = ("plain", "frozen-weight", "frozen-bias", "buffer", "tied")
LM_BAD = ("dtype-mismatch", "batch-mismatch", "empty", "scalar-inputs", "scalar-targets")
LM_BAD += ("inputs-on-meta",)


def _layout_inputs(kind: str, x: Tensor) -> Tensor:
    if kind == "transposed":
        return x.T.contiguous().T
    if kind == "strided":
        big = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
        big[:, ::2] = x
        return big[:, ::2]
    if kind == "expanded":
        return x[:1].expand_as(x)  # every sample the same: J is rank-deficient
    if kind == "requires_grad":
        return x.clone().requires_grad_(True)
    return x


def _layout_targets(kind: str, y: Tensor) -> Tensor:
    if kind == "flat" and y.shape[1] == 1:
        return y[:, 0].clone()
    if kind == "strided":
        big = torch.zeros(y.shape[0], 2 * y.shape[1], dtype=y.dtype)
        big[:, ::2] = y
        return big[:, ::2]
    if kind == "requires_grad":
        return y.clone().requires_grad_(True)
    if kind == "other-dtype":  # mse casts targets to the outputs' dtype
        return y.to(torch.float32 if y.dtype == F64 else F64)
    return y


@st.composite
def lm_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "d_in": draw(st.integers(1, 4)),
        "d_out": draw(st.integers(1, 3)),
        "batch": draw(st.integers(1, 12)),
        "bias": draw(st.booleans()),
        "dtype": draw(st.sampled_from(DTYPES)),
        "inputs": draw(st.sampled_from(INPUT_LAYOUTS)),
        "targets": draw(st.sampled_from(TARGET_LAYOUTS)),
        "solver": draw(st.sampled_from(("auto", "cholesky", "eigh", "qr", "cg"))),
        "slice_size": draw(st.one_of(st.none(), st.integers(1, 5))),
        "seed": draw(st.integers(0, 2**16)),
    }


def _affine_setup(structure: str, case: dict[str, Any]) -> tuple[nn.Module, Tensor, Tensor]:
    g = _rng(case["seed"])
    dtype = case["dtype"]
    torch.manual_seed(case["seed"])
    model = Affine(case["d_in"], case["d_out"], case["bias"], structure).to(dtype)
    x = torch.randn(case["batch"], case["d_in"], generator=g, dtype=F64).to(dtype)
    y = torch.randn(case["batch"], case["d_out"], generator=g, dtype=F64).to(dtype)
    return model, x, y


def _options(case: dict[str, Any]) -> dict[str, Any]:
    options = {"solver": case["solver"], "slice_size": case["slice_size"]}
    if case["solver"] == "cg":
        options["cg_rtol"] = 1e-12
    return options


def _fit(opt: Any, x: Any, y: Any) -> tuple[Any, float]:
    first, info = None, None
    for _ in range(25):
        info = opt.step(x, y)
        first = info.loss_before if first is None else first
        assert info.loss <= info.loss_before
        if info.terminated:
            break
    assert info is not None and first is not None
    return info, first


@pytest.mark.parametrize("structure", STRUCTURES)
@profile(8)
@given(case=lm_cases())
def test_lm_on_affine_models_matches_lstsq(structure, case):
    event(f"inputs={case['inputs']}")
    event(f"targets={case['targets']}")
    dtype = case["dtype"]
    model, x, y = _affine_setup(structure, case)
    if not _trainable(model):  # frozen weight and no bias
        with pytest.raises(ValueError, match="has no trainable parameters"):
            so.LevenbergMarquardt(model)
        return
    start = copy.deepcopy(model)
    shared = model.main.weight
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    frozen = {k: p.detach().clone() for k, p in model.named_parameters() if not p.requires_grad}
    opt = so.LevenbergMarquardt(model, **_options(case))
    xs, ys = _layout_inputs(case["inputs"], x), _layout_targets(case["targets"], y)
    xs_before, ys_before = xs.detach().clone(), ys.detach().clone()
    info, first = _fit(opt, xs, ys)

    # Reference: the least-squares optimum of the exact (unit-vector) Jacobian.
    J, r0 = exact_jacobian(start, xs, ys)
    theta = torch.linalg.lstsq(J, -r0.unsqueeze(-1), driver="gelsd").solution[:, 0]
    ref_loss = float(((J @ theta + r0) ** 2).mean())
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert info.loss <= ref_loss * (1 + tol) + tol * first + 1e-30
    with torch.no_grad():
        direct = float(((model(xs.detach()) - ys.detach().reshape(-1, case["d_out"])) ** 2).mean())
    assert info.loss == pytest.approx(direct, rel=10 * tol, abs=tol * first)

    # Nothing else moved: data, buffers, frozen parameters, ties, autograd state.
    assert torch.equal(xs.detach(), xs_before) and torch.equal(ys.detach(), ys_before)
    assert xs.grad is None and ys.grad is None
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k])
    for k, p in model.named_parameters():
        if k in frozen:
            assert torch.equal(p, frozen[k])
    assert model.main.weight is shared
    if structure == "tied":
        assert model.branch.weight is model.main.weight

    # The same run on clean contiguous copies lands on the same parameters.
    clean = copy.deepcopy(start)
    xc, yc = xs.detach().contiguous().clone(), ys.detach().contiguous().clone()
    _fit(so.LevenbergMarquardt(clean, **_options(case)), xc, yc)
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    for p, q in zip(model.parameters(), clean.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=rtol)


def _bad_batch(bad: str, x: Tensor, y: Tensor) -> tuple[Any, Any, type[Exception], str]:
    other = torch.float32 if x.dtype == F64 else F64
    if bad == "dtype-mismatch":
        return x.to(other), y, TypeError, r"inputs dtype torch\.float\d\d does not match"
    if bad == "batch-mismatch":
        y2 = torch.cat([y, y[:1]])
        return x, y2, ValueError, r"inputs and targets batch sizes differ"
    if bad == "empty":
        return x[:0], y[:0], ValueError, r"inputs is an empty batch"
    if bad == "scalar-inputs":
        return x[0, 0], y, ValueError, r"inputs must have a batch dimension"
    if bad == "scalar-targets":
        return x, y[0, 0], ValueError, r"targets must have a batch dimension"
    if bad == "inputs-on-meta":
        return x.to("meta"), y, ValueError, r"inputs are on meta"
    raise AssertionError(bad)


@pytest.mark.parametrize("bad", LM_BAD)
@profile(4)
@given(case=lm_cases(), structure=st.sampled_from(("plain", "buffer", "tied", "frozen-bias")))
def test_lm_bad_batches_name_the_argument_and_change_nothing(bad, case, structure):
    model, x, y = _affine_setup(structure, case)
    start = copy.deepcopy(model)
    opt = so.LevenbergMarquardt(model, **_options(case))
    xb, yb, exc, pattern = _bad_batch(bad, x, y)
    state = opt.state_dict()
    with pytest.raises(exc, match=pattern):
        opt.step(xb, yb)
    assert opt.state_dict() == state
    for p, q in zip(model.parameters(), start.parameters(), strict=True):
        assert torch.equal(p, q)
    # The optimizer is still usable with a good batch.
    info = opt.step(x, y)
    assert math.isfinite(info.loss_before) and info.loss <= info.loss_before


LM_OPTIONS = ("lr", "damping", "max_attempts", "slice_size", "damping_up", "damping_down")
LM_OPTIONS += ("damping_min", "damping_max", "geodesic", "geodesic_alpha", "ftol", "xtol")
LM_OPTIONS += ("gtol", "memory_budget", "cg_rtol", "cg_max_iter", "gram_dtype", "jacobian")
LM_OPTIONS += ("solver", "form", "damping_rule", "damping_matrix")


@pytest.mark.parametrize("name", LM_OPTIONS)
@profile(8)
@given(value=GARBAGE)
def test_lm_options_work_or_name_the_option(name, value):
    torch.manual_seed(0)
    model = nn.Linear(2, 1).double()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt = so.LevenbergMarquardt(model, **{name: value})
    except (ValueError, TypeError) as exc:
        event("refused")
        assert re.search(rf"\b{name}\b", str(exc)), f"{name}={value!r}: {exc}"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        return
    event("accepted")
    assert getattr(opt.config, name) == value or (value is None and name == "gram_dtype")
    x = torch.linspace(-1, 1, 8, dtype=F64).reshape(-1, 1).expand(8, 2).contiguous()
    x[:, 1] = x[:, 1] ** 2
    y = 3 * x[:, :1] - x[:, 1:] + 0.5
    info = opt.step(x, y)
    assert math.isfinite(info.loss) and info.loss <= info.loss_before


# -- the inputs that break the contract today: one strict xfail per bug ---------------------


def _linear_lm(dtype: torch.dtype = F64) -> tuple[Any, nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(dtype)
    g = _rng(0)
    x = torch.randn(10, 3, generator=g, dtype=F64).to(dtype)
    y = torch.randn(10, 1, generator=g, dtype=F64).to(dtype)
    return so.LevenbergMarquardt, model, x, y


def _params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model: nn.Module, before: list[Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(
    ("model_dtype", "residual_dtype"), [(F64, torch.float32), (torch.float32, F64)]
)
def test_residual_dtype_other_than_the_models(model_dtype, residual_dtype):
    """Refused before anything changes, naming residual_fn and both dtypes; the same
    residual cast back to the model's dtype trains like mse."""
    cls, model, x, y = _linear_lm(model_dtype)
    before = _params(model)
    opt = cls(model, lambda o, t: (o - t).to(residual_dtype))
    pattern = rf"residual_fn returned residuals of dtype {residual_dtype}.*{model_dtype}"
    with pytest.raises(TypeError, match=pattern):
        opt.step(x, y)
    assert _unchanged(model, before) and entries(opt.state_dict())["steps"] == 0
    ref = copy.deepcopy(model)
    info = cls(model, lambda o, t: (o.to(residual_dtype) - t).to(model_dtype)).step(x, y)
    ref_info = cls(ref).step(x, y)
    assert info.accepted and ref_info.accepted
    tol = 1e-5 if torch.float32 in (model_dtype, residual_dtype) else 1e-12
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)


@pytest.mark.parametrize("targets", ["missing", "wrong-width", "wrong-batch-layout"])
def test_mse_with_missing_or_misshapen_targets_names_targets(targets):
    cls, model, x, y = _linear_lm()
    bad = {
        "missing": None,
        "wrong-width": torch.cat([y, y], 1),
        "wrong-batch-layout": y.reshape(1, -1).expand(10, 10),
    }[targets]
    before = _params(model)
    pattern = {
        "missing": r"mse: targets is None",
        # The probe evaluates the first two samples: (2, 2) targets for (2, 1) outputs.
        "wrong-width": r"mse: targets of shape \(2, 2\) do not match the model outputs of "
        r"shape \(2, 1\): each sample needs 1 target value\(s\), got 2",
        "wrong-batch-layout": r"mse: targets of shape \(2, 10\) do not match .*\(2, 1\)",
    }[targets]
    exc_type = TypeError if targets == "missing" else ValueError
    with pytest.raises(exc_type, match=pattern):
        cls(model).step(x, bad)
    assert _unchanged(model, before)


def test_mse_accepts_targets_with_the_outputs_values_in_another_layout():
    """``(batch,)`` targets for ``(batch, 1)`` outputs hold the same values: the step is
    bitwise the one with ``(batch, 1)`` targets."""
    cls, model, x, y = _linear_lm()
    ref = copy.deepcopy(model)
    cls(model).step(x, y[:, 0])
    cls(ref).step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


ADAPTERS = {
    "l1": so.residuals.l1,
    "huber": so.residuals.huber,
    "binary_cross_entropy": so.residuals.binary_cross_entropy,
}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_elementwise_adapters_check_their_targets(name):
    fn = ADAPTERS[name]
    out = torch.zeros(4, 3, dtype=F64)
    with pytest.raises(TypeError, match=rf"{name}: targets is None"):
        fn(out, None)
    with pytest.raises(TypeError, match=rf"{name}: targets must be a tensor, got list"):
        fn(out, [[0.0] * 3] * 4)
    with pytest.raises(ValueError, match=rf"{name}: targets of shape \(4, 2\) do not match"):
        fn(out, torch.zeros(4, 2, dtype=F64))
    with pytest.raises(ValueError, match=rf"{name}: targets of shape \(3, 4\) do not match"):
        fn(out, torch.zeros(3, 4, dtype=F64))
    # As many values per sample in another layout (channels last for first): refused.
    with pytest.raises(ValueError, match=rf"{name}: targets of shape \(4, 2, 3\) .* another"):
        fn(torch.zeros(4, 3, 2, dtype=F64), torch.zeros(4, 2, 3, dtype=F64))
    # The same shape up to size-1 dimensions, and another dtype: accepted, cast.
    t = torch.rand(4, 3, dtype=F64)
    torch.testing.assert_close(fn(out, t.reshape(4, 3, 1).float()), fn(out, t.float().double()))


def test_targets_in_another_layout_are_refused_before_the_step_changes_anything():
    net = nn.Conv2d(3, 3, 1).double()
    x = torch.randn(6, 3, 4, 4, generator=_rng(1), dtype=F64)
    y = torch.randn(6, 4, 4, 3, generator=_rng(2), dtype=F64)  # channels last by mistake
    opt = so.LevenbergMarquardt(net, nn.MSELoss())
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"mse: targets of shape \(\d+, 4, 4, 3\) .* layout"):
        opt.step(x, y)
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
    assert opt.step(x, y.permute(0, 3, 1, 2)).accepted


def test_cross_entropy_checks_its_targets():
    ce = so.residuals.cross_entropy
    logits = torch.randn(4, 3, generator=_rng(0), dtype=F64)
    with pytest.raises(TypeError, match=r"cross_entropy: targets must be a tensor .* NoneType"):
        ce(logits, None)
    with pytest.raises(ValueError, match=r"class-index targets of shape \(4, 1\) must have "):
        ce(logits, torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"probability targets of shape \(4, 2\) must have"):
        ce(logits, torch.zeros(4, 2, dtype=F64))
    with pytest.raises(TypeError, match=r"got dtype torch\.bool"):
        ce(logits, torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"logits must have shape \(batch, classes, ...\)"):
        ce(logits[:, 0], torch.zeros(4, dtype=torch.int64))
    labels = torch.tensor([0, 2, 1, 2])
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(ce(logits, labels.int()) ** 2, expected + 1e-12)
    probs = torch.nn.functional.one_hot(labels, 3).float()
    torch.testing.assert_close(ce(logits, probs) ** 2, expected + 1e-12)


def test_targets_on_another_device_are_refused_naming_targets():
    cls, model, x, y = _linear_lm()
    before = _params(model)
    with pytest.raises(ValueError, match="targets are on meta but the model is on cpu"):
        cls(model).step(x, y.to("meta"))
    with pytest.raises(ValueError, match="targets are on meta but the model is on cpu"):
        cls(model, so.residuals.ModelResidual(lambda f, i, t: f(i) - t["y"])).step(
            x, {"y": y.to("meta")}
        )
    assert _unchanged(model, before)


def test_min_gain_ratio_of_the_wrong_type_names_the_option():
    with pytest.raises(TypeError, match="min_gain_ratio"):
        so.LevenbergMarquardt(nn.Linear(2, 1), min_gain_ratio="0.1")


@pytest.mark.parametrize("kind", ["transposed", "short", "none"])
def test_least_squares_callable_jac_of_the_wrong_shape_is_refused(kind):
    g = _rng(0)
    A = torch.randn(8, 3, generator=g, dtype=F64)
    b = torch.randn(8, generator=g, dtype=F64)
    bad = {"transposed": A.T.contiguous(), "short": A[:7], "none": None}[kind]
    with pytest.raises(ValueError, match="jac"):
        so.least_squares(lambda x: A @ x - b, torch.zeros(3, dtype=F64), jac=lambda x: bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex128])
def test_least_squares_refuses_non_real_residuals(dtype):
    A = torch.tensor([[2.0, 1.0], [1.0, 3.0], [0.0, 1.0]], dtype=F64)
    b = torch.tensor([5.0, -3.0, 7.0], dtype=F64)
    with pytest.raises(TypeError, match="fun"):
        so.least_squares(lambda x: ((A @ x - b) * 10).to(dtype), torch.zeros(2, dtype=F64))


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_least_squares_refuses_complex_x0(kind):
    x0 = torch.tensor([1 + 1j, 2.0]) if kind == "tensor" else np.array([1 + 1j, 2.0])

    def fun(x: Any) -> Any:
        return x - 1

    with pytest.raises(ValueError, match="x0"):
        so.least_squares(fun, x0)


def test_least_squares_with_a_fun_closing_over_a_tensor_that_requires_grad():
    g = _rng(0)
    W = torch.randn(8, 3, generator=g, dtype=F64).requires_grad_(True)
    b = torch.randn(8, generator=g, dtype=F64)
    res = so.least_squares(lambda x: W @ x - b, torch.zeros(3, dtype=F64))
    ref = torch.linalg.lstsq(W.detach(), b.unsqueeze(-1)).solution[:, 0]
    torch.testing.assert_close(res.x, ref, rtol=1e-7, atol=1e-9)
    assert W.grad is None


@pytest.mark.parametrize(
    ("name", "value"), [("args", 5), ("bounds", ("a", "b")), ("geodesic", "no")]
)
def test_least_squares_argument_types_are_checked(name, value):
    with pytest.raises((TypeError, ValueError), match=name):
        so.least_squares(lambda x: x - 1, torch.zeros(2, dtype=F64), **{name: value})


def test_least_squares_x0_on_another_device_names_x0():
    with pytest.raises(ValueError, match="x0"):
        so.least_squares(lambda x: x - 1, torch.zeros(2, dtype=F64, device="meta"))
