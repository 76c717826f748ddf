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

from .small_linalg import UNROLLED_MAX_N, inverse_spd, norm2

__all__ = ["batch_covariance"]

_EPS64 = torch.finfo(torch.float64).eps


def batch_covariance(J: Tensor, cost2: Tensor | None, *, eps: float) -> Tensor:
    """``(B, n, n)`` float64 covariances from weighted Jacobians ``J`` ``(B, m, n)``.

    ``cost2``: ``2·cost`` per fit to estimate ``s²`` from (``None``: ``s² = 1``,
    ``absolute_sigma``); ``eps``: the precision J was computed in (the rank rule's).
    """
    b, m, n = J.shape
    # 0·t sums to 0 exactly when every entry is finite (no overflow, unlike Σt).
    finite = (J * 0.0).sum((1, 2)) == 0.0
    J64 = J.to(torch.float64)
    C = J64.mT @ J64
    norms = C.diagonal(dim1=-2, dim2=-1).sqrt()
    scale = torch.where(norms > 0, norms, 1.0)
    # The Gram of J with its columns scaled to norm 1 (a NaN fit stays NaN: slow path).
    Cs = C / scale.unsqueeze(-1) / scale.unsqueeze(-2)
    if n <= UNROLLED_MAX_N:
        # Parameter-major, entry by entry: a pivot ≤ 0 leaves NaN or inf in its fit.
        inv = inverse_spd(torch.movedim(Cs, 0, -1).contiguous())
        inv = torch.movedim(inv, -1, 0)
        factored = torch.ones_like(finite)
    else:
        L, info = torch.linalg.cholesky_ex(Cs)
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
    undetermined = torch.zeros(b, n, dtype=torch.bool, device=J.device)
    slow = torch.nonzero(~fast).flatten()  # one host read per call
    if slow.numel():
        # A fit that failed (NaN data) has no covariance; zeros keep LAPACK away from NaN.
        Js = torch.where(finite[slow, None, None], J64[slow] / scale[slow, None, :], 0.0)
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
