"""The user's residual and Jacobian functions, adapted to float64 tensors of the right shape.

:func:`least_squares` accepts ``fun`` written with torch (differentiated exactly by
``torch.func``) or with NumPy (differentiated by finite differences unless a ``jac``
callable is given).  The adapters here turn either into ``Tensor -> Tensor`` maps on a
flat float64 vector and check what the user's functions return, naming the function,
the value and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import jacfwd, jacrev

from .differences import Fn, JacobianFn, finite_difference

__all__ = [
    "CallCounter",
    "auto_mode",
    "flat_residuals",
    "jacobian_function",
    "numpy_residuals",
    "output_eps",
    "residual_function",
]


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
            arr = np.asarray(fun(x.detach().numpy(), *args, **kwargs))
            if arr.dtype.kind != "f":  # flat_residuals' check, without its call
                raise TypeError(
                    f"fun must return real floating-point residuals, got dtype {arr.dtype}"
                )
            # One copy (astype copies), so the residuals never alias the user's array.
            return torch.from_numpy(arr.astype(np.float64).reshape(-1))

        return from_numpy

    def from_torch(x: Tensor) -> Tensor:
        return flat_residuals(fun(x, *args, **kwargs), numpy_fun=False)

    return from_torch


def numpy_residuals(
    counter: CallCounter, args: Sequence[Any], kwargs: dict[str, Any], *, owned: bool = False
) -> Callable[[np.ndarray], np.ndarray]:
    """``x ↦ fun(x, *args, **kwargs)`` for ``counter``'s NumPy ``fun``, flat float64, counted.

    The result may be the user's own array (no copy when it is float64 already): the
    finite differences that call this subtract or stack it at once.  ``owned``: always
    a fresh array, as :func:`residual_function`'s (residuals that are kept).  The call
    is counted here rather than through ``counter.__call__``: one Python call less.
    """
    fun = counter.fun

    def call(x: np.ndarray) -> np.ndarray:
        counter.calls += 1
        arr = np.asarray(fun(x, *args, **kwargs))
        if arr.dtype != np.float64:
            if arr.dtype.kind != "f":  # np.issubdtype(.., np.floating), without its cost
                raise TypeError(
                    f"fun must return real floating-point residuals, got dtype {arr.dtype}"
                )
            arr = arr.astype(np.float64)
        elif owned:
            arr = arr.copy()
        return arr if arr.ndim == 1 else arr.reshape(-1)

    return call


def flat_residuals(raw: Any, *, numpy_fun: bool) -> Tensor:
    """What ``fun`` returned as flat float64 residuals, checked to be real floating point."""
    if numpy_fun:
        arr = np.asarray(raw)
        if arr.dtype.kind != "f":  # np.issubdtype(.., np.floating), without its cost
            raise TypeError(f"fun must return real floating-point residuals, got dtype {arr.dtype}")
        # One copy (astype copies), so the residuals never alias the user's array.
        return torch.from_numpy(arr.astype(np.float64).reshape(-1))
    if not isinstance(raw, Tensor):
        raise TypeError(f"fun returned {type(raw).__name__}, expected a tensor")
    if not raw.is_floating_point():
        raise TypeError(f"fun must return real floating-point residuals, got {raw.dtype}")
    if raw.ndim == 1 and raw.dtype == torch.float64:
        # Already flat float64: inside jacrev a reshape and a cast are a view and a node
        # in the graph each, recorded and differentiated per Jacobian.
        return raw
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
    rel_step: Tensor | None = None,
    sparsity: Tensor | None = None,
    dense_only: bool = False,
    minpack: bool = False,
    flat_fun: Fn | None = None,
) -> JacobianFn:
    """``x ↦ J(x)``, ``(m, n)``, by the strategy ``jac`` names.

    A callable is the user's Jacobian (checked for shape; a scipy.sparse matrix is made
    dense unless ``dense_only``); a NumPy ``fun`` or ``"2-point"``/``"3-point"``/``"cs"``
    take finite differences of ``residuals`` (grouped by ``sparsity``); otherwise
    ``torch.func`` differentiates it: ``"auto"`` picks :func:`auto_mode` (reverse mode
    for small problems and when ``m < n``, forward mode for many residuals).  Either
    transform calls ``fun`` once per Jacobian; those calls are booked on ``counter``'s
    ``jacobian_calls`` (njev), not as value evaluations.  ``minpack``: forward
    differences take MINPACK's step (see :func:`~.differences.finite_difference`), as scipy's
    ``method="lm"`` does.  ``flat_fun``: the user's ``fun`` itself, for a torch
    ``fun`` of ``x`` alone whose residuals at ``x0`` came flat and float64: the
    transform then differentiates it without the adapter (whose checks, a call and a
    view inside every ``jacrev`` are much of a small problem's Jacobian cost); a J of
    another shape or dtype, or residuals torch.func refuses (residuals that changed
    form), are taken again through it.
    """
    if callable(jac):
        user = _user_jacobian(
            jac, numpy_fun=numpy_fun, shape=shape, args=args, kwargs=kwargs, dense_only=dense_only
        )

        def given(x: Tensor, f0: Tensor | None = None) -> Tensor:
            return user(x)

        return given
    if numpy_fun or jac in ("2-point", "3-point", "cs"):
        # A NumPy fun with jac="fwd" or "rev" gets the central scheme: any name other than
        # "2-point" and "cs" is central in finite_difference (kept as it was).
        scheme = "2-point" if jac == "auto" else str(jac)
        complex_fun = None
        if scheme == "cs":
            call = counter if counter is not None else None
            complex_fun = _complex_residuals(call, numpy_fun=numpy_fun, args=args, kwargs=kwargs)
        host = None
        if numpy_fun and counter is not None and scheme != "cs":
            host = numpy_residuals(counter, args, kwargs)
        return finite_difference(
            residuals,
            scheme,
            eps=eps,
            rel_step=rel_step,
            sparsity=sparsity,
            complex_fun=complex_fun,
            numpy_fun=host,
            minpack=minpack,
        )
    m, n = shape
    mode = jac if jac != "auto" else auto_mode(m, n)
    make = jacfwd if mode == "fwd" else jacrev
    transform: Fn = make(residuals)
    direct: Fn | None = None if flat_fun is None else make(flat_fun)

    def autodiff(x: Tensor, f0: Tensor | None = None) -> Tensor:
        if direct is not None:
            if counter is not None:  # one call of fun, made inside the transform
                counter.calls += 1
                counter.jacobian_calls += 1
            try:
                J = direct(x)
            except RuntimeError:
                # Residuals that are no longer a tensor (torch.func refuses them): the
                # adapter calls fun again and names what is wrong.
                J = None
            if J is not None and J.dtype == torch.float64 and J.shape == shape:
                return J
        before = counter.calls if counter is not None else 0
        J = transform(x)
        if counter is not None:
            counter.jacobian_calls += counter.calls - before
        return J

    return autodiff


#: ``jac="auto"`` takes reverse mode up to these sizes (see :func:`auto_mode`).
REVERSE_MAX_N = 16
REVERSE_MAX_M = 256


def auto_mode(m: int, n: int) -> str:
    """``"fwd"`` or ``"rev"``: the cheaper ``torch.func`` transform for an ``(m, n)`` J.

    By operation counts forward mode wins when residuals outnumber parameters (n JVPs
    against m VJPs).  But a small problem costs the transforms' fixed overhead, and
    there ``jacfwd`` pays for the Python decompositions its JVPs run through: on NIST's
    problems (n ≤ 9, m ≤ 250) ``jacrev`` is the faster, up to a tie at m = 250
    (``python -m benchmarks.nist_time --jac fwd`` against ``--jac rev``).  So reverse
    mode for n ≤ 16 and m ≤ 256 (and whenever m < n); forward otherwise.
    """
    if m < n or (n <= REVERSE_MAX_N and m <= REVERSE_MAX_M):
        return "rev"
    return "fwd"


def _complex_residuals(
    fun: Callable[..., Any] | None, *, numpy_fun: bool, args: Sequence[Any], kwargs: dict[str, Any]
) -> Callable[[Tensor], Tensor]:
    """``x ↦ fun(x)`` for a complex ``x``, flat complex128 (for the complex-step scheme)."""
    assert fun is not None

    def call(x: Tensor) -> Tensor:
        arg: Any = x.numpy() if numpy_fun else x
        out = fun(arg, *args, **kwargs)
        arr = out.detach().resolve_conj().numpy() if isinstance(out, Tensor) else np.asarray(out)
        if not np.iscomplexobj(arr):
            raise TypeError(
                f"jac='cs' (complex step) needs fun to keep the imaginary part of a complex x, "
                f"but fun returned dtype {arr.dtype}: pass jac='2-point' or '3-point'"
            )
        return torch.from_numpy(np.asarray(arr, dtype=np.complex128).reshape(-1).copy())

    return call


def _user_jacobian(
    jac: Callable[..., Any],
    *,
    numpy_fun: bool,
    shape: tuple[int, int],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    dense_only: bool = False,
) -> Fn:
    """The user's ``jac(x, *args, **kwargs)`` as a float64 tensor, checked to be ``(m, n)``."""
    m, n = shape

    def user_jac(x: Tensor) -> Tensor:
        arg: Any = x.detach().numpy() if numpy_fun else x
        raw = jac(arg, *args, **kwargs)
        if raw is None:
            raise ValueError("jac returned None; expected an (m, n) array")
        if hasattr(raw, "matvec") and hasattr(raw, "rmatvec"):
            raise ValueError(
                f"jac returned a {type(raw).__name__}; LinearOperator Jacobians are not "
                "supported (the solver needs J's entries): return a dense or scipy.sparse "
                "matrix, or drop jac to use finite differences"
            )
        if hasattr(raw, "toarray"):  # scipy.sparse: the solvers are dense
            if dense_only:
                raise ValueError(
                    "method='lm' works only with dense Jacobian matrices (as in scipy), but jac "
                    f"returned a {type(raw).__name__}: pass method='trf' (it makes it dense)"
                )
            raw = raw.toarray()
        if isinstance(raw, Tensor) and raw.layout != torch.strided:
            raw = raw.to_dense()
        J = torch.as_tensor(np.asarray(raw, dtype=np.float64) if numpy_fun else raw)
        if tuple(J.shape) != (m, n):
            if J.ndim <= 1 and J.numel() == m * n:
                J = J.reshape(m, n)  # scipy's atleast_2d: a 1-D J for one residual
            else:
                raise ValueError(
                    f"jac returned shape {tuple(J.shape)}; expected (m, n) = ({m}, {n}) "
                    "(residuals by parameters)"
                )
        if J.device != x.device:
            raise ValueError(
                f"jac returned a Jacobian on {J.device} for x on {x.device}: return it "
                "on x's device, the CPU (.to(x.device) or .cpu())"
            )
        return J.to(torch.float64)

    return user_jac
