"""Compact forms of the factor statistics for their all-reduce.

A symmetric ``n × n`` matrix is sent as its upper triangle (``n(n+1)/2`` numbers,
about half the traffic) when ``symmetry_aware`` is set; a single finiteness test per
tensor spots a GradScaler overflow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["pack_upper", "sums_finite", "unpack_upper"]


def pack_upper(t: Tensor) -> Tensor:
    """The upper triangle (diagonal included) of the last two dims of ``t``, row by row."""
    n = t.shape[-1]
    iu = torch.triu_indices(n, n, device=t.device)
    return t[..., iu[0], iu[1]]


def unpack_upper(v: Tensor, n: int) -> Tensor:
    """The symmetric ``n × n`` matrices whose upper triangles :func:`pack_upper` gave."""
    iu = torch.triu_indices(n, n, device=v.device)
    out = v.new_zeros((*v.shape[:-1], n, n))
    out[..., iu[0], iu[1]] = v
    return out + torch.triu(out, diagonal=1).mT


def sums_finite(tensors: Sequence[Tensor]) -> list[bool]:
    """Whether every entry of each of ``tensors`` is finite (no inf, no NaN).

    A sum is finite only if every term is (inf and NaN propagate), and ``s·0 == 0``
    only for a finite ``s``: one reduction per tensor and one read for all of them,
    instead of isfinite's full-size temporaries and a read each.  The elementwise test
    settles a finite tensor whose sum overflowed.
    """
    if not tensors:
        return []
    sums = torch.stack([t.sum() for t in tensors])
    quick = (sums * 0.0 == 0.0).tolist()
    return [ok or bool(torch.isfinite(t).all()) for ok, t in zip(quick, tensors, strict=True)]
