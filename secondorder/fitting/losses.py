"""Robust losses with scipy's definitions, as ``ρ(z)`` of the squared scaled residual.

Each loss is a function of ``z = (f / f_scale)²`` that equals ``z`` for small residuals
and grows more slowly for large ones, so outliers pull less on the fit:

* ``"linear"``: ``ρ = z``, ordinary least squares;
* ``"soft_l1"``: ``ρ = 2(√(1 + z) - 1)``, a smooth absolute value;
* ``"huber"``: ``ρ = z`` for ``z ≤ 1``, else ``2√z - 1``;
* ``"cauchy"``: ``ρ = log(1 + z)``, the strongest down-weighting short of ignoring;
* ``"arctan"``: ``ρ = arctan(z)``, bounded: a far outlier costs at most ``π/2``.

The cost is ``½ f_scale² Σ ρ(zᵢ)``; choose ``f_scale`` near the size of an inlier's
residual.  A callable ``loss`` is scipy's form: ``loss(z)`` returns a ``(3, m)`` array
of ``ρ(z), ρ'(z), ρ''(z)`` (NumPy in, NumPy out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["LOSSES", "Loss", "check_loss_output", "doubled_cost", "rho"]

#: A loss name from :data:`LOSSES` or scipy's callable ``rho(z) -> (3, m)``.
Loss = str | Callable[..., Any]

LOSSES = ("linear", "soft_l1", "huber", "cauchy", "arctan")


def check_loss_output(loss: Callable[..., Any], z: Tensor) -> None:
    """Call a callable ``loss`` once at ``z`` and check it returns a finite ``(3, m)`` array."""
    out = np.asarray(loss(z.numpy().copy()), dtype=np.float64)
    m = z.numel()
    if out.shape != (3, m):
        raise ValueError(
            f"The return value of the callable loss has wrong shape {out.shape}; expected "
            f"(3, m) = (3, {m}): rows rho(z), rho'(z), rho''(z) for z = (f / f_scale)**2"
        )


def rho(loss: Loss, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(ρ(z), ρ'(z), ρ''(z))`` elementwise for one of :data:`LOSSES` or a callable."""
    if callable(loss):
        out = torch.from_numpy(np.asarray(loss(z.detach().numpy().copy()), dtype=np.float64))
        return out[0].to(z.dtype), out[1].to(z.dtype), out[2].to(z.dtype)
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


def doubled_cost(f: Tensor, loss: Loss, f_scale: float) -> Tensor:
    """``2·cost = f_scale² Σ ρ((f/f_scale)²)`` (``‖f‖²`` for the linear loss), 0-d."""
    if isinstance(loss, str) and loss == "linear":
        return torch.dot(f, f)
    z = (f / f_scale) ** 2
    return f_scale**2 * rho(loss, z)[0].sum()
