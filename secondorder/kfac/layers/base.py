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

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..sharding import grad_of
from .linalg import default_factor_dtype, spd_cholesky, spd_inverse, sym_eigh

__all__ = ["KFACLayer", "KroneckerLayer"]


class KFACLayer:
    """One preconditioned module: its hooks' statistics, factors and decomposition.

    Subclasses say how a module's input and output gradient become ``a`` and ``g``
    rows (:meth:`a_stats`, :meth:`g_stats`) and how its parameter gradients are laid
    out as ``(groups, o, i)`` matrices (:meth:`grad`, :meth:`set_grad`).
    """

    kind = "layer"
    #: whether a bias column is preconditioned with the weight (a trainable bias).
    has_bias = False

    def __init__(self, name: str, module: nn.Module, factor_dtype: torch.dtype | None) -> None:
        self.name = name
        self.module = module
        weight = module.weight
        assert isinstance(weight, Tensor)
        self.factor_dtype = factor_dtype or default_factor_dtype(weight.dtype)
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
        #: the passes whose samples G has counted (a pass's first backpropagated call).
        self.counted: set[int] = set()
        #: an interrupted :meth:`add_pair` left these statistics out (warned at the step).
        self.dropped = False

    def a_input(self, x: Tensor) -> Tensor:
        """One forward call's input as :meth:`a_stats` reads it (in ``factor_dtype``)."""
        return x.detach().to(self.factor_dtype)

    def batch_size(self, x: Tensor) -> int:
        """Samples in one input: its dimension 0 (subclasses count an unbatched input as 1)."""
        return int(x.shape[0]) if x.ndim else 1

    def add_pair(self, x: Tensor, grad_output: Tensor, scale: float, samples: int) -> None:
        """Add one backpropagated call: its input to A, its output gradient to G.

        The two enter together, when the gradient arrives: a forward that is never
        backpropagated (a metric in training mode, a pass abandoned after an error)
        leaves both factors alone.  ``scale`` turns the gradient of the loss that was
        differentiated into the per-sample gradient (the local batch size for a mean
        loss, divided by a GradScaler's scale); ``samples`` is the batch size of the call
        (0 for a further call of a layer in the same pass).
        """
        in_place = self.a_sum is not None
        try:
            a_sum, rows = self.accumulate_a(self.a_input(x), self.a_sum)
            g = grad_output.detach().to(self.factor_dtype) * scale
            g_sum = self.accumulate_g(g, self.g_sum)
        except BaseException:
            if in_place:
                # the sums were being added to in place: this step's statistics of the
                # layer are torn, so they are left out (with a warning at the step)
                self.a_sum = self.g_sum = None
                self.a_rows = self.g_samples = 0.0
                self.dropped = True
            raise
        self.a_sum, self.g_sum = a_sum, g_sum
        self.a_rows += rows
        self.g_samples += samples
        self.backward_calls += 1

    def accumulate_a(self, x: Tensor, acc: Tensor | None) -> tuple[Tensor, int]:
        """``acc + Σ a aᵀ`` of one input (a new sum if ``acc`` is None), and its row count."""
        s, rows = self.a_stats(x)
        return (s if acc is None else acc + s), rows

    def accumulate_g(self, g: Tensor, acc: Tensor | None) -> Tensor:
        """``acc + Σ g gᵀ`` of one scaled output gradient (a new sum if ``acc`` is None)."""
        s = self.g_stats(g)
        return s if acc is None else acc + s

    def position_mask(self, x: Tensor) -> Tensor | None:
        """Which positions of one input reach the weight (None: all of them).

        The output gradient at a masked-out position is left out of G (an Embedding's
        padding token gets no weight gradient, so it is no sample of its Fisher block).
        """
        return None

    def stats(self) -> list[Tensor]:
        """The sums that ranks add up: ``[Σ a aᵀ, Σ g gᵀ]`` (zeros where nothing was seen)."""
        a_shape, g_shape = self.factor_shapes()
        kw: dict[str, Any] = {"dtype": self.factor_dtype, "device": self.device}
        a = self.a_sum if self.a_sum is not None else torch.zeros(a_shape, **kw)
        g = self.g_sum if self.g_sum is not None else torch.zeros(g_shape, **kw)
        return [a, g]

    def new_factors(
        self, a_sum: Tensor, a_rows: float, g_sum: Tensor, g_samples: float, decay: float
    ) -> tuple[Tensor, Tensor]:
        """The running factors with the (rank-summed) statistics folded in.

        New tensors: the current factors stay as they are until the step commits.
        """
        a, g = (self.A, self.G) if self.A is not None and self.G is not None else (None, None)
        if a is None or g is None:
            a, g = self.identity_factors()
        new_a = a.mul(decay).add_(a_sum, alpha=(1.0 - decay) / a_rows)
        new_g = g.mul(decay).add_(g_sum, alpha=(1.0 - decay) / g_samples)
        return new_a, new_g

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

    def grad(self, whole: Mapping[Tensor, Tensor] | None = None) -> Tensor | None:
        """The parameter gradients as a ``(groups, o, i)`` matrix; None if there is none.

        ``whole``: the gathered gradients of sharded parameters (:mod:`..sharding`).
        """
        raise NotImplementedError

    def has_grad(self) -> bool:
        """Whether the weight has a gradient (no communication, unlike :meth:`grad`)."""
        return self.module.weight.grad is not None

    def param_grad(self, p: Tensor | None, whole: Mapping[Tensor, Tensor] | None) -> Tensor | None:
        """``p.grad`` whole (gathered if sharded); None without a parameter or gradient."""
        return None if p is None else grad_of(p, whole or {})

    def set_grad(self, p: Tensor) -> None:
        """Write a ``(groups, o, i)`` matrix back into the parameters' ``.grad``."""
        raise NotImplementedError

    def decomposition(
        self,
        method: str,
        damping: float,
        dtype: torch.dtype,
        uses: int = 1,
        factors: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """The decomposition of ``factors`` (default: the current ones, or the identity).

        ``uses`` is the number of steps that will precondition with it (the inverse
        update interval); the inverse method picks its cheapest form from it.  A new
        dict of new tensors: :attr:`inv` is left as it is.
        """
        raise NotImplementedError

    def decompose(self, method: str, damping: float, dtype: torch.dtype, uses: int = 1) -> None:
        """Set :attr:`inv` to :meth:`decomposition` of the current factors."""
        self.inv = self.decomposition(method, damping, dtype, uses)

    def _factors(self, factors: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        if factors is not None:
            return factors
        if self.A is not None and self.G is not None:
            return self.A, self.G
        return self.identity_factors()

    def grad_shape(self) -> tuple[int, int, int]:
        """The ``(groups, o, i)`` shape of :meth:`grad`: G's order by A's."""
        a_shape, g_shape = self.factor_shapes()
        return g_shape[0], g_shape[-1], a_shape[-1]

    def inverse_shapes(self, method: str, uses: int = 1) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors of :attr:`inv`, so a receiving rank can allocate them."""
        raise NotImplementedError

    def inverse_layouts(self, method: str) -> list[dict[str, tuple[int, ...]]]:
        """Every key → shape layout of :attr:`inv` for ``method`` (checked when state loads)."""
        return [self.inverse_shapes(method)]

    def precondition(
        self, grad: Tensor, method: str, damping: float, inv: dict[str, Tensor] | None = None
    ) -> Tensor:
        """The preconditioned gradient ``(A ⊗ G + λI)⁻¹ ∇`` (eigen) or its inverse-method twin.

        ``inv``: the decomposition to use (default :attr:`inv`).
        """
        raise NotImplementedError

    def curvature(self, delta: Tensor) -> Tensor:
        """``vec(δ)ᵀ (A ⊗ G) vec(δ)`` for a step ``δ`` in the ``(groups, o, i)`` layout."""
        raise NotImplementedError

    # -- shared helpers ----------------------------------------------------------------
    def empty_inverse(self, method: str, dtype: torch.dtype, uses: int = 1) -> dict[str, Tensor]:
        """Uninitialised tensors for :attr:`inv`, for a rank that receives it by broadcast."""
        shapes = self.inverse_shapes(method, uses)
        return {k: torch.empty(s, dtype=dtype, device=self.device) for k, s in shapes.items()}

    @staticmethod
    def contiguous(inv: dict[str, Tensor]) -> dict[str, Tensor]:
        """``inv`` with every tensor row-major.

        eigh returns column-major eigenvectors; a rank that receives them by broadcast
        holds row-major copies, and BLAS may round a product differently for the two
        layouts.  One layout everywhere keeps the ranks bitwise equal.
        """
        return {k: v.contiguous() for k, v in inv.items()}

    def params(self) -> list[nn.Parameter]:
        """The parameters this layer preconditions (weight, then bias if preconditioned)."""
        out = [self.module.weight]
        bias = getattr(self.module, "bias", None)
        if self.has_bias and isinstance(bias, nn.Parameter):
            out.append(bias)
        return [p for p in out if isinstance(p, nn.Parameter)]

    def __repr__(self) -> str:
        a, g = self.factor_shapes()
        return f"{type(self).__name__}({self.name!r}, A={tuple(a)}, G={tuple(g)})"


#: The inverse method keeps a factor of size ``n`` as its Cholesky factor, and solves
#: with it each step, when ``uses · m < CHOLESKY_RATIO · n`` (``m`` the gradient's other
#: dimension, ``uses`` the steps until the next inversion): forming the inverse costs
#: ``2n³/3`` flops once (LAPACK potri), two triangular solves cost about 1.3 times the one
#: ``2mn²`` matrix product with the inverse each step.  Measured on one CPU thread
#: (n = 1281, m = 256): potri 2.15 products, the solves 1.32.
CHOLESKY_RATIO = 1.3


def _gram(rows: Tensor, bias: bool, out: Tensor, tmp: Tensor | None, add: bool) -> Tensor:
    """``out = [rows, 1]ᵀ [rows, 1]`` (``+=`` if ``add``) for ``rows: (groups, R, k)``.

    The bias row and column (``bias``) are the column sums and ``R``: a ones column in
    the product would give it an odd width (``k+1``), on which BLAS runs markedly
    slower, and copy the rows once more.  ``tmp`` is a ``(groups, k, k)`` scratch for the
    product when there is a bias: BLAS writing into the strided ``k × k`` block of
    ``out`` was slower than a contiguous product and one copy (measured).
    """
    _, r, k = rows.shape
    try:
        if not bias and add:
            return out.baddbmm_(rows.mT, rows)
        torch.bmm(rows.mT, rows, out=out if not bias else tmp)
    except RuntimeError:
        # inside a torch.func transform (vmap) out= and in-place writes are refused
        return _gram_functional(rows, bias, out if add else None)
    if not bias:
        return out
    assert tmp is not None
    s = rows.sum(dim=1)
    if add:
        out[:, :k, :k].add_(tmp)
        out[:, k, :k].add_(s)
        out[:, :k, k].add_(s)
        out[:, k, k].add_(float(r))
    else:
        out[:, :k, :k].copy_(tmp)
        out[:, k, :k] = s
        out[:, :k, k] = s
        out[:, k, k] = float(r)
    return out


def _gram_functional(rows: Tensor, bias: bool, acc: Tensor | None) -> Tensor:
    if bias:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
    s = rows.mT @ rows
    return s if acc is None else acc + s


class KroneckerLayer(KFACLayer):
    """A layer with dense factors ``A: (groups, i, i)`` and ``G: (groups, o, o)``.

    Subclasses give the rows of ``a`` without the bias 1 (:meth:`a_rows_of`) and the
    rows of ``g`` (:meth:`g_rows_of`), both ``(groups, rows, width)``.
    """

    groups = 1

    def __init__(self, name: str, module: nn.Module, factor_dtype: torch.dtype | None) -> None:
        super().__init__(name, module, factor_dtype)
        # statistics buffers reused from one factor update to the next: a fresh
        # megabyte-sized tensor per step costs page faults comparable to the product
        self._buf: dict[str, Tensor] = {}
        self._eig_scale: tuple[float, Tensor, Tensor, int, int, Tensor] | None = None

    def a_rows_of(self, x: Tensor) -> Tensor:
        """The rows ``a`` (without the bias 1) of one input: ``(groups, rows, i)``."""
        raise NotImplementedError

    def g_rows_of(self, g: Tensor) -> Tensor:
        """The rows of one (scaled) output gradient: ``(groups, rows, o)``."""
        raise NotImplementedError

    def _buffer(self, key: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        b = self._buf.get(key)
        if b is None or b.shape != shape or b.dtype != like.dtype or b.device != like.device:
            b = like.new_empty(shape)
            self._buf[key] = b
        return b

    def _accumulate(self, key: str, rows: Tensor, bias: bool, acc: Tensor | None) -> Tensor:
        # the first call since the last factor update overwrites the reused buffer
        g, _, k = rows.shape
        n = k + int(bias)
        out = acc if acc is not None else self._buffer(key, (g, n, n), rows)
        tmp = self._buffer(key + "_tmp", (g, k, k), rows) if bias else None
        return _gram(rows, bias, out, tmp, add=acc is not None)

    def accumulate_a(self, x: Tensor, acc: Tensor | None) -> tuple[Tensor, int]:  # noqa: D102
        rows = self.a_rows_of(x)
        return self._accumulate("a", rows, self.has_bias, acc), rows.shape[1]

    def accumulate_g(self, g: Tensor, acc: Tensor | None) -> Tensor:  # noqa: D102
        return self._accumulate("g", self.g_rows_of(g), False, acc)

    def a_stats(self, x: Tensor) -> tuple[Tensor, int]:  # noqa: D102
        rows = self.a_rows_of(x)
        g, r, k = rows.shape
        n = k + int(self.has_bias)
        out, tmp = rows.new_empty(g, n, n), rows.new_empty(g, k, k)
        return _gram(rows, self.has_bias, out, tmp, add=False), r

    def g_stats(self, g: Tensor) -> Tensor:  # noqa: D102
        rows = self.g_rows_of(g)
        o = rows.shape[-1]
        return _gram(rows, False, rows.new_empty(rows.shape[0], o, o), None, add=False)

    def identity_factors(self) -> tuple[Tensor, Tensor]:  # noqa: D102
        a_shape, g_shape = self.factor_shapes()
        kw: dict[str, Any] = {"dtype": self.factor_dtype, "device": self.device}
        eye_a = torch.eye(a_shape[-1], **kw).expand(a_shape).clone()
        eye_g = torch.eye(g_shape[-1], **kw).expand(g_shape).clone()
        return eye_a, eye_g

    def _use_cholesky(self, uses: int) -> tuple[bool, bool]:
        (_, i, _), (_, o, _) = self.factor_shapes()
        return uses * o < CHOLESKY_RATIO * i, uses * i < CHOLESKY_RATIO * o

    def inverse_shapes(self, method: str, uses: int = 1) -> dict[str, tuple[int, ...]]:  # noqa: D102
        (ga, i, _), (gg, o, _) = self.factor_shapes()
        if method == "eigen":
            return {"QA": (ga, i, i), "dA": (ga, i), "QG": (gg, o, o), "dG": (gg, o)}
        chol_a, chol_g = self._use_cholesky(uses)
        return {
            "A_chol" if chol_a else "A_inv": (ga, i, i),
            "G_chol" if chol_g else "G_inv": (gg, o, o),
        }

    def inverse_layouts(self, method: str) -> list[dict[str, tuple[int, ...]]]:  # noqa: D102
        if method == "eigen":
            return [self.inverse_shapes(method)]
        # the inverse method keeps each factor as an inverse or as a Cholesky factor,
        # whichever the inverse update interval made cheaper
        (ga, i, _), (gg, o, _) = self.factor_shapes()
        return [
            {a: (ga, i, i), g: (gg, o, o)} for a in ("A_inv", "A_chol") for g in ("G_inv", "G_chol")
        ]

    def decomposition(  # noqa: D102
        self,
        method: str,
        damping: float,
        dtype: torch.dtype,
        uses: int = 1,
        factors: tuple[Tensor, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        a, g = self._factors(factors)
        inv: dict[str, Tensor] = {}
        if method == "eigen":
            dA, QA = sym_eigh(a, dtype)
            dG, QG = sym_eigh(g, dtype)
            inv = {"QA": QA, "dA": dA, "QG": QG, "dG": dG}
        else:
            for key, f, chol in zip("AG", (a, g), self._use_cholesky(uses), strict=True):
                m = f.to(dtype, copy=True)
                m.diagonal(dim1=-2, dim2=-1).add_(damping)
                if chol:
                    inv[key + "_chol"] = spd_cholesky(m)
                else:
                    inv[key + "_inv"] = spd_inverse(m)
        return self.contiguous(inv)

    def _eigen_scale(self, dA: Tensor, dG: Tensor, damping: float) -> Tensor:
        # 1/(d_G d_Aᵀ + λ) changes only with the decomposition or λ: computed once for
        # the steps in between (the tensors' versions catch an in-place broadcast)
        c = self._eig_scale
        if (
            c is not None
            and c[0] == damping
            and c[1] is dA
            and c[2] is dG
            and c[3] == dA._version
            and c[4] == dG._version
        ):
            return c[5]
        r = torch.reciprocal(dG.unsqueeze(-1) * dA.unsqueeze(-2) + damping)
        self._eig_scale = (damping, dA, dG, dA._version, dG._version, r)
        return r

    def _aligned(self, key: str, like: Tensor) -> Tensor:
        # A product's output with rows of a width that is not a multiple of 16 floats
        # (1281 = 1280 inputs and the bias) ran ~20% slower than with 1280 (measured,
        # MKL, one thread); writing it into a reused buffer with padded rows (only the
        # leading dimension changes, the values are bitwise the same) recovers that.
        *lead, n = like.shape
        width = -(-n // 16) * 16
        b = self._buffer(key, (*lead, width), like)
        return b[..., :n]

    def precondition(  # noqa: D102
        self, grad: Tensor, method: str, damping: float, inv: dict[str, Tensor] | None = None
    ) -> Tensor:
        # The result is a view into a buffer this layer reuses at its next call.
        inv = self.inv if inv is None else inv
        ping, pong = "p0", "p1"
        if method == "eigen":
            QA, dA, QG, dG = inv["QA"], inv["dA"], inv["QG"], inv["dG"]
            g = grad.to(QA.dtype)
            t = torch.bmm(QG.mT, g, out=self._aligned(ping, g))
            v = torch.bmm(t, QA, out=self._aligned(pong, g))
            v.mul_(self._eigen_scale(dA, dG, damping))
            t = torch.bmm(QG, v, out=self._aligned(ping, g))
            p = torch.bmm(t, QA.mT, out=self._aligned(pong, g))
            return p.to(grad.dtype)
        dtype = (inv["G_inv"] if "G_inv" in inv else inv["G_chol"]).dtype
        v = grad.to(dtype)
        t = self._aligned(ping, v)
        if "G_inv" in inv:
            torch.bmm(inv["G_inv"], v, out=t)
        else:
            ug = inv["G_chol"]  # G + λI = UᵀU: U⁻¹(U⁻ᵀ v)
            torch.linalg.solve_triangular(ug.mT, v, upper=False, out=t)
            torch.linalg.solve_triangular(ug, t, upper=True, out=t)
        p = self._aligned(pong, v)
        if "A_inv" in inv:
            torch.bmm(t, inv["A_inv"], out=p)
        else:
            ua = inv["A_chol"]  # (v U⁻¹) U⁻ᵀ
            torch.linalg.solve_triangular(ua, t, upper=True, left=False, out=p)
            torch.linalg.solve_triangular(ua.mT, p, upper=False, left=False, out=p)
        return p.to(grad.dtype)

    def curvature(self, delta: Tensor) -> Tensor:  # noqa: D102
        assert self.A is not None and self.G is not None
        d = delta.to(self.A.dtype)
        return (d * (self.G @ d @ self.A)).sum()
