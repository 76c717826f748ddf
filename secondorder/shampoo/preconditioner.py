"""Kronecker-factored preconditioners on stacks of equal-shape blocks.

A block ``G`` of order ``r`` with dimensions ``d₁…d_r`` has one factor per dimension,
``F_k ← β₂F_k + (1−β₂) G₍ₖ₎G₍ₖ₎ᵀ`` (``G₍ₖ₎`` is ``G`` unfolded along ``k``: ``d_k`` rows).
All blocks of one shape are stacked into ``(B, d₁, …, d_r)`` so that each stage is one
batched call: ``baddbmm`` for the factors, one ``eigh`` per dimension for the roots,
one ``bmm`` per dimension for the preconditioning.

* :class:`RootInversePreconditioner` (Shampoo):
  ``P = M ×₁ F̂₁^(−1/2r) ×₂ … ×_r F̂_r^(−1/2r)``, ``F̂ = F / (1 − β₂ᵗ)``.  A root
  ``R = Q diag(λ^(−1/2r)) Qᵀ`` is kept either formed or as ``D = diag(λ^(−1/4r)) Qᵀ``
  with ``R = DᵀD`` (``factored``): forming costs ``2d³`` per refresh and applying
  ``2d²m`` per step (``m`` = block size / ``d``), applying ``Dᵀ`` then ``D`` costs
  ``4d²m``, so the factored form is cheaper when ``precondition_frequency · m < d``
  (e.g. the 1024-wide factor of a (256, 1024) block refreshed every step).
* :class:`EigenvalueCorrectedPreconditioner` (SOAP / eigenvalue-corrected Shampoo):
  rotate into the factors' eigenbases ``Q_k``, divide by ``sqrt(E) + ε`` where ``E`` is
  Adam's second moment of the *rotated* gradient, rotate back.  Choose it when Adam
  is the baseline to beat: with ``Q_k = I`` it is Adam, and the basis only needs
  refreshing every ``precondition_frequency`` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._lapack import pad_identity
from .config import CoupledNewtonConfig, EigenConfig, RootInvConfig
from .root_inverse import (
    all_finite,
    batched_eigh,
    coupled_newton_root_inverse,
    eigh_root_inverse,
    finite_per_matrix,
)

__all__ = [
    "EigenvalueCorrectedPreconditioner",
    "Preconditioner",
    "RootInversePreconditioner",
    "mode_product",
    "multiply_unfoldings",
]


def multiply_unfoldings(X: Tensor, ops: Sequence[Sequence[Tensor]]) -> Tensor:
    """``X₍ₖ₎ᵀ ← X₍ₖ₎ᵀ A_k1 A_k2 …`` along every dimension ``k`` of a stack ``(B, d₁, …, d_r)``.

    ``ops[k]`` lists the ``(d_k, d_k)`` stacks to multiply, in order, from the right of
    the unfolding ``X₍ₖ₎ᵀ`` (rows: the other dimensions; columns: dimension ``k``).
    Contracting the leading dimension and appending the result last cycles the
    dimensions, so after ``r`` of them they are back in order with no permute, and
    every product is one ``bmm`` on a (transposed) view, with no copy.
    """
    B = X.shape[0]
    for mats in ops:
        d = X.shape[1]
        rest = X.shape[2:]
        flat = X.reshape(B, d, -1).mT
        # One bmm per product where the stacks match (matmul would dispatch its
        # broadcasting around it); a single row goes through matmul, which multiplies
        # it as a vector (other rounding).
        direct = flat.shape[1] > 1
        for A in mats:
            stacked = A.ndim == 3 and A.shape[0] == B
            flat = torch.bmm(flat, A) if direct and stacked else flat @ A
        X = flat.reshape(B, *rest, d)
    return X


def mode_product(X: Tensor, mats: Sequence[Tensor], transpose: bool = False) -> Tensor:
    """``X ×₁ A₁ ×₂ … ×_r A_r`` for a stack ``X`` of shape ``(B, d₁, …, d_r)``.

    Entry ``j`` along dimension ``k`` of the result is ``Σ_i A_k[j, i] X[…, i, …]``
    (``Σ_i A_k[i, j] X[…, i, …]`` with ``transpose``).  Each dimension costs one ``bmm``:
    contracting the leading dimension and appending the result last cycles the
    dimensions, so after ``r`` products they are back in order with no permute.
    """
    return multiply_unfoldings(X, [[A if transpose else A.mT] for A in mats])


@dataclass(frozen=True)
class Preconditioner:
    """What both preconditioners share: the Kronecker factors and their update."""

    shape: tuple[int, ...]
    beta2: float
    epsilon: float
    use_bias_correction: bool
    root_inv_config: RootInvConfig
    # Per factor: keep the root as D with root = DᵀD (RootInversePreconditioner only).
    factored: tuple[bool, ...] = ()

    @property
    def order(self) -> int:
        """Number of block dimensions (and of Kronecker factors)."""
        return len(self.shape)

    def bias_correction2(self, step: int) -> float:
        """``1 − β₂ᵗ`` when bias correction applies, else 1."""
        if self.use_bias_correction and self.beta2 < 1.0:
            return 1.0 - self.beta2**step
        return 1.0

    def init_state(self, B: int, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
        """Zero factors, identity amortized results, zero failure counters."""
        state: dict[str, Tensor] = {}
        for k, d in enumerate(self.shape):
            state[f"factor{k}"] = torch.zeros(B, d, d, dtype=dtype, device=device)
        for k, d in enumerate(self.shape):
            eye = torch.eye(d, dtype=dtype, device=device)
            state[self.amortized_name(k)] = eye.repeat(B, 1, 1)
        state["failed_amortized_computations"] = torch.zeros(B, dtype=torch.int64, device=device)
        return state

    amortized_key = "root"

    def is_factored(self, k: int) -> bool:
        """Whether factor ``k``'s amortized result is kept as ``D`` with root ``DᵀD``."""
        return bool(self.factored) and self.factored[k]

    def amortized_name(self, k: int) -> str:
        """State key of factor ``k``'s amortized result."""
        return f"root_factor{k}" if self.is_factored(k) else f"{self.amortized_key}{k}"

    def update_factors(self, state: dict[str, Tensor], G: Tensor) -> None:
        """``F_k ← β₂F_k + (1−β₂)G₍ₖ₎G₍ₖ₎ᵀ`` for every dimension, as one batched product each.

        Like every update here, it puts new tensors into ``state`` and changes none in
        place (a step is a transaction, see :mod:`.update`).
        """
        B = G.shape[0]
        alpha = 1.0 if self.beta2 == 1.0 else 1.0 - self.beta2
        for k, d in enumerate(self.shape):
            Gk = G.movedim(k + 1, 1).reshape(B, d, -1)
            F = state[f"factor{k}"]
            state[f"factor{k}"] = torch.baddbmm(F, Gk, Gk.mT, beta=self.beta2, alpha=alpha)

    def amortize(self, state: dict[str, Tensor], step: int) -> list[tuple[int, int]]:
        """Refresh the amortized results; return the ``(block, factor)`` pairs that failed.

        A failed block keeps its previous result.  Raises if a factor is not finite.
        """
        bc2 = self.bias_correction2(step)
        failed_pairs: list[tuple[int, int]] = []
        for k in range(self.order):
            F = state[f"factor{k}"]
            if not bool(all_finite(F)):
                bad = (~finite_per_matrix(F)).nonzero().flatten().tolist()
                raise FloatingPointError(
                    f"Kronecker factor {k} of block(s) {bad} holds NaN or Inf: the factors "
                    "overflowed. Lower lr, use factor_dtype=torch.float64, or check the loss."
                )
            A = F / bc2 if bc2 != 1.0 else F
            result, failed = self._compute(A, k)
            name = self.amortized_name(k)
            if failed is not None and bool(failed.any()):
                result = torch.where(failed.view(-1, 1, 1), state[name], result)
                failed_pairs.extend((int(b), k) for b in failed.nonzero().flatten().tolist())
            state[name] = result
        return failed_pairs

    def _compute(self, A: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        """The amortized result of the stack ``A`` and the mask of its failed matrices.

        ``None`` for the mask: none failed, known on the host without a device read.
        """
        raise NotImplementedError

    def method(self, dtype: torch.dtype) -> str:
        """How a root computation in ``dtype`` that failed was tried, for the warning."""
        cfg = self.root_inv_config
        if isinstance(cfg, CoupledNewtonConfig):
            return f"the coupled Newton iteration in {dtype}"
        if isinstance(cfg, EigenConfig) and not cfg.retry_double_precision:
            return f"eigh in {dtype}, retry_double_precision=False"
        return "eigh, even in float64"

    def after_amortize(self, state: dict[str, Tensor], G: Tensor, step: int) -> Tensor | None:
        """Update state that needs the current amortized results (none for Shampoo).

        Returns ``G`` rotated into the eigenbasis where the preconditioner forms it
        (SOAP), so that the caller can reuse it; else ``None``.
        """
        return None

    def rotate(self, state: dict[str, Tensor], X: Tensor) -> Tensor:
        """``X`` in the eigenbasis of the factors (SOAP only)."""
        raise NotImplementedError

    def precondition(
        self, state: dict[str, Tensor], M: Tensor, step: int, rotated: Tensor | None = None
    ) -> Tensor:
        """The preconditioned direction for the filtered gradient stack ``M``.

        ``rotated``: ``M`` already in the eigenbasis, if the caller has it (SOAP).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class RootInversePreconditioner(Preconditioner):
    """Shampoo: each factor's inverse ``2r``-th root, applied along its dimension."""

    def _compute(self, A: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        root = 2 * self.order
        cfg = self.root_inv_config
        if isinstance(cfg, CoupledNewtonConfig):
            X, failed, _ = coupled_newton_root_inverse(
                A,
                root,
                self.epsilon,
                max_iterations=cfg.max_iterations,
                tolerance=cfg.tolerance,
            )
            if self.is_factored(k):
                # The layout was chosen for eigh (config switched after the state was
                # built): with the Cholesky factor R = LLᵀ, D = Lᵀ has R = DᵀD.
                n = X.shape[-1]
                L, info = torch.linalg.cholesky_ex(pad_identity(X))
                X, failed = L[..., :n, :n].mT, failed | (info != 0)
            return X, failed
        assert isinstance(cfg, EigenConfig)
        return eigh_root_inverse(
            A,
            root,
            self.epsilon,
            pseudo_inverse=cfg.pseudo_inverse,
            rank_rtol=cfg.rank_rtol,
            retry_double_precision=cfg.retry_double_precision,
            factored=self.is_factored(k),
        )

    def precondition(  # noqa: D102
        self, state: dict[str, Tensor], M: Tensor, step: int, rotated: Tensor | None = None
    ) -> Tensor:
        ops: list[list[Tensor]] = []
        for k in range(self.order):
            if self.is_factored(k):
                # X₍ₖ₎ᵀ R = (X₍ₖ₎ᵀ Dᵀ) D.
                D = state[f"root_factor{k}"]
                ops.append([D.mT, D])
            else:
                # The root is symmetric: multiplying by it or its transpose is the same.
                ops.append([state[f"root{k}"]])
        return multiply_unfoldings(M, ops)


@dataclass(frozen=True)
class EigenvalueCorrectedPreconditioner(Preconditioner):
    """SOAP: Adam's second moment kept in the eigenbasis of the Kronecker factors."""

    amortized_key = "eigenvectors"

    def init_state(  # noqa: D102
        self, B: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, Tensor]:
        state = super().init_state(B, dtype, device)
        state["corrected_eigenvalues"] = torch.zeros(B, *self.shape, dtype=dtype, device=device)
        return state

    def _compute(self, A: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        cfg = self.root_inv_config
        retry = cfg.retry_double_precision if isinstance(cfg, EigenConfig) else True
        res = batched_eigh(A, retry)
        return res.eigenvectors, res.failed if res.any_failed else None

    def method(self, dtype: torch.dtype) -> str:  # noqa: D102
        cfg = self.root_inv_config
        if isinstance(cfg, EigenConfig) and not cfg.retry_double_precision:
            return f"eigh in {dtype}, retry_double_precision=False"
        return "eigh, even in float64"  # the basis always comes from eigh

    def _basis(self, state: dict[str, Tensor]) -> list[Tensor]:
        return [state[f"eigenvectors{k}"] for k in range(self.order)]

    def rotate(self, state: dict[str, Tensor], X: Tensor) -> Tensor:  # noqa: D102
        return mode_product(X, self._basis(state), transpose=True)

    def after_amortize(self, state: dict[str, Tensor], G: Tensor, step: int) -> Tensor:
        """``E ← β₂E + (1−β₂)(G rotated into the eigenbasis)²``; returns the rotated ``G``."""
        rotated = self.rotate(state, G)
        E = state["corrected_eigenvalues"]
        if self.beta2 == 1.0:
            state["corrected_eigenvalues"] = torch.addcmul(E, rotated, rotated)
        else:
            new = E.mul(self.beta2).addcmul_(rotated, rotated, value=1.0 - self.beta2)
            state["corrected_eigenvalues"] = new
        return rotated

    def precondition(
        self, state: dict[str, Tensor], M: Tensor, step: int, rotated: Tensor | None = None
    ) -> Tensor:
        """Rotate ``M``, divide by ``sqrt(E) + ε`` where ``E`` is not rounding noise, rotate back.

        In the null space of the factors the rotated gradient is rounding noise, and
        so is ``E`` there; their ratio is noise over noise, which a float32 step can
        turn into a move thousands of times the float64 one.  A rotation by ``n × n``
        orthogonal factors leaves errors up to about ``n · machine epsilon`` of the
        block's norm, and ``ΣE`` (over the block) is the weighted sum of the squared
        norms, so a coordinate with ``E ≤ rtol² · ΣE`` is noise and gets a zero
        direction, as the pseudo-inverse does for eigenvalues: ``rtol`` is
        ``EigenConfig.rank_rtol``, by default the largest block dimension times the
        dtype's machine epsilon.  Coordinates above it, however small, are signal and
        are divided as in Adam (and in DistributedShampoo, which has no cutoff).
        """
        basis = self._basis(state)
        if rotated is None:
            rotated = mode_product(M, basis, transpose=True)
        E = state["corrected_eigenvalues"]
        denom = E.sqrt()
        bc2 = self.bias_correction2(step)
        if bc2 != 1.0:
            denom.div_(bc2**0.5)
        dims = tuple(range(1, E.ndim))
        cutoff = self.null_rtol(E.dtype) ** 2 * E.sum(dim=dims, keepdim=True)
        direction = torch.where(cutoff < E, rotated / denom.add_(self.epsilon), 0.0)
        return mode_product(direction, basis)

    def null_rtol(self, dtype: torch.dtype) -> float:
        """``E ≤ null_rtol² · ΣE`` is the factors' null space (see :meth:`precondition`)."""
        cfg = self.root_inv_config
        if isinstance(cfg, EigenConfig) and cfg.rank_rtol is not None:
            return cfg.rank_rtol
        return max(self.shape) * torch.finfo(dtype).eps
