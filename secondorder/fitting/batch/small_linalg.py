"""Many tiny symmetric systems at once: ``(A + λI) z = b`` for every fit of a batch.

A fit of a few parameters has an ``n×n`` normal matrix; a batch has one per fit.
Batched LAPACK (``torch.linalg.cholesky_ex``) pays a per-matrix call for a few dozen
flops, so for ``n ≤`` :data:`UNROLLED_MAX_N` the Cholesky factorisation is written out
entry by entry: each entry of ``L`` is one tensor over the whole batch, and the solve
is a few dozen elementwise operations on contiguous ``(B,)`` rows (inside
``torch.compile``, one fused loop over the fits).  The threshold was measured
(``python -m benchmarks.batch_fits --solve``, recorded in ``benchmarks/BATCH_FITS.md``).

Matrices and vectors are stored *parameter-major*: ``A[i, j]`` and ``b[i]`` are
tensors of the batch's shape (``A`` ``(n, n, *B)``, ``b`` ``(n, *B)``), so the batch is
the contiguous, vectorised axis.  A matrix that is not positive definite gives a
non-finite ``z`` in its own fit and nowhere else (no exception, no host read).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "UNROLLED_MAX_N",
    "gram",
    "inverse_spd",
    "norm2",
    "parameter_major",
    "quadratic",
    "solve_columns",
    "solve_shifted",
]

#: The largest ``n`` solved by the unrolled factorisation; above it, batched LAPACK.
UNROLLED_MAX_N = 8


def gram(J: Tensor, weight: Tensor | None = None) -> Tensor:
    """``Σ_k w_k J_ik J_jk`` for ``J`` of shape ``(n, B, m)``: the ``(n, n, B)`` matrix."""
    left = J if weight is None else J * weight
    if torch.compiler.is_compiling():
        # Sums the compiler fuses with the Jacobian's own loop (a batched matmul of
        # n×m by m×n matrices is one library call per fit), over point-major copies
        # (n, m, B): each sum then runs down the points with the fits in the vector
        # lanes, instead of across a fit's few points.
        n = J.shape[0]
        right = J.transpose(1, 2).contiguous()
        left = right if weight is None else left.transpose(1, 2).contiguous()
        sums: dict[tuple[int, int], Tensor] = {}
        for i in range(n):
            for j in range(i, n):
                sums[i, j] = (left[i] * right[j]).sum(0)
        rows = [torch.stack([sums[min(i, j), max(i, j)] for j in range(n)]) for i in range(n)]
        return torch.stack(rows)
    # Contiguous: each A[i, j] is then a contiguous row over the batch.
    return torch.einsum("ibm,jbm->ijb", left, J).contiguous()


def parameter_major(t: Tensor) -> Tensor:
    """``t`` ``(B, k)``, in a compiled step stored column by column (``t.mT`` contiguous).

    Under ``torch.compile`` this fixes the layout of a step's output, so its loops
    over the fits read each of a fit's few numbers from a contiguous row (the fits in
    the vector lanes) instead of with a stride; eagerly it is ``t`` itself.
    """
    if torch.compiler.is_compiling():
        return t.mT.contiguous().mT
    return t


def norm2(v: Tensor, dim: int) -> Tensor:
    """The Euclidean norm along ``dim``, as ``√Σv²``.

    ``torch.linalg.vector_norm`` over an axis of a few entries runs a general
    reduction kernel that costs tens of times the three elementwise passes here.
    """
    return (v * v).sum(dim).sqrt()


def quadratic(A: Tensor, v: Tensor) -> Tensor:
    """``vᵀAv`` per fit, for ``A`` ``(n, n, *B)`` and ``v`` ``(n, *B)``."""
    return (A * v.unsqueeze(0) * v.unsqueeze(1)).sum((0, 1))


def solve_shifted(A: Tensor, shift: Tensor, b: Tensor) -> Tensor:
    """:func:`solve_columns` for a fit-major right-hand side: ``b`` and ``z`` ``(*B, n)``."""
    return torch.movedim(solve_columns(A, shift, torch.movedim(b, -1, 0)), 0, -1)


def solve_columns(A: Tensor, shift: Tensor, b: Tensor) -> Tensor:
    """``z`` with ``(A + shift·I) z = b`` per fit; ``A`` ``(n, n, *B)``, ``b`` ``(n, *B)``.

    ``shift`` has the batch's shape.  A fit whose shifted matrix is not positive
    definite gets NaN or inf in its ``z``.
    """
    n = A.shape[0]
    if n > UNROLLED_MAX_N:
        return _lapack(A, shift, b)
    return _unrolled(A, shift, b)


def _lapack(A: Tensor, shift: Tensor, b: Tensor) -> Tensor:
    n = A.shape[0]
    M = torch.movedim(torch.movedim(A, 0, -1), 0, -1)  # (*B, n, n)
    M = M + shift[..., None, None] * torch.eye(n, dtype=A.dtype, device=A.device)
    L, info = torch.linalg.cholesky_ex(M)
    # A failed factorisation leaves a partial L whose solve can be finite: mark it NaN.
    z = torch.cholesky_solve(torch.movedim(b, 0, -1).unsqueeze(-1), L).squeeze(-1)
    z = torch.where((info == 0).unsqueeze(-1), z, math.nan)
    return torch.movedim(z, -1, 0)


def inverse_spd(A: Tensor) -> Tensor:
    """``A⁻¹`` per fit for symmetric positive definite ``A`` ``(n, n, *B)``, ``n ≤ 8``.

    ``A = LLᵀ`` entry by entry, ``W = L⁻¹`` by forward substitution, ``A⁻¹ = WᵀW``:
    each entry one ``(B,)`` expression, as :func:`solve_columns` solves.  A fit whose
    ``A`` is not positive definite gets NaN or inf entries, in its own inverse only.
    """
    n = A.shape[0]
    if n > UNROLLED_MAX_N:
        raise ValueError(f"inverse_spd unrolls n <= {UNROLLED_MAX_N}, got n={n}")
    L, inv = _cholesky(A, torch.zeros_like(A[0, 0]))
    # W = L⁻¹, lower triangular: W[i][j] for j ≤ i.
    W: list[list[Tensor]] = [[] for _ in range(n)]
    for i in range(n):
        for j in range(i):
            t = L[i][j] * W[j][j]
            for k in range(j + 1, i):
                t = t + L[i][k] * W[k][j]
            W[i].append(-t * inv[i])
        W[i].append(inv[i])
    out: list[list[Tensor]] = [[] for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if j < i:
                out[i].append(out[j][i])
                continue
            t = W[j][i] * W[j][j]
            for k in range(j + 1, n):
                t = t + W[k][i] * W[k][j]
            out[i].append(t)
    return torch.stack([torch.stack(row) for row in out])


def _cholesky(A: Tensor, shift: Tensor) -> tuple[list[list[Tensor]], list[Tensor]]:
    """``L`` of ``A + shift·I`` below the diagonal (``L[i][k]``, k < i) and ``1/L_jj``.

    ``1/L_jj`` from ``rsqrt``: a pivot ≤ 0 gives NaN or inf, which reaches every later
    entry computed from it.
    """
    n = A.shape[0]
    L: list[list[Tensor]] = [[] for _ in range(n)]
    inv: list[Tensor] = []
    for j in range(n):
        s = A[j, j] + shift
        for k in range(j):
            s = s - L[j][k] * L[j][k]
        inv.append(torch.rsqrt(s))
        for i in range(j + 1, n):
            t = A[i, j]
            for k in range(j):
                t = t - L[i][k] * L[j][k]
            L[i].append(t * inv[j])
    return L, inv


def _unrolled(A: Tensor, shift: Tensor, b: Tensor) -> Tensor:
    """Cholesky ``LLᵀ`` entry by entry (:func:`_cholesky`), then forward and back substitution.

    Each entry of ``L`` is one ``(B,)`` expression; a pivot ≤ 0 gives NaN or inf,
    which reaches every later entry of that fit's ``z``.
    """
    n = A.shape[0]
    L, inv = _cholesky(A, shift)
    y: list[Tensor] = []
    for i in range(n):
        t = b[i] * inv[i] if i == 0 else b[i]
        for k in range(i):
            t = t - L[i][k] * y[k]
        y.append(t if i == 0 else t * inv[i])
    z: list[Tensor] = [y[0]] * n
    for i in reversed(range(n)):
        t = y[i] * inv[i] if i == n - 1 else y[i]
        for k in reversed(range(i + 1, n)):
            t = t - L[k][i] * z[k]
        z[i] = t if i == n - 1 else t * inv[i]
    return torch.stack(z)
