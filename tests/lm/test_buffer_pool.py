"""BufferPool (secondorder.lm.memory): reuse only storage that nobody else references."""

from __future__ import annotations

import pytest
import torch

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
