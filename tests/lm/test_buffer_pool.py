"""BufferPool (secondorder.lm.memory): reuse only storage that nobody else references."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import secondorder as so
from secondorder.lm.choices import PLAN_RECHECK_STEPS
from secondorder.lm.memory import BufferPool, _storage_users

pytestmark = pytest.mark.skipif(
    _storage_users(torch.empty(1)) is None, reason="this torch cannot count storage users"
)


def test_a_released_buffer_is_reused_and_a_held_one_is_not() -> None:
    pool = BufferPool()
    a = pool.take((4, 3), torch.float32, "cpu")
    ptr = a.data_ptr()
    del a
    b = pool.take((4, 3), torch.float32, "cpu")
    assert b.data_ptr() == ptr and pool.reused == 1
    # b is still held: a second take must not hand out the same memory.
    c = pool.take((4, 3), torch.float32, "cpu")
    assert c.data_ptr() != b.data_ptr() and pool.reused == 1


@pytest.mark.parametrize("alias", ["view", "detach", "transpose", "slice"])
def test_an_alias_that_outlives_the_buffer_blocks_reuse(alias: str) -> None:
    pool = BufferPool()
    a = pool.take((6, 5), torch.float64, "cpu")
    a.fill_(1.0)
    kept = {
        "view": lambda t: t.view(30),
        "detach": lambda t: t.detach(),
        "transpose": lambda t: t.T,
        "slice": lambda t: t[2:],
    }[alias](a)
    del a
    b = pool.take((6, 5), torch.float64, "cpu")
    b.fill_(2.0)
    assert bool((kept == 1.0).all()), "a kept alias (e.g. a record's J) was overwritten"
    del kept, b
    pool.take((6, 5), torch.float64, "cpu")
    assert pool.reused == 1


def test_keys_and_clear() -> None:
    pool = BufferPool()
    a = pool.take((2, 2), torch.float32, "cpu")
    b = pool.take((2, 2), torch.float64, "cpu")  # another dtype: another buffer
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    del a, b
    pool.take((3, 2), torch.float32, "cpu")  # another shape replaces the others
    again = pool.take((2, 2), torch.float32, "cpu")
    assert pool.reused == 0 and again.shape == (2, 2)
    del again
    pool.clear()
    fresh = pool.take((2, 2), torch.float32, "cpu")
    assert pool.reused == 0 and fresh.shape == (2, 2)


def test_free_bytes_counts_only_buffers_nobody_else_holds() -> None:
    pool = BufferPool()
    a = pool.take((10, 4), torch.float64, "cpu")
    assert pool.free_bytes("cpu") == 0  # a is still in use
    del a
    assert pool.free_bytes("cpu") == 10 * 4 * 8
    assert pool.free_bytes("meta") == 0  # another device
    b = pool.take((3, 4), torch.float32, "cpu")  # another shape replaces it
    del b
    assert pool.free_bytes("cpu") == 3 * 4 * 4


def _sinc_fit(clear: bool) -> tuple[list[Tensor], int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.linspace(-1, 1, 300).unsqueeze(1)
    y = torch.sinc(5 * x)
    opt = so.LevenbergMarquardt(model, jacobian="reverse")
    pool = opt._function.program.rows_pool
    for _ in range(8):
        opt.step(x, y)
        if clear:
            pool.clear()
    return [p.detach().clone() for p in model.parameters()], pool.reused


def test_the_optimizer_reuses_j_rows_and_its_steps_are_bitwise_those_of_fresh_buffers() -> None:
    """The pooled rows change no step: the reference allocates J afresh every step."""
    pooled, reused = _sinc_fit(clear=False)
    fresh, none = _sinc_fit(clear=True)
    assert reused >= 7 and none == 0
    for a, b in zip(pooled, fresh, strict=True):
        assert torch.equal(a, b)


def test_the_plan_counts_the_pooled_rows_as_free() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.linspace(-1, 1, 300).unsqueeze(1)
    opt = so.LevenbergMarquardt(model, jacobian="reverse")
    # The free memory is read on the first step, then again every PLAN_RECHECK_STEPS.
    for _ in range(PLAN_RECHECK_STEPS + 1):
        opt.step(x, torch.sinc(5 * x))
    pooled = opt._function.program.rows_pool.free_bytes("cpu")
    # J's rows and one more column, for r (the Gram of [J r] carries Jᵀr).
    assert pooled == 300 * (sum(p.numel() for p in model.parameters()) + 1) * 4
    plan = opt.plan(x, torch.sinc(5 * x))
    assert plan.available_bytes is not None and plan.available_bytes >= pooled
    assert "J's pooled rows" in plan.available_source


def test_a_memory_limit_without_room_for_the_kept_rows_turns_the_pool_off() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.linspace(-1, 1, 100).unsqueeze(1)
    y = torch.sinc(5 * x)
    kw = {"jacobian": "reverse", "solver": "cholesky", "form": "primal"}
    roomy = so.LevenbergMarquardt(model, **kw).plan(x, y)
    assert roomy.pooled_rows and roomy.stage("pooled rows") == 100 * 193 * 4
    bare_peak = max(roomy.linearize_bytes, roomy.solve_bytes - roomy.stage("pooled rows"))
    assert bare_peak < roomy.peak_bytes
    opt = so.LevenbergMarquardt(model, memory_limit=bare_peak, **kw)
    pool = opt._function.program.rows_pool
    for _ in range(3):
        opt.step(x, y)
        assert opt.memory_plan is not None and not opt.memory_plan.pooled_rows
        assert opt.memory_plan.slice_size == 100
        assert pool.free_bytes("cpu") == 0 and pool.reused == 0


def test_wide_layers_in_slices_still_reuse_the_rows() -> None:
    """A wide layer's products come from its factors, and those hold J's rows only
    weakly in the primal form: each slice of each step reuses the pooled buffer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(4096, 32)
    y = torch.randn(4096, 1)
    opt = so.LevenbergMarquardt(model, jacobian="reverse", form="primal", solver="cholesky")
    pool = opt._function.program.rows_pool
    for _ in range(3):
        opt.step(x, y, slice_size=1024)
    # 12 slices: every take after the first reuses the buffer.
    assert 1024 * 1089 >= 1 << 20 and pool.reused == 11
