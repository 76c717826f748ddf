"""The least-squares problem in the free variable ``y``, as the LM engine sees it.

:class:`FunctionProblem` evaluates ``f(x(y))`` and linearises it into the
:class:`~secondorder.lm.linalg.NormalEquations` the engine solves.  Two corrections make
the Gauss-Newton model right for :func:`~secondorder.fitting.least_squares`:

* a robust loss rescales each residual and row of J (Triggs' correction) so that the
  model's gradient is the loss's exact gradient and its curvature keeps the loss's
  second-order term where that is positive;
* bounds enter through the chain rule ``∂f/∂y = J·diag(x'(y))``, plus the transform's
  own curvature as extra rows (see :meth:`FunctionProblem.linearize`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..lm.linalg import HOST_MAX_N, HostArrays, NormalEquations
from .bounds import BoxTransform
from .differences import JacobianFn
from .functions import CallCounter
from .losses import Loss, doubled_cost, rho

__all__ = ["FunctionProblem", "is_finite_system"]


def is_finite_system(system: NormalEquations) -> bool:
    """Whether the linearisation holds finite numbers only (J, Jᵀr, column norms).

    J itself is not scanned: ``col_sq`` holds the squared column norms of the rows the
    solver sees, finite exactly when every entry of J is (or its squares overflow, which
    no step could survive either).
    """
    parts = [system.grad, system.col_sq]
    if system.host is not None or all(t.is_cpu and t.dtype == torch.float64 for t in parts):
        # Host tensors (every fit of a few parameters).  The engine reads the system's
        # scalars next (finite loss, Jᵀr and column norms, kept once read): read them
        # now, and scan the vectors here only when the loss alone may be what is not.
        finite, loss, _ = system.scalars()
        if finite:
            return True
        if math.isfinite(loss):
            return False
        return bool(np.isfinite(parts[0].numpy()).all() and np.isfinite(parts[1].numpy()).all())
    return bool(torch.isfinite(parts[0]).all() & torch.isfinite(parts[1]).all())  # one read


def _same_point(key: Tensor, version: int, y: Tensor) -> bool:
    """Whether ``y`` is the point ``key`` was when its version counter read ``version``."""
    return key._version == version and (key is y or torch.equal(key, y))


class FunctionProblem:
    """Residuals ``f(x(y))``, their linearisation and second derivative, with counts.

    Implements the engine's :class:`~secondorder.lm.engine.Problem` protocol plus
    :meth:`residuals` and :meth:`linearize`.

    Attributes:
        nfev: calls of ``fun`` so far other than autodiff Jacobian calls: residual
            values, finite-difference columns, geodesic second derivatives (read from
            ``counter``, which must wrap every path to the user's function).
        njev: Jacobian evaluations so far.
        last: the last point evaluated and its residuals, so an accepted trial is not
            evaluated twice.
        base: the last linearisation point with its residuals and raw Jacobian (in
            ``x``), so the result at that point is reported without calling ``fun``.
        row_scale: Triggs' row scaling of the last linearisation (robust losses), else
            ``None``.
        extra_rows: rows appended to J for the curvature of the bounds' transform.
    """

    def __init__(
        self,
        fun: Callable[[Tensor], Tensor],
        jac: JacobianFn | Callable[[Tensor], Tensor],
        bounds: BoxTransform,
        loss: Loss,
        f_scale: float,
        *,
        need_gram: bool,
        differentiable: bool,
        counter: CallCounter | None = None,
        takes_residuals: bool = False,
    ) -> None:
        # Without a counter around the user's fun, count the calls made here.
        self.counter = counter if counter is not None else CallCounter(fun)
        self.fun: Callable[[Tensor], Tensor] = fun if counter is not None else self.counter
        self.takes_residuals = takes_residuals
        self.need_gram = need_gram
        self.differentiable = differentiable
        self.jac = jac
        self.bounds = bounds
        self.loss = loss
        self.f_scale = f_scale
        self.njev = 0
        #: whether the Jacobian comes from finite differences (set by the builder).
        self.differences = False
        #: ``last`` and ``base`` hold their points as given, not copied: each is kept
        #: with its version counter, so a point modified in place since is never taken
        #: for the one evaluated (the engine makes a new tensor for every point).
        self.last: tuple[Tensor, Tensor] | None = None
        self._last_version = 0
        self.base: tuple[Tensor, Tensor, Tensor] | None = None
        self._base_version = 0
        #: The base's J as a NumPy array, on the host path.
        self._base_jac: np.ndarray | None = None
        self.row_scale: Tensor | None = None
        self.extra_rows = 0
        #: NumPy residuals and Jacobian of a fit of a few parameters (set by the builder
        #: through :meth:`on_host`), else ``None``.
        self.host_fun: Callable[[np.ndarray], np.ndarray] | None = None
        self.host_jac: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
        #: The user's torch fun for fused evaluations (:meth:`fuse`), the identity that
        #: pulls back every residual, and the last evaluated point with its version
        #: and its pullback.
        self._fused: Callable[[Tensor], Tensor] | None = None
        self._eye: Tensor | None = None
        self._pullback: tuple[Tensor, int, Callable[..., Any]] | None = None
        #: Residuals ``fun`` returned at x0; every later evaluation must return as many.
        self.m: int | None = None
        #: Whether the last :meth:`loss_sum` was finite (a trial with NaN or inf is not).
        self.last_finite = True

    def on_host(
        self,
        fun: Callable[[np.ndarray], np.ndarray],
        jac: Callable[[np.ndarray, np.ndarray], np.ndarray] | None,
    ) -> None:
        """Evaluate a NumPy ``fun`` (and its difference Jacobian ``jac``) on arrays.

        ``fun``: the same residuals as the adapter ``self.fun`` on a NumPy ``x``, flat
        float64, counted, owned by the caller; ``jac(x, f(x))``: the same J as
        ``self.jac`` on arrays.  Only for a fit without bounds or scaling (x = y): the
        point then goes to the user's function as it is, with no tensor made or read
        around each call.  With a linear loss and a few parameters the normal equations
        are formed from these arrays too.
        """
        if self.bounds.any:
            raise ValueError("on_host: the host path takes no bounds or x_scale (x must be y)")
        self.host_fun, self.host_jac = fun, jac

    def fuse(self, fun: Callable[[Tensor], Tensor], m: int) -> None:
        """Take residuals by ``torch.func.vjp`` and a point's J from that evaluation.

        ``fun``: the user's torch ``fun`` of ``x`` alone, ``m`` flat float64 residuals,
        differentiated in reverse mode.  Every residual evaluation records its forward
        pass; when the point is then accepted, J is the pullback of the identity
        (``vmap(vjp_fn)(I)``, what ``jacrev`` computes after its own forward pass), so
        the Jacobian costs no call of ``fun``: on NIST's problems ``jacrev`` spends
        about a third of its time in that forward pass and its own bookkeeping.  Only
        without bounds or scaling (x = y).
        """
        if self.bounds.any:
            raise ValueError("fuse: fused evaluations take no bounds or x_scale (x must be y)")
        self._fused, self._eye = fun, torch.eye(m, dtype=torch.float64)

    def _fused_residuals(self, y: Tensor) -> Tensor | None:
        """``f(y)`` by ``vjp``, its pullback kept; ``None``: take the plain call instead."""
        assert self._fused is not None and self._eye is not None
        self.counter.calls += 1  # a value call (nfev), whatever follows
        try:
            out, pullback = torch.func.vjp(self._fused, y)[:2]
        except RuntimeError:
            # Residuals torch.func refuses: the adapter calls fun again and names the fault.
            self._pullback = None
            return None
        m = self._eye.shape[0]
        if not (isinstance(out, Tensor) and out.dtype == torch.float64 and out.shape == (m,)):
            self._pullback = None
            return None
        self._pullback = (y, y._version, pullback)
        return out.detach() if out.requires_grad else out

    def cost2(self, f: Tensor) -> Tensor:
        """``2·cost = f_scale² Σ ρ((f/f_scale)²)`` of residuals ``f``."""
        return doubled_cost(f, self.loss, self.f_scale)

    @property
    def nfev(self) -> int:
        """Calls of ``fun`` outside autodiff Jacobians."""
        return self.counter.value_calls

    def remember(self, y: Tensor, f: Tensor) -> None:
        """Record ``f = f(x(y))`` computed elsewhere (the first call of ``fun``)."""
        self.last = (y, f.detach())
        self._last_version = y._version
        if self.m is None:
            self.m = f.numel()

    def _check_count(self, rows: int, what: str) -> None:
        """Refuse residuals (or Jacobian rows) whose count is not that of x0."""
        if self.m is not None and rows != self.m:
            raise ValueError(
                f"fun returned {rows} residuals at {what} but {self.m} at x0: the number of "
                "residuals must not depend on x. Make fun return the same shape for every x "
                "(mask entries with zeros rather than dropping them)."
            )

    def residuals(self, y: Tensor) -> Tensor:
        """``f(x(y))``, flat float64, detached; the last point and the base are free."""
        last = self.last
        if last is not None and _same_point(last[0], self._last_version, y):
            return last[1]
        base = self.base
        if base is not None and _same_point(base[0], self._base_version, y):
            return base[1]
        if self.host_fun is not None:
            # A NumPy fun and x = y: the point as an array, no adapter around the call.
            f = torch.from_numpy(self.host_fun((y.detach() if y.requires_grad else y).numpy()))
        else:
            fused = None if self._fused is None else self._fused_residuals(y)
            if fused is not None:
                f = fused
            else:
                # Values only: a fun closing over tensors that require grad must not drag
                # a graph along (autograd is used inside the Jacobian transforms alone).
                f = self.fun(self.bounds.to_x(y))
                if f.requires_grad:
                    f = f.detach()
        self._check_count(f.numel(), "a point")
        self.last = (y, f)
        self._last_version = y._version
        return f

    def loss_sum(self, y: Tensor) -> Tensor | float:
        """``2·cost`` at ``y``, or ``inf`` where a residual is not finite (a rejected step).

        Sets :attr:`last_finite`, which tells the run a trial rejected for NaN or inf.
        """
        f = self.residuals(y)
        if self.loss == "linear" and f.is_cpu and f.dtype == torch.float64:
            # The common fit: ‖f‖² read in NumPy, no torch call or separate host read.
            # vdot raises no floating-point warning: an overflow is inf, as on the
            # device, and a non-finite residual makes the sum inf or NaN.
            a = f.numpy()
            total = float(np.vdot(a, a))
            self.last_finite = math.isfinite(total)
            return total if self.last_finite else math.inf
        self.last_finite = bool(torch.isfinite(f).all())
        return self.cost2(f) if self.last_finite else torch.tensor(math.inf)

    def linearize(self, y: Tensor, f: Tensor) -> NormalEquations:
        """The normal equations of the model ``r + Js·δy`` at ``y`` with residuals ``f``.

        Bounds: Gauss-Newton would drop the transform's own curvature ``g_x·x''(y)``,
        but at an active bound that term is all the curvature there is (J's column
        vanishes with ``x'(y)``), and without it every step towards the bound
        overshoots.  Where it is positive it enters as an extra row ``√(g_x·x'')·eᵢ``
        with residual 0, which adds it to ``diag(JᵀJ)`` and leaves ``Jᵀr`` unchanged.
        """
        J = self.jacobian(y, f)
        if self._plain_host(J, f):
            jn = self._base_jac
            assert self.base is not None
            j = jn if jn is not None and self.base[2] is J else J.numpy()
            return self._host_system(j, f.numpy(), J, f)
        r, Js = self._robust_rows(f, J)
        scale_sq = None if self.row_scale is None else (J * J).sum(0)
        self.extra_rows = 0
        if self.bounds.any:
            Js, r, scale_sq = self._through_bounds(y, J, Js, r, scale_sq)
        return NormalEquations(
            loss_sum=self.cost2(f),
            count=f.numel(),
            grad=Js.T @ r,
            col_sq=(Js * Js).sum(0),
            gram=Js.T @ Js if self.need_gram else None,
            jac=Js,
            residuals=r,
            scale_sq=scale_sq,
        )

    def _plain_host(self, J: Tensor, f: Tensor) -> bool:
        """A few float64 CPU columns, the linear loss, no bounds: NumPy forms the system."""
        if self.host_jac is not None and isinstance(self.loss, str) and self.loss == "linear":
            return J.shape[1] <= HOST_MAX_N  # host arrays: float64, 2-D, no bounds
        return (
            not self.bounds.any
            and isinstance(self.loss, str)
            and self.loss == "linear"
            and J.ndim == 2
            and J.shape[1] <= HOST_MAX_N
            and J.dtype == f.dtype == torch.float64
            and J.is_cpu
            and f.is_cpu
        )

    def _host_system(self, j: np.ndarray, r: np.ndarray, J: Tensor, f: Tensor) -> NormalEquations:
        """:meth:`linearize`'s system in NumPy: the same products, no torch call per vector.

        For a few parameters each torch operation costs more in dispatch than its
        arithmetic; these views share memory with the tensors the engine receives, and
        travel with the system (``host``) so the engine and the host factorisation
        need not convert them again.
        """
        self.row_scale = None
        self.extra_rows = 0
        # vdot raises no floating-point warning (an overflow is inf, as in torch; the
        # caller checks finiteness); the products would, so they get a guard.
        loss = np.asarray(np.vdot(r, r))
        with np.errstate(all="ignore"):
            col_sq = np.add.reduce(j * j, axis=0)
            grad = j.T.dot(r)
            gram = j.T.dot(j) if self.need_gram else None
        return NormalEquations(
            loss_sum=torch.from_numpy(loss),
            count=r.size,
            grad=torch.from_numpy(grad),
            col_sq=torch.from_numpy(col_sq),
            gram=None if gram is None else torch.from_numpy(gram),
            jac=J,
            residuals=f,
            host=HostArrays(loss=float(loss), grad=grad, col_sq=col_sq, jac=j, residuals=r),
        )

    def jacobian(self, y: Tensor, f: Tensor) -> Tensor:
        """The raw ``J(x(y))`` (in ``x``), with ``f = f(x(y))``; the base's is free."""
        if self._is_base(y):
            assert self.base is not None
            return self.base[2]
        self.njev += 1
        if self.host_jac is not None:
            yn = (y.detach() if y.requires_grad else y).numpy()
            jn = self.host_jac(yn, f.numpy())
            J = torch.from_numpy(jn)
        else:
            jn = None
            pulled = self._pulled_back(y)
            if pulled is not None:
                J = pulled
            else:
                x = self.bounds.to_x(y)
                jac: Any = self.jac
                J = jac(x, f) if self.takes_residuals else jac(x)
            if J.requires_grad:
                J = J.detach()
        self._check_count(int(J.shape[0]), "a point's Jacobian")
        self.base = (y, f.detach() if f.requires_grad else f, J)
        self._base_version, self._base_jac = y._version, jn
        return J

    def _pulled_back(self, y: Tensor) -> Tensor | None:
        """J at ``y`` from the pullback its fused evaluation kept, else ``None``."""
        kept, self._pullback = self._pullback, None
        if kept is None or not _same_point(kept[0], kept[1], y):
            return None
        assert self._eye is not None
        J: Tensor = torch.func.vmap(kept[2])(self._eye)[0]
        m = self._eye.shape[0]
        return J if J.dtype == torch.float64 and J.shape == (m, y.numel()) else None

    def _is_base(self, y: Tensor) -> bool:
        base = self.base
        return base is not None and _same_point(base[0], self._base_version, y)

    def _robust_rows(self, f: Tensor, J: Tensor) -> tuple[Tensor, Tensor]:
        """Triggs' rescaled ``(r, Js)`` for a robust loss (``(f, J)`` for the linear one)."""
        self.row_scale = None
        if isinstance(self.loss, str) and self.loss == "linear":
            return f, J
        z = (f / self.f_scale) ** 2
        _, rho1, rho2 = rho(self.loss, z)
        scale = torch.clamp(rho1 + 2 * rho2 * z, min=torch.finfo(f.dtype).eps).sqrt()
        self.row_scale = scale
        return f * rho1 / scale, J * scale[:, None]

    def _through_bounds(
        self, y: Tensor, J: Tensor, Js: Tensor, r: Tensor, scale_sq: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(Js, r, scale_sq)`` by the chain rule through ``x(y)``, with curvature rows."""
        d1, d2 = self.bounds.derivatives(y)
        curv = torch.clamp((Js.T @ r) * d2, min=0.0)
        J, Js = J * d1, Js * d1
        scale_sq = None if scale_sq is None else (J * J).sum(0)
        rows = torch.nonzero(curv > 0).flatten()
        if rows.numel() > 0:
            extra = torch.zeros(rows.numel(), Js.shape[1], dtype=Js.dtype)
            extra[torch.arange(rows.numel()), rows] = curv[rows].sqrt()
            Js = torch.cat([Js, extra])
            r = torch.cat([r, torch.zeros(rows.numel(), dtype=r.dtype)])
            self.extra_rows = rows.numel()
            if scale_sq is not None:
                scale_sq = scale_sq + curv
        return Js, r, scale_sq

    def second_directional(
        self, y: Tensor, v: Tensor, system: NormalEquations
    ) -> tuple[Tensor, Tensor | None]:
        """``(Jsᵀr_vv, r_vv)`` with ``r_vv = D²f(x(y))[v, v]``, in the rows of ``system``."""
        assert system.jac is not None
        if self.differentiable:
            rvv = self._exact_rvv(y, v)
        else:
            vnorm = float(torch.linalg.vector_norm(v))
            if vnorm == 0.0:
                return torch.zeros_like(system.grad), torch.zeros_like(system.jac[:, 0])
            rvv = self._central_rvv(y, v, vnorm)
        if self.row_scale is not None:
            # The rows of J were rescaled for the robust loss; rescale r_vv alike.
            rvv = rvv * self.row_scale
        if self.extra_rows:
            rvv = torch.cat([rvv, torch.zeros(self.extra_rows, dtype=rvv.dtype)])
        return system.jac.T @ rvv, rvv

    def _fun_of_y(self, t: Tensor) -> Tensor:
        return self.fun(self.bounds.to_x(t))

    def _exact_rvv(self, y: Tensor, v: Tensor) -> Tensor:
        """``r_vv`` by two nested forward-mode derivatives."""

        def jv(t: Tensor) -> Tensor:
            out: Tensor = torch.func.jvp(self._fun_of_y, (t,), (v,))[1]
            return out

        return torch.func.jvp(jv, (y,), (v,))[1].detach()

    def _central_rvv(self, y: Tensor, v: Tensor, vnorm: float) -> Tensor:
        """``r_vv`` by a central difference along ``v`` (a NumPy fun cannot be differentiated).

        The step balances truncation (O(h²)) against roundoff (O(eps/h²)).
        """
        f = self._fun_of_y
        h = torch.finfo(y.dtype).eps ** 0.25 * max(1.0, float(torch.linalg.vector_norm(y)))
        t = h / vnorm
        # f(y) is the linearisation point's, already known: two calls, not three.
        centre = self.base[1] if self.base is not None and self._is_base(y) else f(y)
        return ((f(y + t * v) - 2.0 * centre + f(y - t * v)) / (t * t)).detach()
