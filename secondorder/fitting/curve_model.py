"""``f(xdata, *p)`` and the data as the residuals that ``least_squares`` minimises.

:func:`~.curve_fit.curve_fit` reads its data (:func:`data`), its weights
(:func:`weighting`: ``W = diag(1/sigma)`` or ``L⁻¹`` for a covariance ``sigma = L Lᵀ``)
and turns ``f`` into ``W (f(xdata, *p) - ydata)``: on tensors when torch can
differentiate ``f`` (:func:`torch_friendly`), on NumPy arrays otherwise.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .arrays import as_float64

__all__ = [
    "Weight",
    "count_params",
    "data",
    "fixed_params",
    "jacobian_from_arrays",
    "jacobian_on_arrays",
    "jacobian_on_tensors",
    "residuals_on_arrays",
    "residuals_on_tensors",
    "runs_on_arrays",
    "same_on_arrays",
    "torch_friendly",
    "weighting",
]

Weight = Callable[[Tensor], Tensor]


def data(
    xdata: Any, ydata: Any, sigma: Any, *, check_finite: bool | None, nan_policy: str | None
) -> tuple[Tensor, Any, Any]:
    """``(y, x, sigma)``: ``ydata`` flat float64; ``xdata`` float64 when numeric.

    ``check_finite`` defaults to ``True``, or ``False`` when a ``nan_policy`` is given
    (scipy's rule); ``nan_policy="omit"`` drops the points where ``xdata`` (along its
    last axis) or ``ydata`` is NaN, and the matching entries of ``sigma``.
    """
    y = as_float64(ydata, "ydata").reshape(-1)
    if y.numel() == 0:
        raise ValueError("ydata must not be empty")
    finite_check = check_finite if check_finite is not None else nan_policy is None
    if finite_check and not bool(torch.isfinite(y).all()):
        raise ValueError(
            "ydata contains NaN or inf (check_finite=True): clean the data, or pass "
            "nan_policy='omit' to drop NaN points"
        )
    x: Any = xdata
    if isinstance(xdata, (Tensor, np.ndarray, list, tuple, int, float)):
        try:
            x = as_float64(xdata, "xdata")
        except TypeError:
            x = xdata
        if isinstance(x, Tensor) and finite_check and not bool(torch.isfinite(x).all()):
            raise ValueError(
                "xdata contains NaN or inf (check_finite=True): clean the data, or pass "
                "nan_policy='omit' to drop NaN points"
            )
    if nan_policy is None:
        return y, x, sigma
    x_nan = torch.zeros_like(y, dtype=torch.bool)
    if isinstance(x, Tensor) and x.ndim >= 1 and x.shape[-1] == y.numel():
        x_nan = torch.isnan(x).reshape(-1, y.numel()).any(0)
    nan = x_nan | torch.isnan(y)
    if nan_policy == "raise":
        if bool(nan.any()):
            raise ValueError(
                f"The input contains nan values ({int(nan.sum())} points, nan_policy='raise'): "
                "clean the data, or pass nan_policy='omit' to drop them"
            )
        return y, x, sigma
    keep = ~nan
    if isinstance(x, Tensor) and x.ndim >= 1 and x.shape[-1] == y.numel():
        x = x[..., keep]
    if sigma is not None:
        s = as_float64(sigma, "sigma")
        if s.shape == (y.numel(),):
            sigma = s[keep]
        elif s.shape == (y.numel(), y.numel()):
            sigma = s[keep][:, keep]
    return y[keep], x, sigma


def weighting(sigma: Any, m: int) -> Weight:
    """``r ↦ W r``: identity, ``r / sigma`` for a scalar or ``m`` deviations, ``L⁻¹ r``."""
    if sigma is None:
        return _unweighted
    s = as_float64(sigma, "sigma")
    if s.numel() == 1 or s.shape == (m,):
        s = s.reshape(-1)
        if not bool((torch.isfinite(s) & (s > 0)).all()):
            raise ValueError("sigma must be finite and > 0 everywhere")
        inv = 1.0 / s

        def diagonal(r: Tensor) -> Tensor:
            return r * inv.to(r.dtype)

        return diagonal
    if s.shape == (m, m):
        L, info = torch.linalg.cholesky_ex(s)
        if int(info) != 0:
            raise ValueError(
                "sigma, given as an (m, m) covariance matrix, must be symmetric positive definite"
            )

        def whiten(r: Tensor) -> Tensor:
            return torch.linalg.solve_triangular(L.to(r.dtype), r.reshape(-1, 1), upper=False)[:, 0]

        return whiten
    raise ValueError(
        f"sigma must be a scalar or have shape ({m},) or ({m}, {m}) to match ydata, got "
        f"{tuple(s.shape)}"
    )


def _unweighted(r: Tensor) -> Tensor:
    return r


def torch_friendly(f: Callable[..., Any], x: Any, p: Tensor) -> bool:
    """Whether ``f`` accepts tensors and can be differentiated by torch.func.

    A function written with NumPy either fails on tensors, returns an array, or makes
    NumPy warn about tensors; any of these sends it down the finite-difference path.
    One call of ``f`` decides (a forward-mode derivative, which also runs the values).
    """

    def values(q: Tensor) -> tuple[Tensor, Tensor]:
        out = f(x, *q.unbind(0))
        if not isinstance(out, Tensor):
            raise TypeError("not a tensor")
        return out, out

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.func.jacfwd(values, has_aux=True)(p)
        except Exception:
            return False
    # NumPy ufuncs applied to tensors return tensors but warn about ``__array_wrap__``.
    return not any("__array" in str(w.message) for w in caught)


def same_on_arrays(f: Callable[..., Any], x: Any, p: Tensor) -> bool:
    """Whether ``f`` gives NumPy data the values it gives the same data as tensors.

    A model written for NumPy may also run on tensors with other meanings (``x.std()``
    divides by n in NumPy, by n - 1 in torch; ``x.repeat(2)`` repeats elements in
    NumPy and tiles in torch): at the start ``p`` both must agree, or the fit runs on
    the arrays the user passed.  A model that fails on arrays is a torch model.
    """
    try:
        on_arrays = np.asarray(_call_on_arrays(f, x, p), dtype=np.complex128)
    except Exception:
        return True
    on_tensors = f(x, *p.unbind(0))
    if not isinstance(on_tensors, Tensor):
        return False
    t = on_tensors.detach().to(torch.complex128).numpy()
    if t.shape != on_arrays.shape:
        return False
    scale = float(np.max(np.abs(t), initial=0.0))
    return bool(np.allclose(on_arrays, t, rtol=1e-9, atol=1e-12 * scale, equal_nan=True))


def residuals_on_tensors(f: Callable[..., Any], x: Any, y: Tensor, weight: Weight) -> Any:
    """``q ↦ W (f(x, *q) - y)`` on tensors, differentiable by torch.func."""
    m = y.numel()

    def check(pred: Any) -> Tensor:
        t = pred if isinstance(pred, Tensor) else as_float64(pred, "f(xdata, *p)")
        t = t.reshape(-1).to(torch.complex128 if t.is_complex() else torch.float64)
        if t.numel() != m and m != 1:
            raise ValueError(
                f"f(xdata, *p) returned {t.numel()} values but ydata has {m}; they must match"
            )
        return t

    def residuals(q: Tensor) -> Tensor:
        return weight(check(f(x, *q.unbind(0))) - y)

    return residuals


def residuals_on_arrays(f: Callable[..., Any], x: Any, y: Tensor, weight: Weight) -> Any:
    """``q ↦ W (f(x, *q) - y)`` on NumPy arrays (``x`` passed as an array when numeric)."""
    m = y.numel()
    x_np = x.numpy() if isinstance(x, Tensor) else x
    y_np = y.numpy()

    def residuals(q: Any) -> Any:
        raw = np.asarray(f(x_np, *q))
        # A complex q is jac="cs" probing f at x + ih: keep the imaginary part.
        pred = raw.reshape(-1).astype(np.complex128 if np.iscomplexobj(raw) else np.float64)
        if pred.size != m and m != 1:
            raise ValueError(
                f"f(xdata, *p) returned {pred.size} values but ydata has {m}; they must match"
            )
        return weight(torch.from_numpy(pred - y_np)).numpy()

    return residuals


def jacobian_on_arrays(
    jac: Callable[..., Any], x: Any, weight: Weight, *, shape: tuple[int, int]
) -> Callable[[Any], Any]:
    """``q ↦ W·jac(x, *q)``: the user's Jacobian of ``f``, weighted like the residuals."""
    x_np = x.numpy() if isinstance(x, Tensor) else x
    weighted = _weighted(jac, weight, shape)

    def call(q: Any) -> Any:
        return weighted(jac(x_np, *q)).numpy()

    return call


def runs_on_arrays(jac: Callable[..., Any], x: Any, p: Tensor) -> bool:
    """Whether a user's ``jac`` is a NumPy function: it returns an array for arrays."""
    try:
        out = _call_on_arrays(jac, x, p)
    except Exception:
        return False
    return not isinstance(out, Tensor) and np.asarray(out).dtype.kind in "fcib"


def jacobian_from_arrays(
    jac: Callable[..., Any], x: Any, weight: Weight, *, shape: tuple[int, int]
) -> Callable[[Tensor], Tensor]:
    """:func:`jacobian_on_arrays` for a torch ``f`` on NumPy data whose ``jac`` is NumPy's."""
    on_arrays = jacobian_on_arrays(jac, x, weight, shape=shape)

    def call(q: Tensor) -> Tensor:
        return torch.from_numpy(on_arrays(q.detach().numpy()))

    return call


def _call_on_arrays(g: Callable[..., Any], x: Any, p: Tensor) -> Any:
    """``g(x, *p)`` with ``x`` and ``p`` as NumPy values, NumPy's warnings silenced."""
    x_np = x.numpy() if isinstance(x, Tensor) else x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return g(x_np, *p.tolist())


def jacobian_on_tensors(
    jac: Callable[..., Any], x: Any, weight: Weight, *, shape: tuple[int, int]
) -> Callable[[Tensor], Tensor]:
    """``q ↦ W·jac(x, *q)`` for a torch ``f``: ``jac`` gets tensors, as ``f`` does."""
    weighted = _weighted(jac, weight, shape)

    def call(q: Tensor) -> Tensor:
        return weighted(jac(x, *q.unbind(0)))

    return call


def _weighted(
    jac: Callable[..., Any], weight: Weight, shape: tuple[int, int]
) -> Callable[[Any], Tensor]:
    m, n = shape

    def weighted(raw: Any) -> Tensor:
        J = as_float64(raw, "jac(xdata, *p)")
        if J.ndim != 2 or J.shape[1] != n or (J.shape[0] != m and m != 1):
            raise ValueError(f"jac(xdata, *p) must return shape ({m}, {n}), got {tuple(J.shape)}")
        return torch.stack([weight(J[:, j]) for j in range(n)], dim=1)

    return weighted


def count_params(f: Callable[..., Any]) -> int:
    """Parameters of ``f(x, p1, p2, ...)``, for ``p0=None`` (scipy's rule)."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            "p0 is None and the number of parameters of f cannot be read from its "
            "signature; pass p0"
        ) from exc
    count = _positional(sig)
    if count < 2:
        raise ValueError(
            f"p0 is None and f{sig} takes no parameters after x; pass p0 or write f(x, p1, p2, ...)"
        )
    return count - 1


def fixed_params(f: Callable[..., Any]) -> int | None:
    """The parameters ``f(x, p1, ..., pn)`` takes after ``x``; ``None`` where not fixed.

    Not fixed: ``f`` takes ``*args``, or its signature cannot be read.
    """
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        return None
    return max(0, _positional(sig) - 1)


def _positional(sig: inspect.Signature) -> int:
    """The parameters of ``sig`` that a positional argument can fill (``x`` included)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in sig.parameters.values())
