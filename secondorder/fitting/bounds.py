"""Box bounds ``lb ≤ x ≤ ub`` as a change of variables ``x = x(y)`` over an unbounded ``y``.

As in MINUIT and lmfit, each bounded coordinate is a smooth function of a free one:

* two-sided: ``x = lb + (ub - lb)(sin y + 1)/2``, evaluated near each bound from
  ``t``, the distance of y to the bound's angle ``∓π/2`` (exact by Sterbenz's lemma
  with π/2 in two parts): ``x - lb = w·sin²(t/2)``, so the distance to the bound is
  computed without cancellation, and from the middle ``(lb + ub)/2 + (w/2)·sin y``;
* lower only: ``x = lb - 1 + √(y² + 1)``, computed as ``lb + y²/(√(y² + 1) + 1)``;
* upper only: ``x = ub + 1 - √(y² + 1)``, likewise.

The solver works in ``y``, so every iterate is feasible and a bound is reached exactly
(where ``x'(y) = 0``).  :func:`parse_bounds` reads the user's ``bounds`` argument;
:class:`BoxTransform` maps between ``x`` and ``y`` and reports which bounds are active.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["BoxTransform", "parse_bounds"]

#: π/2 as a sum of two doubles (the second is its rounding error), and 2π.
_HALF_PI_HI = 1.5707963267948966
_HALF_PI_LO = 6.123233995736766e-17
_TWO_PI = 2 * math.pi


def parse_bounds(bounds: Any, n: int) -> tuple[Tensor, Tensor]:
    """``(lb, ub)`` as float64 tensors of shape ``(n,)`` from scipy's forms of ``bounds``.

    Accepts ``None`` (unbounded), a pair of scalars or length-``n`` arrays (``±inf`` for
    no bound), or a ``scipy.optimize.Bounds``; requires ``lb < ub`` elementwise.
    """
    if bounds is None:
        bounds = (-math.inf, math.inf)
    if hasattr(bounds, "lb") and hasattr(bounds, "ub"):  # scipy.optimize.Bounds
        bounds = (bounds.lb, bounds.ub)
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"bounds must be a pair (lb, ub), got {bounds!r}")
    lb, ub = (_bound_vector(name, b, n) for name, b in zip(("lb", "ub"), bounds, strict=True))
    bad = lb >= ub
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"Each lower bound must be strictly less than each upper bound: "
            f"lb[{i}]={float(lb[i])!r} >= ub[{i}]={float(ub[i])!r}"
        )
    return lb, ub


def _bound_vector(name: str, b: Any, n: int) -> Tensor:
    """One side of the bounds, broadcast from a scalar, checked for shape and NaN."""
    try:
        t = torch.as_tensor(np.asarray(b, dtype=np.float64), dtype=torch.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bounds {name} must be numbers, got {b!r}") from exc
    if t.ndim == 0:
        t = t.expand(n).clone()
    if t.shape != (n,):
        raise ValueError(
            f"bounds {name} must be a scalar or have shape ({n},), got {tuple(t.shape)}"
        )
    if bool(torch.isnan(t).any()):
        raise ValueError(f"bounds {name} contains NaN: {t.tolist()}")
    return t


class BoxTransform:
    """The map ``y ↦ x`` for box bounds, its inverse and derivatives (identity if unbounded).

    With a ``scale`` (``least_squares``'s array ``x_scale``) the solver's variable is
    ``u = y / scale``: an identity damping matrix in ``u`` is ``diag(1/scale²)`` in
    ``y``, MINPACK's fixed scaling, and the step tests measure ``u``.

    Attributes:
        lb, ub: the bounds (``±inf`` where a side is open).
        lo, hi, both: where a lower bound, an upper bound, or both are finite.
        bounded: whether any coordinate is bounded at all.
        scale: the fixed scaling of the free variable, or ``None``.
        any: whether the map is not the identity (bounded or scaled).
    """

    def __init__(self, lb: Tensor, ub: Tensor, scale: Tensor | None = None) -> None:
        self.lb, self.ub = lb, ub
        self.lo = torch.isfinite(lb)
        self.hi = torch.isfinite(ub)
        self.both = self.lo & self.hi
        self.bounded = bool((self.lo | self.hi).any())
        self.scale = scale
        self.any = self.bounded or scale is not None

    def _free(self, u: Tensor) -> Tensor:
        """The unscaled free variable ``y = scale·u``."""
        return u if self.scale is None else u * self.scale

    def _finite_ends(self) -> tuple[Tensor, Tensor]:
        """The bounds with their infinite ends replaced by 0 (masked out by ``where``)."""
        lb = torch.where(self.lo, self.lb, torch.zeros_like(self.lb))
        ub = torch.where(self.hi, self.ub, torch.zeros_like(self.ub))
        return lb, ub

    def to_x(self, y: Tensor) -> Tensor:
        """The feasible point ``x(y)``."""
        y = self._free(y)
        if not self.bounded:
            return y
        lb, ub = self._finite_ends()
        # √(y² + 1) - 1 as y²/(√(y² + 1) + 1): no cancellation, so a start or solution
        # a tiny distance from its bound (a saturation current of 1e-15 above 0) keeps
        # its relative precision.
        rise = y * y / (torch.sqrt(y * y + 1) + 1)
        width = ub - lb
        sin = torch.sin(y)
        # The angle of the nearer bound, -π/2 or π/2 (+ 2πk), and y's distance t to it.
        k = torch.round(y / _TWO_PI)
        to_lower = (y + _HALF_PI_HI) + _HALF_PI_LO - _TWO_PI * k
        to_upper = (_HALF_PI_HI - y) + _HALF_PI_LO + _TWO_PI * k
        two = torch.where(
            sin <= -0.5,
            lb + width * torch.sin(to_lower / 2) ** 2,
            torch.where(
                sin >= 0.5,
                ub - width * torch.sin(to_upper / 2) ** 2,
                lb / 2 + ub / 2 + width / 2 * sin,
            ),
        )
        low = lb + rise
        high = ub - rise
        return torch.where(self.both, two, torch.where(self.lo, low, torch.where(self.hi, high, y)))

    def to_y(self, x: Tensor) -> Tensor:
        """A ``y`` with ``x(y) = x``: ``y ≥ 0``, or ``|y| ≤ π/2`` where two-sided."""
        if not self.bounded:
            return x if self.scale is None else x / self.scale
        lb, ub = self._finite_ends()
        width = torch.where(self.both, ub - lb, torch.ones_like(ub))
        above = torch.clamp((x - lb) / width, 0.0, 1.0)
        below = torch.clamp((ub - x) / width, 0.0, 1.0)
        centred = torch.clamp((x - (lb / 2 + ub / 2)) / (width / 2), -1.0, 1.0)
        # (sin y + 1)/2 = (x - lb)/w, read from the nearer bound's distance or the middle.
        two = torch.where(
            above <= 0.25,
            -_HALF_PI_HI + (2 * torch.arcsin(torch.sqrt(above)) - _HALF_PI_LO),
            torch.where(
                below <= 0.25,
                _HALF_PI_HI - (2 * torch.arcsin(torch.sqrt(below)) - _HALF_PI_LO),
                torch.arcsin(centred),
            ),
        )
        # √((d + 1)² - 1) as √(d(d + 2)), d the distance to the bound.
        above, below = torch.clamp(x - lb, min=0.0), torch.clamp(ub - x, min=0.0)
        low = torch.sqrt(above * (above + 2))
        high = torch.sqrt(below * (below + 2))
        y = torch.where(self.both, two, torch.where(self.lo, low, torch.where(self.hi, high, x)))
        return y if self.scale is None else y / self.scale

    def derivatives(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(x'(y), x''(y))`` elementwise (ones and zeros where x is unbounded)."""
        if self.scale is not None:
            d1, d2 = BoxTransform(self.lb, self.ub).derivatives(self._free(y))
            return d1 * self.scale, d2 * self.scale**2
        width = torch.where(self.both, self.ub - self.lb, torch.zeros_like(self.ub))
        root = torch.sqrt(y * y + 1)
        one, zero = torch.ones_like(y), torch.zeros_like(y)
        d1 = torch.where(
            self.both,
            width * torch.cos(y) / 2,
            torch.where(self.lo, y / root, torch.where(self.hi, -y / root, one)),
        )
        d2 = torch.where(
            self.both,
            -width * torch.sin(y) / 2,
            torch.where(self.lo, root**-3, torch.where(self.hi, -(root**-3), zero)),
        )
        return d1, d2

    def start_size(self, y: Tensor) -> Tensor:
        """The size of a start in the free variable, for MINPACK's first trust region.

        MINPACK sizes that region by ``|x₀|``; measured in ``y`` alone a start in the
        middle of a two-sided box has size 0 (``y = 0``) whatever ``x₀`` is, and the
        region could not leave it.  So a bounded coordinate counts the larger of ``|y|``
        and ``|x| / |x'(y)|``, its size in ``x`` expressed in ``y`` (a start at 500 in
        the middle of ``(0, 1000)`` has size 1).  Unbounded coordinates count ``|y|``.
        """
        d1, _ = self.derivatives(y)
        x = self.to_x(y)
        in_x = torch.where(d1 != 0, x.abs() / d1.abs(), torch.zeros_like(x))
        return torch.where(self.lo | self.hi, torch.maximum(y.abs(), in_x), y.abs())

    def strictly_feasible(self, x: Tensor) -> Tensor:
        """Move points on a bound slightly inside, where the change of variables has slope."""
        step = 1e-10 * torch.clamp(x.abs(), min=1.0)
        x = torch.where(self.lo & (x <= self.lb), self.lb + step, x)
        x = torch.where(self.hi & (x >= self.ub), self.ub - step, x)
        return torch.where(self.both & (self.ub - self.lb <= 2 * step), (self.lb + self.ub) / 2, x)

    def active(self, x: Tensor, tol: float = 1e-10) -> Tensor:
        """The ``active_mask`` of scipy: -1 on an active lower bound, 1 on an upper one, else 0."""
        scale = tol * torch.clamp(x.abs(), min=1.0)
        mask = torch.zeros_like(x, dtype=torch.int64)
        mask = torch.where(self.lo & (x - self.lb <= scale), -1, mask)
        return torch.where(self.hi & (self.ub - x <= scale), 1, mask)

    def cl_scale(self, x: Tensor, g: Tensor) -> Tensor:
        """Coleman-Li scaling, as scipy's "trf" reports optimality under bounds."""
        v = torch.ones_like(x)
        v = torch.where((g < 0) & self.hi, self.ub - x, v)
        return torch.where((g > 0) & self.lo, x - self.lb, v)
