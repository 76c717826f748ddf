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
    "NumpyDifference",
    "auto_mode",
    "check_sparsity",
    "column_groups",
    "finite_difference",
    "flat_residuals",
    "jacobian_function",
    "numpy_residuals",
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
        # in the graph each, recorded and differentiated per Jacobian (~15 µs on NIST).
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
    differences take MINPACK's step (see :func:`finite_difference`), as scipy's
    ``method="lm"`` does.  ``flat_fun``: the user's ``fun`` itself, for a torch
    ``fun`` of ``x`` alone whose residuals at ``x0`` came flat and float64: the
    transform then differentiates it without the adapter (whose checks, a call and a
    view inside every ``jacrev`` cost ~8 µs a Jacobian on NIST's problems); a J of
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
    there ``jacfwd`` pays for the Python decompositions its JVPs run through: on the 27
    NIST problems (n ≤ 9, m ≤ 250, 1 thread) ``jacrev`` took 0.36-1.1 ms against
    ``jacfwd``'s 0.76-2.6 ms (2-4x), and tied at m = 250, n = 8 (Gauss1-3, 0.89-1.02).
    So reverse mode for n ≤ 16 and m ≤ 256 (and whenever m < n); forward otherwise.
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
    in (:func:`output_eps`): a float32 ``fun`` needs steps about 2900 times longer than
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
                diff, div = fun(x + e) - f0, 1.0
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
                diff, div = fun(up) - base, 1.0
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
        return ((_rows(fun, up) - base) / h[:, None]).T
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
        if f.size != first.size:  # a size-1 result would broadcast into the row
            raise ValueError(
                f"fun returned {f.size} residuals at one point and {first.size} at another; "
                "the number of residuals must not depend on x"
            )
        out[j] = f
    return out
