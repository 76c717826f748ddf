"""Building the problem of a :func:`~secondorder.fitting.least_squares` call.

The user's ``fun`` and ``jac`` adapted to tensors, checked at ``x0``, in the free
variable of the bounds' change of variables.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .bounds import BoxTransform
from .differences import NumpyDifference, check_sparsity
from .functions import (
    CallCounter,
    auto_mode,
    flat_residuals,
    jacobian_function,
    numpy_residuals,
    output_eps,
    residual_function,
)
from .losses import check_loss_output
from .options import JACS, Options
from .problem import FunctionProblem


def build_problem(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    y_start: Tensor,
    numpy_in: bool,
    transform: BoxTransform,
    opts: Options,
    rel_step: Tensor | None,
) -> FunctionProblem:
    """Adapt ``fun`` and ``jac`` to tensors, check the residuals at ``x0``, wire the problem.

    Whether ``fun`` speaks torch (differentiable) or NumPy is decided by calling it once
    with the kind of array ``x0`` is (and the other kind if that raises): what it
    returns decides, and it is kept as the residuals at the start ``x(y_start)`` (the
    first of ``nfev``).
    """
    counter = CallCounter(fun)
    x_eval = transform.to_x(y_start)
    autodiff = isinstance(opts.jac, str) and opts.jac in ("auto", "fwd", "rev")
    probe, numpy_fun = _probe(counter, args, kwargs, x_eval, numpy_in, autodiff=autodiff)
    residuals = residual_function(counter, args, kwargs, numpy_fun=numpy_fun)
    f0 = flat_residuals(probe, numpy_fun=numpy_fun).detach()
    if f0.device != x_eval.device:
        raise ValueError(
            f"fun returned residuals on {f0.device} for x0 on {x_eval.device}: "
            "least_squares runs on the CPU, so return CPU tensors from fun "
            "(.to(x.device) or .cpu() on its result)"
        )
    m, n = f0.numel(), x_eval.numel()
    if m == 0:
        raise ValueError("fun returned no residuals at x0")
    if not bool(torch.isfinite(f0).all()):
        bad = torch.nonzero(~torch.isfinite(f0.reshape(-1))).flatten().tolist()
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        raise ValueError(
            f"Residuals are not finite in the initial point x0: {len(bad)} of {m} entries "
            f"are NaN or inf (at {shown}). Check the data fun compares against (ydata, "
            "xdata and sigma in curve_fit) as well as x0."
        )
    if opts.method == "lm" and m < n:
        raise ValueError(
            f"Method 'lm' doesn't work when the number of residuals ({m}) is less than the "
            f"number of variables ({n}) (as in scipy): pass method='trf'"
        )
    if callable(opts.loss):
        check_loss_output(opts.loss, (f0 / opts.f_scale) ** 2)
    differences = not callable(opts.jac) and (numpy_fun or opts.jac in JACS[3:])
    sparsity = None
    if opts.jac_sparsity is not None and not callable(opts.jac):
        if not differences:
            raise ValueError(
                "jac_sparsity groups finite-difference columns, but fun is differentiated "
                "exactly by torch (jac='auto'): drop jac_sparsity, or pass jac='2-point'"
            )
        sparsity = check_sparsity(opts.jac_sparsity, (m, n))
    flat = _flat_float64(probe, args, kwargs)
    jac = jacobian_function(
        opts.jac,
        residuals,
        numpy_fun=numpy_fun,
        shape=(m, n),
        args=args,
        kwargs=kwargs,
        eps=output_eps(probe),
        counter=counter,
        rel_step=rel_step,
        sparsity=sparsity,
        dense_only=opts.method == "lm",
        # scipy's "lm" differences in MINPACK (fdjac2), with MINPACK's relative step.
        minpack=opts.method == "lm",
        flat_fun=fun if flat else None,
    )
    rev = auto_mode(m, n) == "rev"
    problem = FunctionProblem(
        residuals,
        jac,
        transform,
        opts.loss,
        float(opts.f_scale),
        need_gram=opts.linear_solver in ("cholesky", "eigh"),
        differentiable=not numpy_fun,
        counter=counter,
        takes_residuals=True,
    )
    problem.differences = differences
    if flat and not transform.any and (opts.jac == "rev" or (opts.jac == "auto" and rev)):
        # Reverse mode: a point's residuals by vjp, its J from that forward pass.
        problem.fuse(fun, m)
    if numpy_fun and not transform.any:
        # x = y: the NumPy fun (and its differences) called on arrays, no adapter.
        host_jac = jac.of_arrays if isinstance(jac, NumpyDifference) else None
        problem.on_host(numpy_residuals(counter, args, kwargs, owned=True), host_jac)
    problem.remember(y_start, f0)
    return problem


def _flat_float64(probe: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a torch ``fun`` of ``x`` alone returned flat float64 residuals at ``x0``."""
    return (
        not args
        and not kwargs
        and isinstance(probe, Tensor)
        and probe.ndim == 1
        and probe.dtype == torch.float64
    )


def _probe(
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    x_start: Tensor,
    numpy_in: bool,
    *,
    autodiff: bool,
) -> tuple[Any, bool]:
    """``(fun(x0), numpy_fun)``; a torch ``fun`` to be differentiated is checked to depend on ``x``.

    ``fun`` is called with ``x0``'s kind of array first; if that raises, with the other
    kind, and if that raises too the first error is raised.  Autodiff of residuals that
    were detached from ``x`` (``.detach()``, ``.item()``, a NumPy round trip,
    ``torch.no_grad()``) gives a zero Jacobian, and the zero gradient would pass the
    gtol test at ``x0``: a false success.  So a torch call records a graph and the
    residuals must reach ``x`` through it.
    """

    def as_numpy() -> Any:
        return fun(x_start.numpy().copy(), *args, **kwargs)

    def as_torch() -> tuple[Any, Tensor | None]:
        if not autodiff:
            return fun(x_start.clone(), *args, **kwargs), None
        leaf = x_start.clone().requires_grad_(True)
        with torch.enable_grad(), warnings.catch_warnings():
            # float(x[i]) on the recording x warns; the check below says what is wrong.
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
            return fun(leaf.clone(), *args, **kwargs), leaf

    leaf: Tensor | None = None
    try:
        if numpy_in:
            out = as_numpy()
        else:
            out, leaf = as_torch()
    except Exception as first:
        try:
            if numpy_in:
                out, leaf = as_torch()
            else:
                out = as_numpy()
        except Exception:
            raise first from None
        numpy_in = not numpy_in
    if leaf is not None and isinstance(out, Tensor) and out.is_floating_point():
        with torch.enable_grad():
            connected = out.requires_grad and (
                torch.autograd.grad(out.sum(), leaf, allow_unused=True)[0] is not None
            )
        if not connected:
            raise ValueError(
                "fun's residuals do not depend on the parameters x: the residuals at x0 are "
                "not connected to x by autograd (detached with .detach(), .item(), .numpy() "
                "or torch.no_grad(), or computed from other tensors only), so their Jacobian "
                "would be 0 and x0 would pass for a minimum; compute the residuals from x "
                "with torch operations, or pass jac= (a callable, '2-point' or '3-point')"
            )
    numpy_fun = not isinstance(out, Tensor)
    return (out.detach() if isinstance(out, Tensor) else out), numpy_fun
