"""The factor linear algebra of K-FAC layers: eigendecompositions and SPD inverses."""

from __future__ import annotations

import torch
from torch import Tensor

from ..._lapack import pad_identity

__all__ = ["default_factor_dtype", "spd_cholesky", "spd_inverse", "sym_eigh"]


def default_factor_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The parameter's dtype, or float32 for half precision.

    A factor sums squares of inputs and gradients: with ``|a| ≈ 30`` and 256 samples
    that is ``2·10⁵``, beyond float16's largest value (65504), and bfloat16's 8-bit
    mantissa would round the running average away.
    """
    return torch.float32 if param_dtype in (torch.float16, torch.bfloat16) else param_dtype


def sym_eigh(m: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of the PSD factor ``m`` in ``dtype``."""
    d, q = torch.linalg.eigh(m.to(dtype))
    # A and G are PSD; rounding can make the smallest eigenvalues slightly negative,
    # which would let d_G d_A + λ approach 0.
    return d.clamp(min=0.0), q


def spd_inverse(m: Tensor) -> Tensor:
    """Inverse of a symmetric positive definite (batch of) matrix by Cholesky.

    Half the flops of an LU inverse; a factor that rounding made indefinite falls back
    to ``torch.linalg.inv``.
    """
    # LAPACK works on column-major copies: handing it the transposed view of the
    # symmetric m (column-major already) and reading the symmetric result back through
    # its transpose spares two transposing copies of the matrix (~15% at n = 1281).
    n = m.shape[-1]
    chol, info = torch.linalg.cholesky_ex(pad_identity(m).mT)
    if bool((info != 0).any()):
        return torch.linalg.inv(m)
    return torch.cholesky_inverse(chol).mT[..., :n, :n]


def spd_cholesky(m: Tensor) -> Tensor:
    """Upper Cholesky factor ``U`` (``m = UᵀU``) of a symmetric positive definite matrix.

    Upper, because LAPACK returns the lower factor column-major, whose transpose is
    then row-major without a copy.  A factor that rounding made indefinite is lifted
    so that its smallest eigenvalue is ``n·eps·max|diag|`` (where :func:`spd_inverse`
    falls back to LU, which the solves cannot).
    """
    n = m.shape[-1]
    chol, info = torch.linalg.cholesky_ex(pad_identity(m).mT)
    if bool((info != 0).any()):
        low = torch.linalg.eigvalsh(m)[..., :1].clamp(max=0.0)
        tiny = n * torch.finfo(m.dtype).eps * m.diagonal(dim1=-2, dim2=-1).abs().amax(-1, True)
        m = m.clone()
        m.diagonal(dim1=-2, dim2=-1).add_(tiny - low)
        chol = torch.linalg.cholesky(pad_identity(m).mT)
    return chol.mT[..., :n, :n]
