"""The batch helpers fit and the Lightning integration share."""

from __future__ import annotations

import pytest
import torch

from secondorder.training.data import batches, is_single_batch, split_batch


def test_split_batch_shapes():
    x, y = torch.zeros(4, 2), torch.ones(4)
    assert split_batch(x, "batch") == (x, None)
    assert split_batch((x,), "batch") == (x, None)
    assert split_batch([x, y], "batch") == (x, y)
    with pytest.raises(
        TypeError, match=r"batch must be \(inputs, targets\) .* got dict of length 0"
    ):
        split_batch({}, "batch")


def test_single_batch_and_epochs():
    x, y = torch.zeros(4, 2), torch.ones(4)
    assert is_single_batch((x, y)) and is_single_batch((x, None))
    assert not is_single_batch([(x, y)]) and not is_single_batch((x, y, y))
    each = batches((x, y), "data")
    assert [list(each()) for _ in range(2)] == [[(x, y)], [(x, y)]]
    listed = batches([(x, y), [x, None]], "data")
    assert list(listed()) == [(x, y), (x, None)] == list(listed())
    once = batches(iter([(x, y)]), "data")
    assert list(once()) == [(x, y)]
    with pytest.raises(ValueError, match="data is a one-shot iterator and was used up"):
        once()
