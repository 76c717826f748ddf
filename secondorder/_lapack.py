"""Sizes at which a CPU Cholesky runs slowly, and the identity padding that avoids them.

``torch.linalg.cholesky_ex`` on the CPU copies its input's lower triangle into a
column-major buffer and hands that to LAPACK.  When a column of that buffer is a
multiple of 1 KiB long (float64 ``n = 128k``, float32 ``n = 256k``: the batch sizes
people choose) the copy and LAPACK's blocked kernels keep evicting their own cache
lines.  Measured on the 2-core CI machine (MKL, 2 threads, factor and one solve;
``python -m benchmarks.lapack_sizes``): float64 0.41 ms at n = 256 against 0.29 ms
for the same matrix padded to 272, 2.3 against 1.3 ms at 512, 11.8 against 7.5 ms at
1024; float32 at 1024, 8.5 against 4.2 ms (13.7 against 6.0 ms on one thread).  The
copy alone takes 182 µs at n = 256 and 23 µs at 264.

``blockdiag(M, I)`` has the Cholesky factor ``blockdiag(L, I)`` and the inverse
``blockdiag(M⁻¹, I)``, and it is positive definite exactly when ``M`` is, so factoring
it answers the question about ``M``: :func:`factor_size` says how large to make it and
:func:`pad_identity` builds it.  Only Cholesky-based routines are padded: the identity
block would add eigenvalues equal to 1 to an eigendecomposition, which can mix with
``M``'s own.  Other devices are left as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["factor_size", "pad_identity", "shifted_cholesky_solve"]

#: Column lengths (bytes) whose multiples are slow; padding adds 16 entries.
_ALIASED_BYTES = 1024
_PAD = 16
#: Below this order the copy and the factorisation take microseconds either way.
_MIN_ALIASED = 256
#: From this order on, odd sizes are rounded up to a multiple of 16 (LAPACK's
#: Cholesky and inverse ran ~15% faster at 1296 than at 1281, MKL, one thread).
_MIN_ROUNDED = 512


def factor_size(n: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """The order at which to factor an ``n × n`` matrix: ``n``, or a little more."""
    if torch.device(device).type != "cpu":
        return n
    size = n if n < _MIN_ROUNDED else -(-n // _PAD) * _PAD
    if size >= _MIN_ALIASED and (size * dtype.itemsize) % _ALIASED_BYTES == 0:
        size += _PAD
    return size


def pad_identity(m: Tensor, size: int | None = None) -> Tensor:
    """``blockdiag(m, I)`` of order ``size`` (``m`` itself, not a copy, when it fits).

    ``size``: by default :func:`factor_size` of ``m``'s order, dtype and device.
    """
    n = m.shape[-1]
    if size is None:
        size = factor_size(n, m.dtype, m.device)
    if size == n:
        return m
    out = m.new_zeros(*m.shape[:-2], size, size)
    out[..., :n, :n] = m
    out.diagonal(dim1=-2, dim2=-1)[..., n:] = 1.0
    return out


def shifted_cholesky_solve(k: Tensor, shift: Tensor | float, b: Tensor) -> tuple[Tensor, Tensor]:
    """Solve ``(k + diag(shift)) x = b`` by Cholesky, for a symmetric ``n × n`` ``k``.

    ``k`` is left as it is; ``shift`` is a scalar or a length-``n`` vector, ``b`` a
    length-``n`` vector (converted to ``k``'s dtype).  Returns ``x`` and LAPACK's
    ``info`` (0 when ``k + diag(shift)`` factored; otherwise ``x`` is not a solution).
    """
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise ValueError(
            f"shifted_cholesky_solve takes one n × n matrix, got shape {tuple(k.shape)}"
        )
    n = k.shape[-1]
    size = factor_size(n, k.dtype, k.device)
    m = k.clone() if size == n else pad_identity(k, size)
    m.diagonal()[:n].add_(shift)
    L, info = torch.linalg.cholesky_ex(m)
    rhs = b.to(m.dtype).unsqueeze(-1)
    if size != n:
        rhs = torch.cat([rhs, rhs.new_zeros(size - n, 1)])
    return torch.cholesky_solve(rhs, L)[:n, 0], info
