"""What every K-FAC layer shares: statistics, running factors, decompositions.

A layer whose weight gradient is ``∇ = Σ_{n,p} g_{n,p} a_{n,p}ᵀ`` (outputs ``o`` × inputs
``i``, summed over samples ``n`` and positions ``p``: tokens, pixels) gets the
Kronecker-factored Fisher block ``F ≈ A ⊗ G`` with (the KFC convention of Grosse &
Martens 2016, which is the exact Linear rule when there is one position)::

    A = 1/(N·P) Σ_{n,p} a_{n,p} a_{n,p}ᵀ        (mean over samples and positions)
    G = 1/N    Σ_{n,p} g_{n,p} g_{n,p}ᵀ        (per-sample sum over positions, mean over samples)

where ``g_{n,p}`` is the gradient of sample ``n``'s *own* loss ``ℓ_n`` with respect to
the layer's output, not of the mean loss.  With the mean loss ``L = 1/N Σ ℓ_n`` of a
micro-batch of ``N`` samples, ``g = N · ∂L/∂s``; so ``A ⊗ G`` is the empirical Fisher
``1/N Σ ∇ℓ_n ∇ℓ_nᵀ``, which does not depend on the batch size, nor on how the batch is
split over ranks, and which approximates the Hessian of the mean loss.

Layers hold sums and counts between factor updates so that micro-batches and ranks
combine exactly: the preconditioner sums the statistics over ranks, then divides.
Grouped convolutions and Linear layers share one layout: factors are stacks
``(groups, n, n)`` and gradients ``(groups, o, i)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["KFACLayer", "KroneckerLayer"]


class KFACLayer:
    """One preconditioned module: its hooks' statistics, factors and decomposition.

    Subclasses say how a module's input and output gradient become ``a`` and ``g``
    rows (:meth:`a_stats`, :meth:`g_stats`) and how its parameter gradients are laid
    out as ``(groups, o, i)`` matrices (:meth:`grad`, :meth:`set_grad`).
    """

    kind = "layer"

    def __init__(self, name: str, module: nn.Module, factor_dtype: torch.dtype | None) -> None:
        self.name = name
        self.module = module
        weight = module.weight
        assert isinstance(weight, Tensor)
        self.factor_dtype = factor_dtype or weight.dtype
        self.device = weight.device
        self.A: Tensor | None = None
        self.G: Tensor | None = None
        #: The decomposition of the factors (eigen: QA, dA, QG, dG; inverse: A_inv, G_inv).
        self.inv: dict[str, Tensor] = {}
        self.reset_stats()

    # -- statistics between factor updates ---------------------------------------------
    def reset_stats(self) -> None:
        """Forget the statistics gathered since the last factor update."""
        self.a_sum: Tensor | None = None
        self.g_sum: Tensor | None = None
        #: rows of ``a`` (samples × positions), samples seen by G, hook calls.
        self.a_rows = 0.0
        self.g_samples = 0.0
        self.forward_calls = 0
        self.backward_calls = 0

    def add_a(self, x: Tensor) -> None:
        """Add one forward call's input to the A statistics."""
        s, rows = self.a_stats(x.detach().to(self.factor_dtype))
        self.a_sum = s if self.a_sum is None else self.a_sum + s
        self.a_rows += rows
        self.forward_calls += 1

    def add_g(self, grad_output: Tensor, scale: float, samples: int) -> None:
        """Add one backward call's output gradient, times ``scale``, to the G statistics.

        ``scale`` turns the gradient of the loss that was differentiated into the
        per-sample gradient (the local batch size for a mean loss, divided by a
        GradScaler's scale); ``samples`` is the batch size of that call.
        """
        g = grad_output.detach().to(self.factor_dtype) * scale
        s = self.g_stats(g)
        self.g_sum = s if self.g_sum is None else self.g_sum + s
        self.g_samples += samples
        self.backward_calls += 1

    def stats(self) -> list[Tensor]:
        """The sums that ranks add up: ``[Σ a aᵀ, Σ g gᵀ]`` (zeros where nothing was seen)."""
        a_shape, g_shape = self.factor_shapes()
        kw: dict[str, Any] = {"dtype": self.factor_dtype, "device": self.device}
        a = self.a_sum if self.a_sum is not None else torch.zeros(a_shape, **kw)
        g = self.g_sum if self.g_sum is not None else torch.zeros(g_shape, **kw)
        return [a, g]

    def update_factors(
        self, a_sum: Tensor, a_rows: float, g_sum: Tensor, g_samples: float, decay: float
    ) -> None:
        """Fold the (rank-summed) statistics into the running factors."""
        if self.A is None or self.G is None:
            self.A, self.G = self.identity_factors()
        # in place: the factors of a wide layer are megabytes, written once per update
        self.A = self.A.mul_(decay).add_(a_sum, alpha=(1.0 - decay) / a_rows)
        self.G = self.G.mul_(decay).add_(g_sum, alpha=(1.0 - decay) / g_samples)

    # -- subclass interface ------------------------------------------------------------
    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of A and G."""
        raise NotImplementedError

    def identity_factors(self) -> tuple[Tensor, Tensor]:
        """The factors before any update (identity, as KAISA starts)."""
        raise NotImplementedError

    def a_stats(self, x: Tensor) -> tuple[Tensor, int]:
        """``Σ a aᵀ`` of one input and its number of rows."""
        raise NotImplementedError

    def g_stats(self, g: Tensor) -> Tensor:
        """``Σ g gᵀ`` of one (per-sample scaled) output gradient."""
        raise NotImplementedError

    def grad(self) -> Tensor | None:
        """The parameter gradients as a ``(groups, o, i)`` matrix; None if there is none."""
        raise NotImplementedError

    def set_grad(self, p: Tensor) -> None:
        """Write a ``(groups, o, i)`` matrix back into the parameters' ``.grad``."""
        raise NotImplementedError

    def decompose(self, method: str, damping: float, dtype: torch.dtype) -> None:
        """Compute :attr:`inv` from the current factors."""
        raise NotImplementedError

    def inverse_shapes(self, method: str) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors of :attr:`inv`, so a receiving rank can allocate them."""
        raise NotImplementedError

    def precondition(self, grad: Tensor, method: str, damping: float) -> Tensor:
        """The preconditioned gradient ``(A ⊗ G + λI)⁻¹ ∇`` (eigen) or its inverse-method twin."""
        raise NotImplementedError

    def curvature(self, delta: Tensor) -> Tensor:
        """``vec(δ)ᵀ (A ⊗ G) vec(δ)`` for a step ``δ`` in the ``(groups, o, i)`` layout."""
        raise NotImplementedError

    # -- shared helpers ----------------------------------------------------------------
    def inverse_buffers(self, method: str, dtype: torch.dtype) -> list[Tensor]:
        """The tensors of :attr:`inv` in a fixed order, allocated if this rank lacks them."""
        shapes = self.inverse_shapes(method)
        if set(self.inv) != set(shapes):
            self.inv = {
                k: torch.empty(s, dtype=dtype, device=self.device) for k, s in shapes.items()
            }
        return [self.inv[k] for k in sorted(shapes)]

    def _contiguous(self) -> None:
        # eigh returns column-major eigenvectors; a rank that receives them by broadcast
        # holds row-major copies, and BLAS may round a product differently for the two
        # layouts.  One layout everywhere keeps the ranks bitwise equal.
        self.inv = {k: v.contiguous() for k, v in self.inv.items()}

    def params(self) -> list[nn.Parameter]:
        """The parameters this layer preconditions (weight, then bias if any)."""
        out = [self.module.weight]
        bias = getattr(self.module, "bias", None)
        if isinstance(bias, nn.Parameter):
            out.append(bias)
        return [p for p in out if isinstance(p, nn.Parameter)]

    def __repr__(self) -> str:
        a, g = self.factor_shapes()
        return f"{type(self).__name__}({self.name!r}, A={tuple(a)}, G={tuple(g)})"


def _sym_eigh(m: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    d, q = torch.linalg.eigh(m.to(dtype))
    # A and G are PSD; rounding can make the smallest eigenvalues slightly negative,
    # which would let d_G d_A + λ approach 0.
    return d.clamp(min=0.0), q


def spd_inverse(m: Tensor) -> Tensor:
    """Inverse of a symmetric positive definite (batch of) matrix by Cholesky.

    Half the flops of an LU inverse; a factor that rounding made indefinite falls back
    to ``torch.linalg.inv``.
    """
    chol, info = torch.linalg.cholesky_ex(m)
    if bool((info != 0).any()):
        return torch.linalg.inv(m)
    return torch.cholesky_inverse(chol)


class KroneckerLayer(KFACLayer):
    """A layer with dense factors ``A: (groups, i, i)`` and ``G: (groups, o, o)``."""

    groups = 1

    def identity_factors(self) -> tuple[Tensor, Tensor]:  # noqa: D102
        a_shape, g_shape = self.factor_shapes()
        kw: dict[str, Any] = {"dtype": self.factor_dtype, "device": self.device}
        eye_a = torch.eye(a_shape[-1], **kw).expand(a_shape).clone()
        eye_g = torch.eye(g_shape[-1], **kw).expand(g_shape).clone()
        return eye_a, eye_g

    def inverse_shapes(self, method: str) -> dict[str, tuple[int, ...]]:  # noqa: D102
        (ga, i, _), (gg, o, _) = self.factor_shapes()
        if method == "eigen":
            return {"QA": (ga, i, i), "dA": (ga, i), "QG": (gg, o, o), "dG": (gg, o)}
        return {"A_inv": (ga, i, i), "G_inv": (gg, o, o)}

    def decompose(self, method: str, damping: float, dtype: torch.dtype) -> None:  # noqa: D102
        if self.A is None or self.G is None:
            self.A, self.G = self.identity_factors()
        if method == "eigen":
            dA, QA = _sym_eigh(self.A, dtype)
            dG, QG = _sym_eigh(self.G, dtype)
            self.inv = {"QA": QA, "dA": dA, "QG": QG, "dG": dG}
        else:
            eye_a = torch.eye(self.A.shape[-1], dtype=dtype, device=self.device)
            eye_g = torch.eye(self.G.shape[-1], dtype=dtype, device=self.device)
            self.inv = {
                "A_inv": spd_inverse(self.A.to(dtype) + damping * eye_a),
                "G_inv": spd_inverse(self.G.to(dtype) + damping * eye_g),
            }
        self._contiguous()

    def precondition(self, grad: Tensor, method: str, damping: float) -> Tensor:  # noqa: D102
        inv = self.inv
        if method == "eigen":
            QA, dA, QG, dG = inv["QA"], inv["dA"], inv["QG"], inv["dG"]
            v = QG.mT @ grad.to(QA.dtype) @ QA
            v = v / (dG.unsqueeze(-1) * dA.unsqueeze(-2) + damping)
            p = QG @ v @ QA.mT
        else:
            p = inv["G_inv"] @ grad.to(inv["G_inv"].dtype) @ inv["A_inv"]
        return p.to(grad.dtype)

    def curvature(self, delta: Tensor) -> Tensor:  # noqa: D102
        assert self.A is not None and self.G is not None
        d = delta.to(self.A.dtype)
        return (d * (self.G @ d @ self.A)).sum()
