"""What the batched engine solves: residuals of many fits, their Jacobians and costs.

:class:`BatchProblem` evaluates ``f(x(y))`` for every fit at once (``x`` ``(B, n)``,
``f`` ``(B, m)``) and linearises it into one normal matrix per fit.  Its per-fit data
(``rows``: ydata, sigma, a per-fit xdata, bounds) travel with it, so a chunk or the
unfinished fits are a :meth:`BatchProblem.take` away.  The cost is one of three
*objectives*, each a pair of weights ``(w, u)`` with ``A = Σ w·J Jᵀ`` and
``g = Σ u·J`` (sums over a fit's points):

* least squares, ``cost·2 = Σ r²``: ``w = 1``, ``u = r``;
* a robust loss ``ρ`` (scipy's, :mod:`..losses`): ``w = ρ' + 2zρ''`` (floored at eps,
  Triggs' correction, as :class:`~secondorder.fitting.problem.FunctionProblem`),
  ``u = ρ'·r``;
* Poisson maximum likelihood (Gpufit's MLE) with model ``μ`` and counts ``k``:
  ``cost·2 = 2Σ(μ - k - k·ln(μ/k))`` (the deviance), ``w = k/μ²``, ``u = 1 - k/μ``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..bounds import BoxTransform
from ..losses import rho
from .small_linalg import gram

__all__ = ["BatchProblem", "Linearization", "Objective", "make_transform"]


@dataclass(frozen=True)
class Objective:
    """The cost of a fit's residual vector and the weights of its linearisation.

    ``kind``: ``"lse"`` (least squares, ``loss`` one of scipy's names) or
    ``"poisson"`` (the residual vector is the model ``μ``; counts in ``counts``).
    """

    kind: str = "lse"
    loss: str = "linear"
    f_scale: float = 1.0

    @property
    def robust(self) -> bool:
        """Whether a robust loss rescales the rows (then ``D`` uses the raw columns)."""
        return self.kind == "lse" and self.loss != "linear"

    def cost2(self, f: Tensor, counts: Tensor | None) -> Tensor:
        """``2·cost`` per fit; ``inf`` where it is not finite (a rejected trial)."""
        if self.kind == "poisson":
            assert counts is not None
            c = _deviance(f, counts)
        elif self.loss == "linear":
            c = (f * f).sum(-1)
        else:
            z = (f / self.f_scale) ** 2
            c = self.f_scale**2 * rho(self.loss, z)[0].sum(-1)
        return torch.where(torch.isfinite(c), c, math.inf)

    def weights(self, f: Tensor, counts: Tensor | None) -> tuple[Tensor | None, Tensor]:
        """``(w, u)``: ``A = Σ w·JJᵀ``, ``g = Σ u·J`` (``w = None`` for ones)."""
        if self.kind == "poisson":
            assert counts is not None
            # A zero count where μ = 0 adds nothing to the deviance's curvature and
            # ∂/∂μ(μ - 0) = 1 to its gradient (k/μ would be 0/0 there).
            zero = counts == 0
            ratio = torch.where(zero, 0.0, counts / f)
            return torch.where(zero, 0.0, ratio / f), 1.0 - ratio
        if self.loss == "linear":
            return None, f
        z = (f / self.f_scale) ** 2
        _, d1, d2 = rho(self.loss, z)
        w = torch.clamp(d1 + 2 * d2 * z, min=torch.finfo(f.dtype).eps)
        return w, f * d1

    def report_scale(self, f: Tensor, counts: Tensor | None) -> Tensor | None:
        """``√w`` of the Jacobian's rows the covariance inverts (scipy's; Fisher's for Poisson).

        For Poisson, ``1/√μ`` (``1/μ`` itself overflows for a subnormal μ in the tails);
        a point where μ = 0 (its count is 0, else the fit failed) adds its limit there,
        0, for a model whose ∂μ vanishes with μ.
        """
        if self.kind == "poisson":
            return torch.where(f == 0, 0.0, torch.rsqrt(f))
        w = self.weights(f, counts)[0]
        return None if w is None else w.clamp(min=0.0).sqrt()


def _deviance(mu: Tensor, k: Tensor) -> Tensor:
    """``2Σ(μ - k - k·ln(μ/k))``; NaN where ``μ < 0``, ``μ = 0`` with counts, or ``k < 0``."""
    safe_k = torch.where(k > 0, k, torch.ones_like(k))
    term = torch.where(k > 0, mu - k - k * torch.log(mu / safe_k), mu)
    bad = (mu < 0) | ((mu == 0) & (k > 0)) | (k < 0)
    return 2.0 * torch.where(bad, math.nan, term).sum(-1)


def make_transform(lb: Tensor, ub: Tensor, scale: Tensor | None, bounded: bool) -> BoxTransform:
    """A :class:`BoxTransform` over per-fit bounds ``(B, n)``, with ``bounded`` known.

    The constructor reads ``bounded`` from the bounds on the host; a chunk of a batch
    whose answer is already known is built without that read.
    """
    t = BoxTransform.__new__(BoxTransform)
    t.lb, t.ub = lb, ub
    t.lo, t.hi = torch.isfinite(lb), torch.isfinite(ub)
    t.both = t.lo & t.hi
    t.bounded = bounded
    t.scale = scale
    t.any = bounded or scale is not None
    return t


@dataclass(frozen=True)
class Linearization:
    """One fit's normal equations in the free variable, batched.

    ``A`` ``(n, n, B)``, ``g = Jᵀu`` ``(B, n)``, ``col`` its diagonal (the gtol test's
    column norms), ``dcol`` the column norms ``D`` is built from (the raw ones under a
    robust loss), ``finite`` ``(B,)``.
    """

    A: Tensor
    g: Tensor
    col: Tensor
    dcol: Tensor
    finite: Tensor


@dataclass(frozen=True)
class BatchProblem:
    """Residuals ``fun(x, *rows) -> (B, m)`` of ``B`` fits, their Jacobian and objective.

    ``jac``: ``jac(x, *rows) -> (B, m, n)`` in ``x``, or ``None`` for forward-mode
    autodiff: one ``jvp`` per parameter through ``columns`` when given (the same
    residuals as ``columns([x[:, :1], ..., x[:, n-1:]], *rows)``, so each pass carries
    the tangent of one parameter only), else ``n`` jvps of ``fun`` vectorised by
    ``vmap``.  ``rows``: per-fit
    tensors (leading dimension ``B``) passed to ``fun`` and ``jac``; ``counts``: Poisson
    counts ``(B, m)``; ``lb``/``ub``/``scale`` ``(B, n)``.
    """

    fun: Callable[..., Tensor]
    jac: Callable[..., Tensor] | None
    rows: tuple[Tensor, ...]
    counts: Tensor | None
    objective: Objective
    lb: Tensor
    ub: Tensor
    scale: Tensor | None
    bounded: bool
    m: int
    n: int
    columns: Callable[..., Tensor] | None = None

    @property
    def transform(self) -> BoxTransform:
        """The change of variables ``x = x(y)`` of these fits."""
        return make_transform(self.lb, self.ub, self.scale, self.bounded)

    def take(self, index: Tensor) -> BatchProblem:
        """The problem of the fits at ``index``."""
        return replace(
            self,
            rows=tuple(r[index] for r in self.rows),
            counts=None if self.counts is None else self.counts[index],
            lb=self.lb[index],
            ub=self.ub[index],
            scale=None if self.scale is None else self.scale[index],
        )

    def put(self, index: Tensor, other: BatchProblem) -> None:
        """Write ``other``'s per-fit data into these fits' rows at ``index``, in place."""
        for mine, theirs in zip(self.rows, other.rows, strict=True):
            mine[index] = theirs
        pairs = [(self.lb, other.lb), (self.ub, other.ub)]
        if self.counts is not None and other.counts is not None:
            pairs.append((self.counts, other.counts))
        if self.scale is not None and other.scale is not None:
            pairs.append((self.scale, other.scale))
        for mine, theirs in pairs:
            mine[index] = theirs

    def values(self, x: Tensor) -> Tensor:
        """``fun(x, *rows)`` as ``(B, m)``."""
        out = self.fun(x, *self.rows)
        want = (x.shape[0], self.m)
        if not isinstance(out, Tensor) or out.dtype != x.dtype:
            got = (
                f"{type(out).__name__}{'' if not isinstance(out, Tensor) else ' ' + str(out.dtype)}"
            )
            raise TypeError(
                f"the model (f, or fun) must return a {x.dtype} tensor of shape {want}, the fits' "
                f"dtype, got {got}: compute in the parameters' dtype (a float64 constant or "
                "xdata promotes it), or run the fits in the other dtype"
            )
        if out.shape != want:
            try:
                out = torch.broadcast_to(out, want)
            except RuntimeError:
                raise ValueError(
                    f"the residual function returned shape {tuple(out.shape)} for {x.shape[0]} "
                    f"fits; expected {want}: per-fit data must reach it through its per-fit "
                    "arguments (rows), not a closure over all fits"
                ) from None
        return out

    def residuals(self, y: Tensor) -> Tensor:
        """``f(x(y))``, detached."""
        return self.values(self.transform.to_x(y)).detach()

    def jacobian_x(self, x: Tensor) -> Tensor:
        """``∂f/∂x`` as ``(n, B, m)``: each parameter's column over the whole batch."""
        if self.jac is not None:
            given = self.jac(x, *self.rows)
            want = (x.shape[0], self.m, self.n)
            if not isinstance(given, Tensor) or given.shape != want:
                shape = tuple(given.shape) if isinstance(given, Tensor) else type(given).__name__
                raise ValueError(f"jac must return a tensor of shape {want}, got {shape}")
            return given.detach().to(x.dtype).permute(2, 0, 1)
        compiling = torch.compiler.is_compiling()
        if self.columns is not None or compiling:
            # torch.compile traces jvp but not vmap of jvp over dynamic batch sizes.
            derivative = self._column_derivative if self.columns is not None else self._derivative
            cols = [derivative(x, j) for j in range(self.n)]
            if compiling:
                # Stored point-major, (n, m, B): the sums over a fit's points that follow
                # (the normal matrix, the gradient) then keep the fits in the vector lanes.
                return torch.stack([c.T for c in cols]).transpose(1, 2).detach()
            J = torch.stack(cols)
        else:
            basis = torch.eye(self.n, dtype=x.dtype, device=x.device).unsqueeze(1)
            basis = basis.expand(self.n, x.shape[0], self.n)

            def column(t: Tensor) -> Tensor:
                out: Tensor = torch.func.jvp(self.values, (x,), (t,))[1]
                return out

            J = torch.func.vmap(column)(basis)
        return J.detach()

    def _derivative(self, x: Tensor, j: int) -> Tensor:
        """``∂f/∂x_j`` ``(B, m)`` by one jvp along the unit vector ``e_j``."""
        t = torch.zeros_like(x)  # x's own layout: jvp under torch.compile needs it
        t[:, j] = 1.0
        out: Tensor = torch.func.jvp(self.values, (x,), (t,))[1]
        return out

    def _column_derivative(self, x: Tensor, j: int) -> Tensor:
        """``∂f/∂x_j`` ``(B, m)`` through ``columns``: only column ``j`` carries a tangent.

        The model's operations that do not involve parameter ``j`` then cost nothing
        in this pass (a ``vmap`` over all ``n`` tangents carries zeros through them).
        """
        assert self.columns is not None
        columns = self.columns
        cols = [x[:, k : k + 1] for k in range(self.n)]

        def along(c: Tensor) -> Tensor:
            out: Tensor = columns([*cols[:j], c, *cols[j + 1 :]], *self.rows)
            return out

        c = cols[j].contiguous()
        out: Tensor = torch.func.jvp(along, (c,), (torch.ones_like(c),))[1]
        return torch.broadcast_to(out, (x.shape[0], self.m))

    def linearize(self, y: Tensor, f: Tensor, cost2: Tensor) -> Linearization:
        """The normal equations at ``y`` (residuals ``f``), through the bounds' chain rule.

        Bounds: ``∂f/∂y = J·diag(x'(y))``, plus the transform's own curvature
        ``max(0, gₓ·x''(y))`` on the diagonal (least_squares' extra rows).
        """
        transform = self.transform
        J = self.jacobian_x(transform.to_x(y))
        w, u = self.objective.weights(f, self.counts)
        A = gram(J, w)
        # A product and a sum along each fit's points, not a batched matrix product:
        # that one takes another kernel for a batch of one fit (a chunk, or the last
        # fit left after compaction), and the fit's bits would depend on it.
        g = (J * u).sum(-1).T
        raw = (J * J).sum(-1).T if self.objective.robust else None
        if transform.any:
            d1, d2 = transform.derivatives(y)
            curv = torch.clamp(g * d2, min=0.0)
            dt = d1.T
            A = A * dt.unsqueeze(0) * dt.unsqueeze(1)
            A = A + torch.diag_embed(curv, dim1=0, dim2=1) if transform.bounded else A
            g = g * d1
            if raw is not None:
                raw = raw * d1 * d1 + (curv if transform.bounded else 0.0)
        # One layout for every linearisation, so a compiled step sees the same strides.
        A, g = A.contiguous(), g.contiguous()
        col = torch.diagonal(A, dim1=0, dim2=1).contiguous()
        dcol = col if raw is None else raw.contiguous()
        finite = (
            torch.isfinite(cost2)
            & torch.isfinite(g).all(-1)
            & torch.isfinite(col).all(-1)
            & torch.isfinite(dcol).all(-1)
        )
        return Linearization(A=A, g=g, col=col, dcol=dcol, finite=finite)

    def report_jacobian(self, y: Tensor, f: Tensor) -> Tensor:
        """The weighted Jacobian the covariance inverts, ``(B, m, n)`` in ``x``."""
        J = self.jacobian_x(self.transform.to_x(y))
        scale = self.objective.report_scale(f, self.counts)
        if scale is not None:
            J = J * scale
        return J.permute(1, 2, 0)
