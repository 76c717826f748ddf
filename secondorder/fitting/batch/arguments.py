"""Checking and converting the arguments of the batched fits, before anything runs.

Every function here either returns the argument in the form the engine uses (tensors
of the fits' dtype and device, ``(B, n)`` bounds and starts, ``1/σ``) or raises an
error that names the argument, the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..._validation import check_choice, check_number
from ..curve_model import count_params, fixed_params
from ..losses import LOSSES

__all__ = [
    "EPS",
    "as_tensor",
    "bounds_pair",
    "check_loss",
    "column_model",
    "counts",
    "dtype_device",
    "feasible",
    "on_device",
    "parameter_count",
    "per_fit",
    "short",
    "starts",
    "tolerances",
    "x_scale",
    "xdata",
]

EPS = float(np.finfo(np.float64).eps)


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def dtype_device(
    dtype: torch.dtype | None, device: Any, ydata: Any, p0: Any, *, fix: str | None = None
) -> tuple[torch.dtype, torch.device]:
    """The computation's dtype and device: given, else the data's, else float64 on the CPU.

    ``fix``: what to do about data of another dtype (default: pass ``dtype=``).
    """
    if dtype is not None and dtype not in (torch.float32, torch.float64):
        raise ValueError(f"Invalid dtype={dtype!r}: must be torch.float32 or torch.float64.")
    source = next((t for t in (ydata, p0) if isinstance(t, Tensor) and t.is_floating_point()), None)
    if dtype is None:
        dtype = source.dtype if source is not None else torch.float64
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"the data's dtype {dtype} is not supported: "
                + (fix or "pass float32 or float64 tensors, or dtype=torch.float32 / torch.float64")
            )
    try:
        dev = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"Invalid device={device!r}: {exc}") from None
    if dev is None:
        dev = source.device if source is not None else torch.device("cpu")
    if dev.type == "meta":
        where = f"Invalid device={device!r}" if device is not None else "The data are on 'meta'"
        raise ValueError(f"{where}: a fit computes numbers; pass data on a real device (cpu, cuda)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"Invalid device={str(dev)!r}: torch sees no CUDA device (torch "
            f"{torch.__version__}); use device='cpu' or a CUDA build of torch on a GPU"
        )
    return dtype, dev


def as_tensor(name: str, value: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a real tensor of ``dtype`` on ``device`` (an error names ``name``)."""
    if isinstance(value, Tensor):
        if value.is_complex():
            raise ValueError(f"{name} must be real, got a complex tensor")
        return value.detach().to(device=device, dtype=dtype)
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an array of numbers, got {short(value)}") from exc
    return torch.as_tensor(arr, dtype=dtype, device=device)


def xdata(xdata: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``xdata`` as a tensor on the fits' device when it is numeric, else as given."""
    if isinstance(xdata, Tensor):
        return xdata.detach().to(device=device, dtype=dtype)
    if isinstance(xdata, (np.ndarray, list, tuple, int, float)):
        try:
            return torch.as_tensor(np.asarray(xdata, dtype=np.float64), dtype=dtype, device=device)
        except (TypeError, ValueError):
            return xdata
    return xdata


def per_fit(x: Any, flag: bool | None, b: int, m: int) -> bool:
    """Whether ``xdata`` holds one row per fit: ``flag``, or its shape starting ``(B, m)``.

    A 2-D ``(B, m)`` xdata is also scipy's shared ``(k, m)`` coordinates with ``k = B``:
    with more than one fit, ``flag`` must then say which.
    """
    if flag is not None and not isinstance(flag, bool):
        raise TypeError(f"xdata_per_fit must be None, True or False, got {flag!r}")
    leading = isinstance(x, Tensor) and x.ndim >= 2 and tuple(x.shape[:2]) == (b, m)
    if flag is None:
        if leading and x.ndim == 2 and b > 1:
            raise ValueError(
                f"xdata of shape ({b}, {m}) with {b} fits of {m} points reads two ways: one "
                f"row of x per fit, or scipy's shared (k, m) coordinates with k = {b}; pass "
                "xdata_per_fit=True for the first, xdata_per_fit=False for the second"
            )
        return leading
    if flag and not leading:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"xdata_per_fit=True needs xdata of shape (B, m, ...) = ({b}, {m}, ...), got {shape}"
        )
    return flag


def parameter_count(f: Callable[..., Any], p0: Any) -> int:
    """``n``: the last dimension of ``p0``, else the parameters of ``f`` after ``x``.

    Where ``f``'s signature fixes its parameters (no ``*args``), ``p0`` must match it.
    """
    if p0 is None:
        return count_params(f)
    shape = tuple(p0.shape) if isinstance(p0, Tensor) else np.shape(p0)
    if len(shape) not in (1, 2) or shape[-1] == 0:
        raise ValueError(f"p0 must be (n,) or (B, n) with n > 0 parameters, got shape {shape}")
    n = int(shape[-1])
    fixed = fixed_params(f)
    if fixed is not None and fixed != n:
        raise ValueError(
            f"p0 has {n} parameters per fit but f takes {fixed} after x; pass p0 of shape "
            f"({fixed},) or (B, {fixed})"
        )
    return n


def starts(
    f: Callable[..., Any],
    p0: Any,
    b: int,
    n: int,
    lb: Tensor,
    ub: Tensor,
    dtype: torch.dtype,
    device: torch.device,
    *,
    name: str,
) -> Tensor:
    """``(B, n)`` starts: ``p0`` broadcast, or scipy's default (ones; feasible in bounds)."""
    if p0 is None:
        p = torch.ones(b, n, dtype=dtype, device=device)
        lo, hi = torch.isfinite(lb), torch.isfinite(ub)
        p = torch.where(lo & hi, 0.5 * (lb + ub), p)
        p = torch.where(lo & ~hi, lb + 1, p)
        return torch.where(~lo & hi, ub - 1, p)
    p = as_tensor(name, p0, dtype, device)
    if p.ndim == 1:
        p = p.expand(b, n)
    if p.shape != (b, n):
        raise ValueError(f"{name} must be (n,) or (B, n) = ({b}, {n}), got {tuple(p.shape)}")
    return p.clone()


def bounds_pair(
    bounds: Any, b: int, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(lb, ub)`` as ``(B, n)`` tensors; each side a scalar, ``(n,)`` or ``(B, n)``."""
    if bounds is None:
        bounds = (-math.inf, math.inf)
    if hasattr(bounds, "lb") and hasattr(bounds, "ub"):  # scipy.optimize.Bounds
        bounds = (bounds.lb, bounds.ub)
    if isinstance(bounds, (Tensor, np.ndarray)) and bounds.ndim >= 1 and bounds.shape[0] == 2:
        bounds = (bounds[0], bounds[1])  # one array of (lb, ub), as scipy accepts
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"bounds must be a pair (lb, ub), got {short(bounds)}")
    sides = []
    for side, value in zip(("lb", "ub"), bounds, strict=True):
        t = as_tensor(f"bounds {side}", value, dtype, device)
        if t.ndim == 0 or t.shape in ((n,), (b, n)):
            t = t.expand(b, n)
        else:
            raise ValueError(
                f"bounds {side} must be a scalar, ({n},) or ({b}, {n}), got {tuple(t.shape)}"
            )
        if bool(torch.isnan(t).any()):
            raise ValueError(f"bounds {side} contains NaN")
        sides.append(t)
    lb, ub = sides
    crossed = lb >= ub
    if bool(crossed.any()):
        fit, j = (int(i) for i in torch.nonzero(crossed)[0])
        raise ValueError(
            f"Each lower bound must be strictly less than each upper bound: bounds lb="
            f"{float(lb[fit, j])!r} >= ub={float(ub[fit, j])!r} for parameter {j} of fit "
            f"{fit}; pass lb < ub (a parameter to hold fixed belongs in f, not in bounds)"
        )
    return lb, ub


def feasible(p: Tensor, lb: Tensor, ub: Tensor, *, name: str = "p0") -> None:
    """Refuse starts outside the bounds, naming the argument (``name``) and the first such fit."""
    outside = (p < lb) | (p > ub)
    if bool(outside.any()):
        fit = int(torch.nonzero(outside.any(-1))[0])
        raise ValueError(
            f"{name} is outside the bounds for fit {fit}: {name}={p[fit].tolist()}, "
            f"lb={lb[fit].tolist()}, ub={ub[fit].tolist()}; pass starts within the bounds"
        )


def counts(y: Tensor) -> None:
    """Refuse a negative count (Poisson data), naming the first fit and point with one."""
    negative = y < 0
    if bool(negative.any()):
        fit, point = (int(i) for i in torch.nonzero(negative)[0])
        raise ValueError(
            f"ydata[{fit}, {point}]={float(y[fit, point])!r} with estimator='mle': Poisson "
            "counts must be >= 0 (a NaN fails its fit alone); fit data that can go negative, "
            "such as background-subtracted counts, with estimator='lse'"
        )


def check_loss(loss: Any, f_scale: Any) -> None:
    """``loss`` one of scipy's names (a string) and ``f_scale > 0``."""
    if not isinstance(loss, str):
        raise TypeError(
            f"loss must be one of {LOSSES} for batched fits (a callable loss runs on NumPy, "
            f"one fit at a time), got {loss!r}"
        )
    check_choice("loss", loss, LOSSES)
    check_number("f_scale", f_scale, above=0, type_error=False)


def tolerances(ftol: Any, xtol: Any, gtol: Any) -> tuple[float, float, float]:
    """``(ftol, xtol, gtol)`` as floats (``None`` is 0); at least one above eps."""
    values = {"ftol": ftol, "xtol": xtol, "gtol": gtol}
    for name, tol in values.items():
        if tol is not None:
            check_number(name, tol, at_least=0, type_error=False)
    tols = tuple(float(v or 0.0) for v in values.values())
    if all(t < EPS for t in tols):
        raise ValueError(
            f"At least one of the tolerances must be higher than machine epsilon "
            f"({EPS:.2e}), got ftol={ftol!r}, xtol={xtol!r}, gtol={gtol!r}: without one "
            "the iteration would stop only on max_nfev"
        )
    return tols[0], tols[1], tols[2]


def x_scale(
    x_scale: Any, b: int, n: int, dtype: torch.dtype, device: torch.device
) -> Tensor | None:
    """``None`` for ``"jac"`` (Moré's scaling), else the ``(B, n)`` fixed scales."""
    if isinstance(x_scale, str):
        if x_scale == "jac":
            return None
        raise ValueError(
            f"Invalid x_scale={x_scale!r}: must be 'jac' or positive numbers (a scalar, (n,) "
            "or (B, n))."
        )
    s = as_tensor("x_scale", x_scale, dtype, device)
    if s.ndim == 0 or s.shape in ((n,), (b, n)):
        s = s.expand(b, n)
    else:
        raise ValueError(
            f"x_scale must be 'jac', a scalar, ({n},) or ({b}, {n}), got {tuple(s.shape)}"
        )
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(f"Invalid x_scale={short(x_scale)}: must be finite and > 0 everywhere.")
    return s.clone()


def on_device(name: str, out: Tensor, device: torch.device) -> Tensor:
    """``out`` (what ``name`` returned) if it is on the fits' ``device``, else an error."""
    if out.device != device:
        raise ValueError(
            f"{name} must return a tensor on the fits' device {device}, got one on "
            f"{out.device}: make its constants on the device of the parameters (or xdata), "
            "e.g. torch.as_tensor(c, device=x.device), or run the fits on its device"
        )
    return out


def column_model(f: Callable[..., Any], n: int, m: int) -> Callable[[list[Tensor], Any], Tensor]:
    """``(columns, xs) -> f(xs, *columns)`` as ``(B, m)``, each column ``(B, 1)``."""

    def call(cols: list[Tensor], xs: Any) -> Tensor:
        out = f(xs, *cols)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"f must return a tensor (write it with torch operations), got {type(out).__name__}"
            )
        on_device("f", out, cols[0].device)
        dtype = cols[0].dtype
        if out.dtype != dtype:
            # f - ydata would promote a float32 model to float64 fits silently: the fits
            # would then carry float32 answers under a float64 label.
            raise TypeError(
                f"f must return a tensor of the fits' dtype {dtype}, got {out.dtype}: "
                f"compute in the parameters' dtype (they come as (B, 1) {dtype} columns; "
                "a constant or xdata of another dtype changes it), or pass dtype= for the "
                "precision the model computes in"
            )
        want = (cols[0].shape[0], m)
        try:
            return torch.broadcast_to(out, want)
        except RuntimeError:
            raise ValueError(
                f"f returned shape {tuple(out.shape)} for {want[0]} fits; expected (B, m) = "
                f"{want}, or a shape that broadcasts to it (parameters come as (B, 1) columns)"
            ) from None

    return call
