"""The covariance of every fit of a batch: :func:`~secondorder.fitting.covariance`'s rule.

Per fit ``s²·(JᵀJ)⁻¹`` with ``s² = 2·cost/(m - n)`` (or 1 with ``absolute_sigma``,
or inf everywhere when ``m ≤ n``), and inf in the rows and columns of a parameter the
data do not determine.  The rank is decided on J with its columns scaled to norm 1,
with scipy's threshold ``eps·max(m, n)·s_max`` on the singular values.

Fast path: the Cholesky factorisation of the scaled ``JᵀJ`` (unit diagonal, so
``λ_max ≤ n``) and its inverse, unrolled entry by entry for ``n ≤ 8``
(:func:`.small_linalg.inverse_spd`), bound the condition number; where that bound proves
the rank full, and the inverse accurate in float64, it is the answer.  The other fits
(rank deficient or nearly so) take the singular value decomposition.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .small_linalg import UNROLLED_MAX_N, gram, inverse_spd, norm2

__all__ = ["batch_covariance", "fast_inverse", "finish_covariance"]

_EPS64 = torch.finfo(torch.float64).eps


def batch_covariance(J: Tensor, cost2: Tensor | None, *, eps: float) -> Tensor:
    """``(B, n, n)`` float64 covariances from weighted Jacobians ``J`` ``(B, m, n)``.

    ``cost2``: ``2·cost`` per fit to estimate ``s²`` from (``None``: ``s² = 1``,
    ``absolute_sigma``); ``eps``: the precision J was computed in (the rank rule's).
    """
    return finish_covariance(J, fast_inverse(J, eps=eps), cost2, eps=eps)


def fast_inverse(J: Tensor, *, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fast path of :func:`batch_covariance`, with no host read (it compiles).

    Returns ``(inv, scale, fast, finite)``: the inverse of the column-scaled Gram
    ``(B, n, n)`` float64, the column norms ``(B, n)``, whether the inverse is the
    answer (rank provably full, accurate in float64) and whether ``J`` is finite.
    """
    b, m, n = J.shape
    # 0·t sums to 0 exactly when every entry is finite (no overflow, unlike Σt).
    finite = (J * 0.0).sum((1, 2)) == 0.0
    # The Gram, parameter-major (n, n, B): each entry a contiguous row over the fits.
    C = gram(torch.movedim(J.to(torch.float64), -1, 0))
    norms = torch.diagonal(C, dim1=0, dim2=1).sqrt()
    scale = torch.where(norms > 0, norms, 1.0)
    sc = scale.T
    # The Gram of J with its columns scaled to norm 1 (a NaN fit stays NaN: slow path).
    Cs = C / sc.unsqueeze(1) / sc.unsqueeze(0)
    if n <= UNROLLED_MAX_N:
        # Entry by entry: a pivot ≤ 0 leaves NaN or inf in its fit.
        inv = torch.movedim(inverse_spd(Cs.contiguous()), -1, 0)
        factored = torch.ones_like(finite)
    else:
        Cf = torch.movedim(Cs, -1, 0)
        L, info = torch.linalg.cholesky_ex(Cf)
        # A failed factorisation takes the slow path; I stands in for its L meanwhile.
        eye = torch.eye(n, dtype=torch.float64, device=J.device)
        inv = torch.cholesky_inverse(torch.where((info == 0)[:, None, None], L, eye))
        factored = info == 0
    bound = n * norm2(inv.reshape(b, n * n), dim=1)
    fast = (
        factored
        & torch.isfinite(bound)
        & (bound < 1e-3 / _EPS64)
        & (bound * (eps * max(m, n)) ** 2 < 0.5)
        & (norms > 0).all(-1)
    )
    return inv, scale, fast, finite


def finish_covariance(
    J: Tensor, fast_part: tuple[Tensor, ...], cost2: Tensor | None, *, eps: float
) -> Tensor:
    """:func:`batch_covariance` from :func:`fast_inverse`'s output: the slow fits, ``s²``."""
    inv, scale, fast, finite = fast_part
    b, m, n = J.shape
    undetermined = torch.zeros(b, n, dtype=torch.bool, device=J.device)
    slow = torch.nonzero(~fast).flatten()  # one host read per call
    if slow.numel():
        # A fit that failed (NaN data) has no covariance; zeros keep LAPACK away from NaN.
        Js = J[slow].to(torch.float64) / scale[slow, None, :]
        Js = torch.where(finite[slow, None, None], Js, 0.0)
        cov_s, und_s = _svd_covariance(Js, eps)
        inv = inv.index_put((slow,), cov_s)
        undetermined = undetermined.index_put((slow,), und_s)
    cov = inv / scale.unsqueeze(-1) / scale.unsqueeze(-2)
    if cost2 is not None:
        if m > n:
            cov = cov * (cost2.to(torch.float64) / (m - n))[:, None, None]
        else:
            cov = torch.full_like(cov, math.inf)
    bad = torch.isnan(cov).any(-1).any(-1) | ~finite
    cov = torch.where(bad[:, None, None], math.inf, cov)
    return torch.where(undetermined.unsqueeze(-1) | undetermined.unsqueeze(-2), math.inf, cov)


def _svd_covariance(Js: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``((JsᵀJs)⁺, undetermined)`` by the SVD, as :func:`..report._unscaled_covariance`."""
    _, s, Vh = torch.linalg.svd(Js, full_matrices=True)
    m, n = Js.shape[-2:]
    top = s[..., :1]
    kept = (s > eps * max(m, n) * top) & (top > 0)
    width = s.shape[-1]
    inv_s2 = torch.where(kept, 1.0 / (s * s), torch.zeros_like(s))
    rows = Vh[..., :width, :]
    cov = (rows.mT * inv_s2.unsqueeze(-2)) @ rows
    rank = kept.sum(-1, keepdim=True)
    null = torch.arange(n, device=Js.device) >= rank
    null_norm = torch.linalg.vector_norm(Vh * null.unsqueeze(-1), dim=-2)
    return cov, null_norm > math.sqrt(eps)
