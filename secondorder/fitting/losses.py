"""Robust losses with scipy's definitions, as ``ρ(z)`` of the squared scaled residual.

Each loss is a function of ``z = (f / f_scale)²`` that equals ``z`` for small residuals
and grows more slowly for large ones, so outliers pull less on the fit:

* ``"linear"``: ``ρ = z``, ordinary least squares;
* ``"soft_l1"``: ``ρ = 2(√(1 + z) - 1)``, a smooth absolute value;
* ``"huber"``: ``ρ = z`` for ``z ≤ 1``, else ``2√z - 1``;
* ``"cauchy"``: ``ρ = log(1 + z)``, the strongest down-weighting short of ignoring;
* ``"arctan"``: ``ρ = arctan(z)``, bounded: a far outlier costs at most ``π/2``.

The cost is ``½ f_scale² Σ ρ(zᵢ)``; choose ``f_scale`` near the size of an inlier's
residual.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LOSSES", "doubled_cost", "rho"]

LOSSES = ("linear", "soft_l1", "huber", "cauchy", "arctan")


def rho(loss: str, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(ρ(z), ρ'(z), ρ''(z))`` elementwise for one of :data:`LOSSES`."""
    if loss == "linear":
        return z, torch.ones_like(z), torch.zeros_like(z)
    if loss == "soft_l1":
        t = 1 + z
        return 2 * (t.sqrt() - 1), t.rsqrt(), -0.5 * t ** (-1.5)
    if loss == "huber":
        inner = z <= 1
        zs = torch.where(inner, torch.ones_like(z), z)
        return (
            torch.where(inner, z, 2 * zs.sqrt() - 1),
            torch.where(inner, torch.ones_like(z), zs.rsqrt()),
            torch.where(inner, torch.zeros_like(z), -0.5 * zs ** (-1.5)),
        )
    if loss == "cauchy":
        t = 1 + z
        return torch.log1p(z), 1 / t, -1 / t**2
    if loss == "arctan":
        t = 1 + z * z
        return torch.arctan(z), 1 / t, -2 * z / t**2
    raise ValueError(f"Unknown loss={loss!r}; valid choices are {LOSSES}.")


def doubled_cost(f: Tensor, loss: str, f_scale: float) -> Tensor:
    """``2·cost = f_scale² Σ ρ((f/f_scale)²)`` (``‖f‖²`` for the linear loss), 0-d."""
    if loss == "linear":
        return torch.dot(f, f)
    z = (f / f_scale) ** 2
    return f_scale**2 * rho(loss, z)[0].sum()
