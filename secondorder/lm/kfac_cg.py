r"""A Kronecker-factored (K-FAC) preconditioner for LM's conjugate-gradient solver.

CG on ``(JᵀJ + λD)δ = b`` converges in few iterations when its preconditioner ``M``
resembles the matrix.  The Jacobi preconditioner keeps only ``diag(JᵀJ)``; for a
layer ``s = W a + b`` (an ``nn.Linear``) the Gauss-Newton block of ``JᵀJ`` over the
layer's parameters ``[W | b]`` (an ``o × (i+1)`` matrix, x's row-major order) is

.. math:: \sum_n \sum_k (g_{nk} g_{nk}^\top) \otimes (\bar a_n \bar a_n^\top),
   \qquad g_{nk} = \partial r_{nk} / \partial s_n,\ \bar a_n = [a_n; 1],

which K-FAC approximates by the product of its two averages, ``G ⊗ A`` with

.. math:: A = \sum_n \bar a_n \bar a_n^\top, \qquad
   G = \frac1N \sum_n \sum_k g_{nk} g_{nk}^\top .

The ``1/N`` sits on G so that ``G ⊗ A`` is the exact block for one sample (and the
block of any batch whose samples share one input).  A layer applied to several
positions per sample (a sequence ``(N, T, i)``) follows the KFC convention: A is
averaged over the ``P`` positions (``1/P``) and G sums them.  A and G are sums over
every slice and every rank (through the reducer), so all ranks build the same
preconditioner, equal to one process on the concatenated batch.

**Damping.**  ``D``'s entries over a block, reshaped ``o × (i+1)``, are replaced by
their best rank-one fit ``u vᵀ`` (row sums times column sums over the total; exact
when D is rank one, e.g. ``damping_matrix="identity"``), so that each block of M is

.. math:: M = G \otimes A + \lambda\,\mathrm{diag}(u) \otimes \mathrm{diag}(v)
   = (U^{½} \otimes V^{½}) (S_G \otimes S_A + \lambda I) (U^{½} \otimes V^{½}),

with ``S_G = U^{-½} G U^{-½} = Q_G Λ_G Q_Gᵀ`` and ``S_A`` likewise.  The two
eigendecompositions are λ-free: they are computed once per linearisation, and each λ
an iteration tries costs two small matrix products per layer,
``M⁻¹v = U^{-½} Q_G [(Q_Gᵀ U^{-½} V V^{-½} Q_A) / (Λ_G Λ_Aᵀ + λ)] Q_Aᵀ V^{-½}``.
Unlike the factored damping ``(G + π√λ I) ⊗ (A + √λ/π I)`` this adds no cross terms
and needs no refactorisation when λ changes.  Coordinates of parameters outside a
supported layer (anything but ``nn.Linear``, a frozen weight, a layer called more
than once per forward) keep the Jacobi diagonal ``1/(diag(JᵀJ) + λD)``.

Choose ``cg_preconditioner="kfac"`` for wide networks, whose per-layer couplings the
Jacobi diagonal ignores; the statistics cost one forward and, per residual
component of a sample, one backward pass over the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from .layers import trainable_layers
from .walk import BatchWalk

__all__ = [
    "CG_PRECONDITIONERS",
    "KroneckerBlock",
    "KroneckerPreconditioner",
    "KroneckerStats",
    "kronecker_blocks",
    "kronecker_stats",
    "slice_statistics",
]

CG_PRECONDITIONERS = ("jacobi", "kfac")


@dataclass(frozen=True)
class KroneckerBlock:
    """One ``nn.Linear`` whose weight is trainable, and where its entries sit in x.

    Attributes:
        name: the module's qualified name in the model.
        index: ``(o, i)`` or ``(o, i+1)`` long tensor: x's index of ``W[r, c]`` and,
            in the last column when the bias is trainable, of ``b[r]``.
        bias: whether the bias is among the unknowns (A then carries a ones entry).
        weight_at, bias_at: offsets in x of the weight's ``o·i`` entries (row-major)
            and of the bias's ``o`` entries (-1 when the bias is not an unknown).
    """

    name: str
    index: Tensor
    bias: bool
    weight_at: int = 0
    bias_at: int = -1

    def block(self, v: Tensor) -> Tensor:
        """``[W | b]``'s entries of the flat ``v`` as an ``o × (i+1)`` (or ``o × i``) matrix."""
        o, c = self.index.shape
        i = c - 1 if self.bias else c
        w = v[self.weight_at : self.weight_at + o * i].view(o, i)
        if not self.bias:
            return w
        return torch.cat([w, v[self.bias_at : self.bias_at + o, None]], dim=1)

    def write(self, out: Tensor, m: Tensor) -> None:
        """Write the ``o × c`` matrix ``m`` into ``out`` at this layer's entries (:meth:`block`)."""
        o, c = self.index.shape
        i = c - 1 if self.bias else c
        out[self.weight_at : self.weight_at + o * i] = m[:, :i].reshape(-1)
        if self.bias:
            out[self.bias_at : self.bias_at + o] = m[:, i]


def kronecker_blocks(
    model: nn.Module, names: Sequence[str], params: Sequence[Tensor]
) -> list[KroneckerBlock]:
    """The ``nn.Linear`` layers of ``model`` whose own weight is one of the unknowns ``names``."""
    offsets: dict[str, int] = {}
    start = 0
    for name, p in zip(names, params, strict=True):
        offsets[name] = start
        start += p.numel()
    blocks = []
    for layer in trainable_layers(model, names, params):
        module = layer.module
        prefix = f"{layer.name}." if layer.name else ""
        w_name, b_name = prefix + "weight", prefix + "bias"
        if type(module) is not nn.Linear or layer.weight != w_name:
            continue
        o, i = module.weight.shape
        rows = torch.arange(o)[:, None]
        index = offsets[w_name] + rows * i + torch.arange(i)[None, :]
        bias = layer.bias == b_name
        if bias:
            index = torch.cat([index, offsets[b_name] + rows], dim=1)
        blocks.append(
            KroneckerBlock(
                layer.name, index, bias, offsets[w_name], offsets[b_name] if bias else -1
            )
        )
    return blocks


@dataclass
class KroneckerStats:
    """The factors of every supported layer after the cross-rank reduction.

    Attributes:
        layers: the layers, in model order.
        A: ``Σ_n ā ā ᵀ`` per layer (``1/P`` over positions).
        G: ``1/N Σ_n Σ_k g gᵀ`` per layer.
        used: per layer, whether its factors precondition its block (a layer whose
            hook fired other than once per forward keeps the Jacobi diagonal).
    """

    layers: list[KroneckerBlock]
    A: list[Tensor]
    G: list[Tensor]
    used: list[bool]


def slice_statistics(
    model: nn.Module,
    layers: Sequence[KroneckerBlock],
    residuals: Callable[[], Tensor],
    samples: int,
) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """One slice's ``(Σ ā āᵀ / P, Σ g gᵀ, hook calls)`` per layer.

    ``residuals()`` runs the forward pass of ``samples`` samples through ``model``
    (with parameters that require grad, so every layer output is in the graph) and
    returns the flat residuals, sample-major.  One backward per residual component
    ``k`` of a sample gives ``g_nk`` for every sample n at once, samples being
    independent.
    """
    modules = dict(model.named_modules())
    seen: dict[str, list[tuple[Tensor, Tensor]]] = {layer.name: [] for layer in layers}

    def hook_for(name: str) -> Callable[[nn.Module, Any, Tensor], Tensor]:
        def hook(module: nn.Module, inputs: Any, out: Tensor) -> Tensor:
            seen[name].append((inputs[0].detach(), out))
            # A clone downstream: an in-place activation then changes the clone, and the
            # gradient with respect to the layer's own output stays reachable.
            return out.clone()

        return hook

    handles = [modules[layer.name].register_forward_hook(hook_for(layer.name)) for layer in layers]
    try:
        with torch.enable_grad():
            r = residuals()
    finally:
        for h in handles:
            h.remove()
    r2 = r.reshape(samples, -1)
    calls = [len(seen[layer.name]) for layer in layers]
    live = [k for k, layer in enumerate(layers) if calls[k] == 1]
    outs = [seen[layers[k].name][0][1] for k in live]
    g_sums: dict[int, Tensor] = {}
    for j in range(r2.shape[1] if outs else 0):
        grads = torch.autograd.grad(
            r2[:, j].sum(), outs, retain_graph=j + 1 < r2.shape[1], allow_unused=True
        )
        for k, g in zip(live, grads, strict=True):
            if g is None:
                continue
            g = g.reshape(-1, g.shape[-1])
            part = g.T @ g
            g_sums[k] = part if k not in g_sums else g_sums[k] + part
    a_parts, g_parts = [], []
    for k, layer in enumerate(layers):
        o, c = layer.index.shape
        dtype = r.dtype
        if k not in live:
            a_parts.append(torch.zeros(c, c, dtype=dtype, device=r.device))
            g_parts.append(torch.zeros(o, o, dtype=dtype, device=r.device))
            continue
        a = seen[layer.name][0][0]
        positions = a.numel() // (samples * a.shape[-1])
        a = a.reshape(-1, a.shape[-1])
        if layer.bias:
            a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
        a_parts.append((a.T @ a) / positions)
        g_parts.append(g_sums.get(k, torch.zeros(o, o, dtype=dtype, device=r.device)))
    return a_parts, g_parts, calls


@dataclass(frozen=True)
class _Block:
    """One layer's part of M⁻¹: x's indices, ``U^-½``, ``V^-½``, the eigenbases, ``Λ_G Λ_Aᵀ``."""

    layer: KroneckerBlock
    iu: Tensor
    iv: Tensor
    qg: Tensor
    qa: Tensor
    prod: Tensor


class KroneckerPreconditioner:
    """``M⁻¹`` of one linearisation: the layers' eigenbases, then any λ (module docstring).

    Built by :meth:`~secondorder.lm.cg.CGSolver.factor` once per iteration from
    the record's :class:`KroneckerStats`, the damping diagonal ``d`` and
    ``diag(JᵀJ)``; :meth:`apply` runs per λ and per CG iteration.
    """

    def __init__(self, stats: KroneckerStats, d: Tensor, col_sq: Tensor) -> None:
        self.d = d
        self.col_sq = col_sq
        dtype, wide = d.dtype, torch.float64
        tiny = torch.finfo(wide).tiny
        self.blocks: list[_Block] = []
        for layer, A, G, used in zip(stats.layers, stats.A, stats.G, stats.used, strict=True):
            if not used:
                continue
            dblock = layer.block(d).to(wide)
            total = dblock.sum().clamp(min=tiny)
            u = dblock.sum(1).clamp(min=tiny)
            v = (dblock.sum(0) / total).clamp(min=tiny)
            iu, iv = u.rsqrt(), v.rsqrt()
            eg, qg = torch.linalg.eigh(G.to(wide) * iu[:, None] * iu[None, :])
            ea, qa = torch.linalg.eigh(A.to(wide) * iv[:, None] * iv[None, :])
            # Round-off can make eigenvalues of a semidefinite matrix slightly negative.
            prod = eg.clamp(min=0.0)[:, None] * ea.clamp(min=0.0)[None, :]
            self.blocks.append(
                _Block(
                    layer, iu.to(dtype), iv.to(dtype), qg.to(dtype), qa.to(dtype), prod.to(dtype)
                )
            )

    def apply(self, damping: float, res: Tensor) -> Tensor:
        """``M⁻¹ res`` at λ = ``damping``."""
        # Jacobi everywhere first, then each layer's block overwrites its entries.
        out = res / (self.col_sq + damping * self.d)
        tiny = torch.finfo(res.dtype).tiny
        for b in self.blocks:
            su, sv = b.iu[:, None], b.iv[None, :]
            w = b.qg.T @ (b.layer.block(res) * su * sv) @ b.qa
            w = w / (b.prod + damping).clamp(min=tiny)
            b.layer.write(out, (b.qg @ w @ b.qa.T) * su * sv)
        return out


def kronecker_stats(problem: BatchWalk, x: Tensor) -> KroneckerStats:
    """The K-FAC factors of the model's ``nn.Linear`` layers at ``x``, all ranks summed.

    One forward per slice with hooks on the layers, one backward per residual
    component; ``A`` and ``Σ g gᵀ`` are summed over slices and ranks, then G is
    divided by the global sample count (:mod:`secondorder.lm.kfac_cg`).  A rank
    whose model raises here joins the reduction with zeros and a failure flag, as
    in :meth:`~.problem.ModelProblem.linearize`: every rank raises.
    """
    group, fn = problem.group, problem.function
    layers = kronecker_blocks(fn.model, fn.names, fn.params)
    wide = torch.float64
    shapes = [tuple(layer.index.shape) for layer in layers]

    def zeros() -> tuple[list[Tensor], list[Tensor], Tensor]:
        a = [torch.zeros(c, c, dtype=x.dtype, device=x.device) for _, c in shapes]
        g = [torch.zeros(o, o, dtype=x.dtype, device=x.device) for o, _ in shapes]
        # Samples seen, slices walked, the hook calls of each layer, failed ranks.
        return a, g, torch.zeros(3 + len(layers), dtype=wide, device=x.device)

    a_sum, g_sum, tally = zeros()
    error: Exception | None = None
    try:
        points = fn.points(x)
        with fn.frozen():
            for k, inputs, targets in group.stage(problem.slices()):
                ev = problem.replicas[k]
                params = {name: p.detach().requires_grad_() for name, p in points[k].items()}
                samples = len(next(t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)))
                with group.on(k):
                    a_parts, g_parts, calls = slice_statistics(
                        ev.model,
                        layers,
                        functools.partial(ev.batch, params, inputs, targets),
                        samples,
                    )
                for i in range(len(layers)):
                    a_sum[i] += group.gather(a_parts[i])
                    g_sum[i] += group.gather(g_parts[i])
                tally[0] += samples
                tally[1] += 1
                tally[2:-1] += torch.tensor(calls, dtype=wide, device=x.device)
    except Exception as exc:
        # The flag rides in the tally: no collective is added when nothing fails.
        error = problem.reducer.hold(exc)
        a_sum, g_sum, tally = zeros()
        tally[-1] = 1.0
    problem.reducer.sum_([tally, *a_sum, *g_sum])
    problem.reducer.raise_together(error, tally[-1], "computing the K-FAC factors")
    samples_total = max(float(tally[0]), 1.0)
    # A layer keeps its factors only if its hook fired once in every forward of
    # every rank: a shared or skipped layer falls back to the Jacobi diagonal.
    used = [bool(tally[2 + i] == tally[1]) for i in range(len(layers))]
    return KroneckerStats(layers, a_sum, [g / samples_total for g in g_sum], used)
