"""One local device: ``DeviceGroup.stage`` and ``gather`` against the pipelined path.

A group of one non-CUDA device that is also the solver device hands each slice out
at once and gathers nothing already on the solver device.  The reference is the
same group with the shortcut turned off (the deque pipeline and ``Tensor.to``):
the same tensors, in the same order, for trees of every shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from secondorder.distributed.devices import DeviceGroup

CPU = torch.device("cpu")


def _slices() -> list[tuple[Any, Any]]:
    a = torch.arange(12.0).reshape(6, 2)
    return [
        (a, torch.arange(6)),
        ({"x": a[:3], "flag": 2}, (a[3:], None)),
        ([a[:2], "text"], None),
        (a.double(), a.int()),
    ]


def test_a_local_group_is_recognised() -> None:
    assert DeviceGroup([CPU], CPU)._local
    assert not DeviceGroup([CPU, CPU], CPU)._local


def test_local_stage_equals_the_pipelined_path() -> None:
    fast = DeviceGroup([CPU], CPU)
    slow = DeviceGroup([CPU], CPU)
    slow._local = False
    slices = _slices()
    got, want = list(fast.stage(slices)), list(slow.stage(slices))
    assert len(got) == len(want) == 4
    for (k1, i1, t1), (k2, i2, t2) in zip(got, want, strict=True):
        assert k1 == k2 == 0
        l1, s1 = tree_flatten((i1, t1))
        l2, s2 = tree_flatten((i2, t2))
        assert s1 == s2
        for u, v in zip(l1, l2, strict=True):
            if isinstance(v, torch.Tensor):
                # Nothing to move on one device: the very tensors given, as before.
                assert u is v
            else:
                assert u == v


def test_gather_returns_a_tensor_on_the_solver_device_itself() -> None:
    group = DeviceGroup([CPU], CPU)
    t = torch.ones(3)
    assert group.gather(t) is t
    assert group.gather(t) is t.to(CPU)
    total = group.sum([torch.ones(2), None, torch.full((2,), 2.0)])
    assert total is not None and torch.equal(total, torch.full((2,), 3.0))
