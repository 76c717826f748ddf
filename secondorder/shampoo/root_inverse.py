"""Batched inverse roots ``A^(-1/p)`` of symmetric positive semi-definite matrices.

Every function takes a stack ``(B, n, n)`` and works on all ``B`` matrices in one
call (one batched ``eigh`` or a few batched products), which is where Shampoo's
step spends its time.

Regularisation (DistributedShampoo's default): the eigendecomposition is taken of
``A + εI``; if its smallest eigenvalue ``λ_min`` is still below ``ε`` (``A`` was
indefinite through rounding), every eigenvalue is shifted to ``λ − λ_min + ε``, so the
smallest becomes ``ε`` and the inverse root stays finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "EighResult",
    "all_finite",
    "batched_eigh",
    "coupled_newton_root_inverse",
    "eigh_root_inverse",
    "finite_per_matrix",
]

# Looked up at call time, so tests can make it fail on purpose.
_eigh = torch.linalg.eigh


@dataclass
class EighResult:
    """Eigenvalues ``(B, n)``, eigenvectors ``(B, n, n)`` and which matrices failed ``(B,)``.

    A failed matrix has eigenvalues and eigenvectors set to NaN; the caller keeps its
    previous result for it.  ``any_failed``: whether one did, known on the host (the
    matrix-by-matrix fallback decides each on the host), so that a caller need not
    read ``failed`` back from the device.
    """

    eigenvalues: Tensor
    eigenvectors: Tensor
    failed: Tensor
    any_failed: bool = False


def finite_per_matrix(A: Tensor) -> Tensor:
    """``(B,)`` mask: whether every entry of ``A[b]`` is finite.

    ``amax`` and ``amin`` propagate NaN and show ±Inf as an extreme; the two vectorised
    reductions are much cheaper than ``isfinite(A).all()`` (or ``aminmax`` along a
    dimension), which first builds a mask as large as ``A``.  Reducing over
    the trailing dimensions, not a flattened view, avoids copying eigh's column-major
    eigenvectors.  ``x·0`` is 0 exactly when ``x`` is finite (``±Inf·0`` and ``NaN·0``
    are NaN): four small operations where ``isfinite`` would dispatch eight.
    """
    dims = tuple(range(1, A.ndim))
    return A.amax(dim=dims) * 0.0 + A.amin(dim=dims) * 0.0 == 0.0


def all_finite(*tensors: Tensor) -> Tensor:
    """0-d mask: whether every entry of every (non-empty) tensor is finite.

    One ``aminmax`` per tensor (NaN propagates, ±Inf is an extreme) and ``x·0 == 0``
    on their stack: six operations for two tensors where two :func:`finite_per_matrix`
    and their ``&`` and ``all`` take fourteen, for a decision that needs no per-matrix
    answer.
    """
    ends = torch.stack([end for t in tensors for end in torch.aminmax(t)])
    return (ends * 0.0 == 0.0).all()


def _try_eigh(A: Tensor) -> tuple[Tensor, Tensor] | None:
    try:
        L, Q = _eigh(A)
    except RuntimeError:
        return None
    if not bool(all_finite(L, Q)):  # one read
        return None
    return L, Q


def batched_eigh(A: Tensor, retry_double_precision: bool = True) -> EighResult:
    """``eigh`` of a stack: one batched call; on failure float64, then matrix by matrix.

    A batched LAPACK call fails as a whole if one matrix fails to converge, so only
    then are the matrices decomposed one at a time to find the culprits.
    """
    out = _try_eigh(A)
    if out is None and retry_double_precision and A.dtype != torch.float64:
        wide = _try_eigh(A.double())
        out = None if wide is None else (wide[0].to(A.dtype), wide[1].to(A.dtype))
    failed = torch.zeros(A.shape[0], dtype=torch.bool, device=A.device)
    if out is not None:
        return EighResult(out[0], out[1], failed)
    any_failed = False
    L = torch.full(A.shape[:-1], float("nan"), dtype=A.dtype, device=A.device)
    Q = torch.full(A.shape, float("nan"), dtype=A.dtype, device=A.device)
    for i in range(A.shape[0]):
        one = _try_eigh(A[i : i + 1])
        if one is None and retry_double_precision and A.dtype != torch.float64:
            wide = _try_eigh(A[i : i + 1].double())
            one = None if wide is None else (wide[0].to(A.dtype), wide[1].to(A.dtype))
        if one is None:
            failed[i] = True
            any_failed = True
        else:
            L[i], Q[i] = one[0][0], one[1][0]
    return EighResult(L, Q, failed, any_failed)


def _add_identity(A: Tensor, epsilon: float) -> Tensor:
    if epsilon == 0.0:
        return A
    out = A.clone()
    out.diagonal(dim1=-2, dim2=-1).add_(epsilon)
    return out


def eigh_root_inverse(
    A: Tensor,
    root: float,
    epsilon: float,
    *,
    pseudo_inverse: bool = False,
    rank_rtol: float | None = None,
    retry_double_precision: bool = True,
    factored: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(A + εI)^(−1/root)`` for a stack ``A``, and the mask of matrices that failed.

    With ``pseudo_inverse`` the eigenvalues ``≤ rank_rtol · max(λ_max, 0)`` (default
    ``rank_rtol = n · machine epsilon``) get a zero inverse root and ``ε`` is not used:
    the Moore-Penrose inverse root of a rank-deficient ``A``.

    With ``factored`` the result is ``D = diag(λ^(−1/(2·root))) Qᵀ``, the root being
    ``DᵀD``: it skips the ``2n³`` product that forms the root, which pays when the
    root is applied to fewer than ``n`` vectors before the next refresh.  (``Dᵀ``
    would do as well; ``D`` is what is contiguous, LAPACK's ``Q`` being column-major.)
    """
    res = batched_eigh(_add_identity(A, epsilon), retry_double_precision)
    L, Q = res.eigenvalues, res.eigenvectors
    exponent = -1.0 / (2 * root) if factored else -1.0 / root
    if pseudo_inverse:
        rtol = A.shape[-1] * torch.finfo(A.dtype).eps if rank_rtol is None else rank_rtol
        cutoff = rtol * L.amax(dim=-1, keepdim=True).clamp(min=0.0)
        keep = torch.gt(L, cutoff)
        inv = torch.where(keep, L.pow(exponent), torch.zeros_like(L))
    else:
        lam_min = L.amin(dim=-1, keepdim=True)
        # Shift only the matrices whose smallest eigenvalue fell below epsilon.
        L = torch.where(lam_min < epsilon, (L - lam_min) + epsilon, L)
        inv = L.pow(exponent)
    X = Q * inv.unsqueeze(-2)
    X = X.mT if factored else X @ Q.mT
    failed = ~finite_per_matrix(X)
    return X, (res.failed | failed) if res.any_failed else failed


def coupled_newton_root_inverse(
    A: Tensor, root: int, epsilon: float, *, max_iterations: int = 100, tolerance: float = 1e-6
) -> tuple[Tensor, Tensor, Tensor]:
    """``(A + εI)^(−1/root)`` by the coupled inverse Newton iteration, for a stack ``A``.

    Starts from ``X = z^(1/p) I``, ``M = z (A + εI)`` with ``z = (p + 1) / (2‖A + εI‖_F)``,
    which puts the spectrum of ``M`` in ``(0, (p+1)/2]`` where the iteration converges.
    Returns the roots, the mask of non-finite results (failures) and the mask of
    matrices that reached ``tolerance``.  As in DistributedShampoo, a finite result that
    did not converge is still used: in float32 the tolerance may be out of reach.
    """
    n = A.shape[-1]
    eye = torch.eye(n, dtype=A.dtype, device=A.device).expand_as(A)
    A_ridge = _add_identity(A, epsilon)
    alpha = -1.0 / root
    z = (root + 1) / (2 * torch.linalg.matrix_norm(A_ridge))  # (B,)
    X = z.pow(-alpha)[:, None, None] * eye
    M = z[:, None, None] * A_ridge
    error = (M - eye).abs().sum(dim=-1).amax(dim=-1)
    for _ in range(max_iterations):
        if bool((error <= tolerance).all()):
            break
        M_p = M * alpha + eye * (1 - alpha)
        X = X @ M_p
        M = torch.linalg.matrix_power(M_p, root) @ M
        error = (M - eye).abs().sum(dim=-1).amax(dim=-1)
    failed = ~finite_per_matrix(X)
    return X, failed, error <= tolerance
