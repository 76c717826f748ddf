"""``sigma`` of :func:`~.api.curve_fit_batch`: how each fit's residuals are weighted.

scipy's meanings, per fit: standard deviations (a scalar, ``(m,)`` shared or
``(B, m)`` per fit) divide the residuals; a covariance of the data (``(m, m)``
shared or ``(B, m, m)`` per fit, scipy's 2-D ``sigma``) whitens them, ``r = L⁻¹(f - y)``
with ``C = LLᵀ``, so that ``½‖r‖² = ½(f - y)ᵀC⁻¹(f - y)``.  Both are linear maps of
``f - y``, so the Jacobian is mapped the same way and the covariance of the
parameters follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .arguments import as_tensor

__all__ = ["DataWeights", "data_weights"]


@dataclass(frozen=True)
class DataWeights:
    """The map from ``f - y`` to the residuals: ``1/σ`` or ``L⁻¹``, shared or per fit.

    ``value``: ``1/σ`` (0-d or ``(m,)`` shared, ``(B, m)`` per fit) or ``L⁻¹``
    (``(m, m)`` shared, ``(B, m, m)`` per fit); ``per_fit``: whether its first axis
    runs over the fits (then it travels with the fits' rows and arrives as ``row``).
    """

    value: Tensor
    per_fit: bool
    whitening: bool

    def residuals(self, diff: Tensor, row: Tensor | None) -> Tensor:
        """``diff`` ``(B, m)`` weighted; ``row``: this call's rows of a per-fit ``value``."""
        w = row if self.per_fit else self.value
        assert w is not None
        if not self.whitening:
            return diff * w
        return _whiten(w, diff.unsqueeze(-1)).squeeze(-1)

    def jacobian(self, J: Tensor, row: Tensor | None) -> Tensor:
        """``J`` ``(B, m, n)`` (of ``f``) mapped as the residuals are."""
        w = row if self.per_fit else self.value
        assert w is not None
        if not self.whitening:
            return J * (w if w.ndim == 0 else w.reshape(-1, J.shape[1]))[..., None]
        return _whiten(w, J)


#: Entries of the product a per-fit whitening forms at once, ``k·m·m·n`` for ``k`` fits.
_WHITEN_ENTRIES = 1 << 22
#: Fits per matrix product of a shared whitening: every product has this shape.
_SLICE = 32


def _whiten(w: Tensor, v: Tensor) -> Tensor:
    """``w @ v`` per fit (``w`` ``(m, m)`` or ``(B, m, m)``, ``v`` ``(B, m, k)``).

    A fit's bits must not depend on the chunk or on the unfinished fits it runs
    among, and a matrix product's rounding depends on its shape (BLAS takes another
    kernel for one fit than for many).  A shared ``w`` is applied to slices of
    exactly ``_SLICE`` fits (the last one padded with zeros), so every product has
    one shape; a per-fit ``w`` by a product and a sum along each row (one order per
    fit), a slice of fits at a time so that the ``(fits, m, m, k)`` product stays small.
    """
    b, m, k = v.shape
    if w.ndim == 2:
        if b == 0:
            return v.new_zeros(0, m, k)
        pad = -b % _SLICE
        if pad:
            v = torch.cat([v, v.new_zeros(pad, m, k)])
        parts = []
        for lo in range(0, v.shape[0], _SLICE):
            cols = v[lo : lo + _SLICE].permute(1, 0, 2).reshape(m, _SLICE * k)
            parts.append((w @ cols).reshape(m, _SLICE, k).permute(1, 0, 2))
        return torch.cat(parts)[:b]
    step = max(1, _WHITEN_ENTRIES // max(1, m * m * k))
    parts = []
    for lo in range(0, max(b, 1), step):
        ws = w[lo : lo + step]
        parts.append((ws.unsqueeze(-1) * v[lo : lo + step].unsqueeze(-3)).sum(-2))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def data_weights(
    sigma: Any, b: int, m: int, dtype: torch.dtype, device: torch.device
) -> DataWeights | None:
    """``sigma`` checked and turned into :class:`DataWeights` (``None`` without one)."""
    if sigma is None:
        return None
    s = as_tensor("sigma", sigma, dtype, device)
    shapes = {(): "a scalar", (m,): f"({m},)", (b, m): f"({b}, {m})"}
    covariances = {(m, m): f"({m}, {m})", (b, m, m): f"({b}, {m}, {m})"}
    if s.shape == (1,):
        s = s.reshape(())
    if b == m and s.shape == (m, m):
        raise ValueError(
            f"sigma of shape ({m}, {m}) with {b} fits of {m} points reads two ways: per-fit "
            f"standard deviations (B, m) or a covariance of the data (m, m), scipy's 2-D "
            f"sigma; pass a per-fit covariance of shape ({b}, {m}, {m}) instead: "
            "torch.diag_embed(sigma**2) for standard deviations, sigma.expand(B, m, m) for "
            "one covariance shared by every fit"
        )
    if s.shape in covariances:
        return _whitening(s, b, m)
    if s.shape not in shapes:
        raise ValueError(
            f"sigma must be standard deviations (a scalar, ({m},) or ({b}, {m})) or "
            f"covariances of ydata (({m}, {m}) or ({b}, {m}, {m})), got shape {tuple(s.shape)}"
        )
    if bool((s <= 0).any()):
        first = tuple(int(i) for i in torch.nonzero(s <= 0)[0])
        where = f"sigma[{', '.join(map(str, first))}]" if first else "sigma"
        raise ValueError(
            f"sigma must be > 0 everywhere (standard deviations of ydata), got "
            f"{where}={float(s[first])!r}; a fit with a NaN sigma fails alone, a zero or "
            "negative one is refused: pass the points' standard deviations"
        )
    return DataWeights(1.0 / s, per_fit=s.shape == (b, m) and s.ndim == 2, whitening=False)


def _whitening(cov: Tensor, b: int, m: int) -> DataWeights:
    """``L⁻¹`` of each covariance; refused where one is finite but not positive definite."""
    per_fit = cov.ndim == 3
    finite = torch.isfinite(cov).flatten(-2).all(-1)
    asym = (cov - cov.mT).abs().flatten(-2).amax(-1)
    scale = cov.abs().flatten(-2).amax(-1)
    eps = torch.finfo(cov.dtype).eps
    bad_sym = finite & (asym > 64 * eps * scale)
    # A fit whose covariance holds NaN or inf fails alone: its L⁻¹ is NaN.
    safe = torch.where(finite[..., None, None], cov, torch.eye(m, dtype=cov.dtype))
    L, info = torch.linalg.cholesky_ex(safe)
    bad_pd = finite & (info != 0)
    for bad, what in ((bad_sym, "symmetric"), (bad_pd, "positive definite")):
        if bool(bad.any()):
            where = f" (fit {int(torch.nonzero(bad.reshape(-1))[0])})" if per_fit else ""
            raise ValueError(
                f"sigma as a covariance of ydata must be {what}{where}; for independent "
                "errors pass their standard deviations, (m,) or (B, m)"
            )
    eye = torch.eye(m, dtype=cov.dtype, device=cov.device).expand_as(L)
    inv_l = torch.linalg.solve_triangular(L, eye, upper=False)
    inv_l = torch.where(finite[..., None, None], inv_l, math.nan)
    return DataWeights(inv_l.contiguous(), per_fit=per_fit, whitening=True)
