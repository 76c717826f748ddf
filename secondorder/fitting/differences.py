"""Finite-difference Jacobians: forward, central and complex-step, grouped by sparsity.

What :func:`~secondorder.fitting.least_squares` uses for a NumPy ``fun`` without ``jac``, and for
``jac="2-point"``, ``"3-point"`` or ``"cs"``: scipy's schemes and steps (MINPACK's for
``method="lm"``), one evaluation per group of structurally orthogonal columns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "Fn",
    "JacobianFn",
    "NumpyDifference",
    "check_sparsity",
    "column_groups",
    "finite_difference",
]

Fn = Callable[[Tensor], Tensor]


class JacobianFn(Protocol):
    """``J(x)``, ``(m, n)``; ``f0``, when given, is already known to be ``f(x)``."""

    def __call__(self, x: Tensor, f0: Tensor | None = None) -> Tensor:
        """The Jacobian at ``x`` (finite differences reuse ``f0`` instead of calling f)."""
        ...


def check_sparsity(pattern: Any, shape: tuple[int, int]) -> Tensor:
    """``jac_sparsity`` (dense or scipy.sparse) as an ``(m, n)`` boolean tensor."""
    dense = pattern.toarray() if hasattr(pattern, "toarray") else pattern
    try:
        arr = np.atleast_2d(np.asarray(dense, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"jac_sparsity must be an (m, n) 0/1 array, got {pattern!r}") from exc
    if arr.shape != shape:
        raise ValueError(
            f"jac_sparsity has wrong shape {arr.shape}; expected (m, n) = {shape} "
            "(residuals by parameters)"
        )
    return torch.from_numpy(arr != 0)


def column_groups(pattern: Tensor) -> list[list[int]]:
    """Columns of ``pattern`` in groups that share no row (structurally orthogonal).

    Greedy in column order: each column joins the first group whose rows it does not
    touch.  Perturbing a group's columns at once changes each row through one column
    only, so one evaluation gives every column of the group.
    """
    groups: list[list[int]] = []
    rows: list[Tensor] = []
    for j in range(pattern.shape[1]):
        col = pattern[:, j]
        for g, used in enumerate(rows):
            if not bool((used & col).any()):
                groups[g].append(j)
                rows[g] = used | col
                break
        else:
            groups.append([j])
            rows.append(col.clone())
    return groups


def finite_difference(
    fun: Fn,
    scheme: str,
    *,
    eps: float = float(torch.finfo(torch.float64).eps),
    rel_step: Tensor | None = None,
    sparsity: Tensor | None = None,
    complex_fun: Callable[[Tensor], Tensor] | None = None,
    numpy_fun: Callable[[np.ndarray], np.ndarray] | None = None,
    minpack: bool = False,
) -> JacobianFn:
    """The Jacobian of ``fun`` by finite differences, one evaluation per group of columns.

    ``"2-point"`` is the forward difference ``(f(x + h eᵢ) - f(x)) / h`` (error O(h),
    one evaluation per column); ``"cs"`` the complex step ``Im f(x + i h eᵢ) / h`` (no
    cancellation, so exact to rounding; ``complex_fun`` evaluates ``f`` at complex
    points); any other scheme is the central difference ``(f(x + h eᵢ) - f(x - h eᵢ)) /
    2h`` (error O(h²), two evaluations per column).  The step is scipy's: ``h =
    rel_step·sign(xᵢ)·|xᵢ|`` for a given ``rel_step``, else ``h = s·sign(xᵢ)·max(1,
    |xᵢ|)`` with ``s = √eps`` ("2-point", "cs") or ``eps^⅓`` (central); ``eps`` is the
    precision ``fun`` computes
    in (:func:`~.functions.output_eps`): a float32 ``fun`` needs steps about 2900 times longer than
    a float64 one, or ``f(x + h eᵢ) - f(x)`` is rounding noise.  With a ``sparsity``
    pattern, structurally orthogonal columns (:func:`column_groups`) share one
    evaluation.  The forward scheme takes ``f(x)`` from ``f0`` when the caller already
    has it (so a Jacobian costs n calls of ``fun``, as MINPACK's does).  ``numpy_fun``,
    the same residuals on NumPy arrays, runs the real schemes without a torch call per
    column (the same operations in the same order, so the same J to the last bit).

    ``minpack`` (``"2-point"`` only): MINPACK's step (``fdjac2``, which scipy's
    ``method="lm"`` runs), ``h = s·|xᵢ|`` with ``s = max(rel_step, √eps)``, and ``h =
    s`` where ``xᵢ = 0``: relative to each parameter, so a parameter far below 1 gets a
    step to its own scale, not one of ~1e-8 absolute whose truncation error swamps
    its column (on NIST's Hahn1 and Kirby2, whose parameters reach 1e-7, the
    ``max(1, |xᵢ|)`` rule ends 2-5 digits from the certified values; this one at 7+).
    The price is rounding: a shorter step divides ``f``'s rounding error by a smaller
    h (NIST's Lanczos3 ends near 5 digits with either rule).
    """
    default = eps ** (1 / 3) if scheme == "3-point" else math.sqrt(eps)
    groups = None if sparsity is None else column_groups(sparsity)
    minpack = minpack and scheme == "2-point"
    if numpy_fun is not None and scheme != "cs":
        return NumpyDifference(numpy_fun, scheme, default, rel_step, sparsity, groups, minpack)

    def jac(x: Tensor, f0: Tensor | None = None) -> Tensor:
        n = x.numel()
        sign = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
        h = default * sign * torch.clamp(x.abs(), min=1.0)
        if minpack:
            s = torch.full_like(x, default) if rel_step is None else rel_step.clamp(min=default)
            h = s * x.abs()
            h = torch.where(h == 0, s, h)
        elif rel_step is not None:
            # A requested relative step is relative to |x| itself (scipy's rule), unless
            # that step vanishes (x = 0).
            given = rel_step * sign * x.abs()
            h = torch.where((x + given) - x == 0, h, given)
        h = (x + h) - x  # a step the arithmetic represents exactly
        if scheme == "2-point" and f0 is None:
            f0 = fun(x)
        J: Tensor | None = None
        for cols in groups if groups is not None else [[j] for j in range(n)]:
            e = torch.zeros_like(x)
            e[cols] = h[cols]
            if scheme == "2-point":
                assert f0 is not None
                up = fun(x + e)
                _same_count(up.numel(), f0.numel())
                diff, div = up - f0, 1.0
            elif scheme == "cs":
                assert complex_fun is not None
                diff, div = complex_fun(x + 1j * e).imag.to(x.dtype), 1.0
            else:
                diff, div = fun(x + e) - fun(x - e), 2.0
            if J is None:
                J = torch.zeros(diff.numel(), n, dtype=torch.float64)
            for j in cols:
                col = diff / (div * h[j])
                J[:, j] = col if sparsity is None else torch.where(sparsity[:, j], col, 0.0)
        assert J is not None
        return J

    return jac


class NumpyDifference:
    """:func:`finite_difference`'s real schemes for a NumPy ``fun``, computed in NumPy.

    A :class:`JacobianFn` on tensors; :meth:`of_arrays` is the same Jacobian on NumPy
    arrays, for a caller that holds the point and ``f(x)`` as arrays already (the
    fitting problem of a few parameters), so no tensor is made or read per call.
    """

    def __init__(
        self,
        fun: Callable[[np.ndarray], np.ndarray],
        scheme: str,
        default: float,
        rel_step: Tensor | None,
        sparsity: Tensor | None,
        groups: list[list[int]] | None,
        minpack: bool = False,
    ) -> None:
        self.fun = fun
        self.scheme = scheme
        self.default = default
        self.rel = None if rel_step is None else rel_step.numpy()
        self.pattern = None if sparsity is None else sparsity.numpy()
        self.groups = groups
        self.minpack = minpack
        #: MINPACK's relative step ``max(rel_step, √eps)`` (a number without rel_step).
        self.step: float | np.ndarray = (
            default if self.rel is None else np.maximum(self.rel, default)
        )

    def __call__(self, x: Tensor, f0: Tensor | None = None) -> Tensor:
        """J at ``x`` (``f0 = f(x)`` when known: the forward scheme then skips that call)."""
        xn = (x.detach() if x.requires_grad else x).numpy()
        return torch.from_numpy(self.of_arrays(xn, None if f0 is None else f0.numpy()))

    def of_arrays(self, xn: np.ndarray, f0: np.ndarray | None = None) -> np.ndarray:
        """J at the NumPy point ``xn`` as an ``(m, n)`` array; ``f0``: ``f(xn)`` when known."""
        n = xn.size
        if self.minpack:
            s = self.step
            h = s * np.abs(xn)
            if np.count_nonzero(h) < n:  # h = s where xᵢ = 0
                h = np.where(h == 0, s, h)
        else:
            sign = np.where(xn >= 0, 1.0, -1.0)
            h = self.default * sign * np.maximum(np.abs(xn), 1.0)
            if self.rel is not None:
                given = self.rel * sign * np.abs(xn)
                h = np.where((xn + given) - xn == 0, h, given)
        h = (xn + h) - xn  # a step the arithmetic represents exactly
        fun, base = self.fun, None
        if self.scheme == "2-point":
            base = f0 if f0 is not None else fun(xn)
        groups, pattern = self.groups, self.pattern
        if groups is None:
            return _columns(fun, xn, h, base)
        J: np.ndarray | None = None
        for cols in groups:
            # x ± e with e = h on cols, 0 elsewhere: x + 0 is x, so only cols change.
            up = xn.copy()
            up[cols] = xn[cols] + h[cols]
            if base is not None:
                f_up = fun(up)
                _same_count(f_up.size, base.size)
                diff, div = f_up - base, 1.0
            else:
                down = xn.copy()
                down[cols] = xn[cols] - h[cols]
                diff, div = fun(up) - fun(down), 2.0
            if J is None:
                J = np.zeros((diff.size, n))
            for j in cols:
                col = diff / (div * h[j])
                J[:, j] = col if pattern is None else np.where(pattern[:, j], col, 0.0)
        assert J is not None
        return J


def _columns(
    fun: Callable[[np.ndarray], np.ndarray], x: np.ndarray, h: np.ndarray, base: np.ndarray | None
) -> np.ndarray:
    """J by one perturbed point per column, all columns divided at once (no sparsity).

    Row ``j`` of the points is ``x`` with ``xⱼ + hⱼ`` (the other entries copied, not
    added to 0, so a -0.0 stays -0.0): the points, differences and quotients of the
    column loop, so the same J to the last bit, with one division for all columns.
    ``base``: ``f(x)`` for the forward scheme; ``None`` takes central differences.
    """
    n = x.size
    diagonal = np.arange(n)
    up = np.empty((n, n))
    up[:] = x
    up[diagonal, diagonal] = x + h
    if base is not None:
        # (f(x + hⱼeⱼ) - f(x)) / hⱼ; the loop's divisor 1.0·hⱼ is hⱼ exactly.
        rows = _rows(fun, up)
        _same_count(rows.shape[1], base.size)
        return ((rows - base) / h[:, None]).T
    down = np.empty((n, n))
    down[:] = x
    down[diagonal, diagonal] = x - h
    return ((_rows(fun, up) - _rows(fun, down)) / (2.0 * h)[:, None]).T


def _rows(fun: Callable[[np.ndarray], np.ndarray], points: np.ndarray) -> np.ndarray:
    """``fun`` at each row of ``points``, one row of the result per point."""
    first = fun(points[0])
    out = np.empty((points.shape[0], first.size))
    out[0] = first
    for j in range(1, points.shape[0]):
        f = fun(points[j])
        _same_count(f.size, first.size)  # a size-1 result would broadcast into the row
        out[j] = f
    return out


def _same_count(rows: int, expected: int) -> None:
    """Refuse a finite-difference evaluation whose residual count is not the base point's."""
    if rows != expected:
        raise ValueError(
            f"fun returned {rows} residuals at a point but {expected} at another: the number "
            "of residuals must not depend on x. Make fun return the same shape for every x "
            "(mask entries with zeros rather than dropping them)."
        )
