"""The user's residual and Jacobian functions, adapted to float64 tensors of the right shape.

:func:`least_squares` accepts ``fun`` written with torch (differentiated exactly by
``torch.func``) or with NumPy (differentiated by finite differences unless a ``jac``
callable is given).  The adapters here turn either into ``Tensor -> Tensor`` maps on a
flat float64 vector and check what the user's functions return, naming the function,
the value and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.func import jacfwd, jacrev

__all__ = [
    "CallCounter",
    "JacobianFn",
    "finite_difference",
    "flat_residuals",
    "jacobian_function",
    "output_eps",
    "residual_function",
]

Fn = Callable[[Tensor], Tensor]


class JacobianFn(Protocol):
    """``J(x)``, ``(m, n)``; ``f0``, when given, is already known to be ``f(x)``."""

    def __call__(self, x: Tensor, f0: Tensor | None = None) -> Tensor:
        """The Jacobian at ``x`` (finite differences reuse ``f0`` instead of calling f)."""
        ...


class CallCounter:
    """The user's ``fun`` wrapped to count its calls, so ``nfev`` is what was called.

    ``calls`` counts every call; ``jacobian_calls`` those made inside an autodiff
    Jacobian (``torch.func.jacfwd``/``jacrev`` call ``fun`` once per Jacobian).  The
    value count reported as ``nfev`` is ``calls - jacobian_calls``: residual values,
    finite-difference columns and geodesic second derivatives alike.
    """

    def __init__(self, fun: Callable[..., Any]) -> None:
        self.fun = fun
        self.calls = 0
        self.jacobian_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``fun(*args, **kwargs)``, counted."""
        self.calls += 1
        return self.fun(*args, **kwargs)

    @property
    def value_calls(self) -> int:
        """Calls outside autodiff Jacobians (scipy's ``nfev`` for method="lm")."""
        return self.calls - self.jacobian_calls


def output_eps(values: Any) -> float:
    """Machine epsilon of the residuals ``fun`` returned: float64's, or a coarser dtype's.

    The residuals are carried in float64, but a ``fun`` computing in float32 (or float16)
    resolves changes only down to its own epsilon; the finite-difference step is sized
    from the coarser of the two (scipy's rule since gh-12991).
    """
    dtype = values.dtype if isinstance(values, Tensor) else np.asarray(values).dtype
    eps = float(np.finfo(np.float64).eps)
    if isinstance(dtype, torch.dtype):
        return max(eps, float(torch.finfo(dtype).eps)) if dtype.is_floating_point else eps
    return max(eps, float(np.finfo(dtype).eps)) if np.issubdtype(dtype, np.floating) else eps


def residual_function(
    fun: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *, numpy_fun: bool
) -> Fn:
    """``x ↦ fun(x, *args, **kwargs)`` flattened to float64; NumPy funs see arrays."""
    if numpy_fun:

        def from_numpy(x: Tensor) -> Tensor:
            return flat_residuals(fun(x.detach().numpy(), *args, **kwargs), numpy_fun=True)

        return from_numpy

    def from_torch(x: Tensor) -> Tensor:
        return flat_residuals(fun(x, *args, **kwargs), numpy_fun=False)

    return from_torch


def flat_residuals(raw: Any, *, numpy_fun: bool) -> Tensor:
    """What ``fun`` returned as flat float64 residuals, checked to be real floating point."""
    if numpy_fun:
        arr = np.asarray(raw)
        if not np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"fun must return real floating-point residuals, got dtype {arr.dtype}")
        return torch.from_numpy(arr.astype(np.float64).reshape(-1).copy())
    if not isinstance(raw, Tensor):
        raise TypeError(f"fun returned {type(raw).__name__}, expected a tensor")
    if not raw.is_floating_point():
        raise TypeError(f"fun must return real floating-point residuals, got {raw.dtype}")
    return raw.reshape(-1).to(torch.float64)


def jacobian_function(
    jac: str | Callable[..., Any],
    residuals: Fn,
    *,
    numpy_fun: bool,
    shape: tuple[int, int],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    eps: float = float(torch.finfo(torch.float64).eps),
    counter: CallCounter | None = None,
) -> JacobianFn:
    """``x ↦ J(x)``, ``(m, n)``, by the strategy ``jac`` names.

    A callable is the user's Jacobian (checked for shape); a NumPy ``fun`` or
    ``"2-point"``/``"3-point"`` take finite differences of ``residuals``; otherwise
    ``torch.func`` differentiates it: forward mode when residuals outnumber parameters
    (``"auto"`` with ``m ≥ n``: n JVPs), reverse mode otherwise (m VJPs).  Either
    transform calls ``fun`` once per Jacobian; those calls are booked on ``counter``'s
    ``jacobian_calls`` (njev), not as value evaluations.
    """
    if callable(jac):
        user = _user_jacobian(jac, numpy_fun=numpy_fun, shape=shape, args=args, kwargs=kwargs)

        def given(x: Tensor, f0: Tensor | None = None) -> Tensor:
            return user(x)

        return given
    if numpy_fun or jac in ("2-point", "3-point"):
        # A NumPy fun with jac="fwd" or "rev" gets the central scheme: any name other than
        # "2-point" is central in finite_difference (kept as it was).
        return finite_difference(residuals, "2-point" if jac == "auto" else str(jac), eps=eps)
    m, n = shape
    mode = jac if jac != "auto" else ("fwd" if m >= n else "rev")
    transform: Fn = jacfwd(residuals) if mode == "fwd" else jacrev(residuals)

    def autodiff(x: Tensor, f0: Tensor | None = None) -> Tensor:
        before = counter.calls if counter is not None else 0
        J = transform(x)
        if counter is not None:
            counter.jacobian_calls += counter.calls - before
        return J

    return autodiff


def _user_jacobian(
    jac: Callable[..., Any],
    *,
    numpy_fun: bool,
    shape: tuple[int, int],
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> Fn:
    """The user's ``jac(x, *args, **kwargs)`` as a float64 tensor, checked to be ``(m, n)``."""
    m, n = shape

    def user_jac(x: Tensor) -> Tensor:
        arg: Any = x.detach().numpy() if numpy_fun else x
        raw = jac(arg, *args, **kwargs)
        if raw is None:
            raise ValueError("jac returned None; expected an (m, n) array")
        J = torch.as_tensor(np.asarray(raw, dtype=np.float64) if numpy_fun else raw)
        if tuple(J.shape) != (m, n):
            raise ValueError(
                f"jac returned shape {tuple(J.shape)}; expected (m, n) = ({m}, {n}) "
                "(residuals by parameters)"
            )
        return J.to(torch.float64)

    return user_jac


def finite_difference(
    fun: Fn, scheme: str, *, eps: float = float(torch.finfo(torch.float64).eps)
) -> JacobianFn:
    """The Jacobian of ``fun`` by finite differences, one column per parameter.

    ``"2-point"`` is the forward difference ``(f(x + h eᵢ) - f(x)) / h`` with
    ``h = √eps·max(1, |xᵢ|)`` (error O(h), one evaluation per column); any other scheme
    is the central difference ``(f(x + h eᵢ) - f(x - h eᵢ)) / 2h`` with
    ``h = eps^(1/3)·max(1, |xᵢ|)`` (error O(h²), two evaluations per column).
    ``eps`` is the precision ``fun`` computes in (:func:`output_eps`): a float32 ``fun``
    needs steps about 2900 times longer than a float64 one, or ``f(x + h eᵢ) - f(x)``
    is rounding noise.  The forward scheme takes ``f(x)`` from ``f0`` when the caller
    already has it (so a Jacobian costs n calls of ``fun``, as MINPACK's does).
    """

    def jac(x: Tensor, f0: Tensor | None = None) -> Tensor:
        if scheme == "2-point" and f0 is None:
            f0 = fun(x)
        cols = []
        for i in range(x.numel()):
            if scheme == "2-point":
                h = math.sqrt(eps) * max(1.0, abs(float(x[i])))
                e = torch.zeros_like(x)
                e[i] = h
                assert f0 is not None
                cols.append((fun(x + e) - f0) / h)
            else:
                h = eps ** (1 / 3) * max(1.0, abs(float(x[i])))
                e = torch.zeros_like(x)
                e[i] = h
                cols.append((fun(x + e) - fun(x - e)) / (2 * h))
        return torch.stack(cols, dim=1)

    return jac
