"""Sizes at which a CPU Cholesky may run slowly, and the identity padding that avoids them.

Off unless the user asks for it (:func:`pad_cpu_cholesky`, also
:func:`secondorder.tuning.pad_cpu_cholesky`): the sizes below were measured on one
machine's CPU and LAPACK, and on another they are a guess.

``torch.linalg.cholesky_ex`` on the CPU copies its input's lower triangle into a
column-major buffer and hands that to LAPACK.  When a column of that buffer is a
multiple of 1 KiB long (float64 ``n = 128k``, float32 ``n = 256k``: the batch sizes
people choose) the copy and LAPACK's blocked kernels keep evicting their own cache
lines; padding such sizes by 16 can make the factorisation much faster
(``python -m benchmarks.experiments.lapack_sizes`` measures it on yours).

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

__all__ = ["factor_size", "pad_cpu_cholesky", "pad_identity", "shifted_cholesky_solve"]

#: Column lengths (bytes) whose multiples are slow; padding adds 16 entries.
_ALIASED_BYTES = 1024
_PAD = 16
#: Below this order the copy and the factorisation take microseconds either way.
_MIN_ALIASED = 256
#: From this order on, odd sizes are rounded up to a multiple of 16 (LAPACK's
#: Cholesky and inverse ran ~15% faster at 1296 than at 1281, MKL, one thread).
_MIN_ROUNDED = 512


#: Whether CPU Cholesky sizes are padded (:func:`pad_cpu_cholesky`); off by default.
_padding = False


def pad_cpu_cholesky(enabled: bool = True) -> bool:
    """Pad CPU Cholesky factorisations away from slow sizes (or stop); returns the previous setting.

    A process-wide switch the user turns: every family's CPU Cholesky (LM's solver,
    K-FAC's inverses, Shampoo's root inverses) then factors ``blockdiag(M, I)`` at
    :func:`factor_size`.  The factor and the solution are those of ``M``; only the
    rounding of the blocked kernels may differ.
    """
    global _padding
    if not isinstance(enabled, bool):
        raise TypeError(f"Invalid enabled={enabled!r}: must be True or False.")
    previous, _padding = _padding, enabled
    return previous


def factor_size(n: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """The order at which to factor an ``n × n`` matrix: ``n``, or a little more when padding.

    ``n`` unless :func:`pad_cpu_cholesky` turned the padding on and ``device`` is the CPU.
    """
    if not _padding or torch.device(device).type != "cpu":
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
