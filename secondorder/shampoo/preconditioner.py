"""Kronecker-factored preconditioners on stacks of equal-shape blocks.

A block ``G`` of order ``r`` with dimensions ``d₁…d_r`` has one factor per dimension,
``F_k ← β₂F_k + (1−β₂) G₍ₖ₎G₍ₖ₎ᵀ`` (``G₍ₖ₎`` is ``G`` unfolded along ``k``: ``d_k`` rows).
All blocks of one shape are stacked into ``(B, d₁, …, d_r)`` so that each stage is one
batched call: ``baddbmm`` for the factors, one ``eigh`` per dimension for the roots,
one ``bmm`` per dimension for the preconditioning.

* :class:`RootInversePreconditioner` (Shampoo):
  ``P = M ×₁ F̂₁^(−1/2r) ×₂ … ×_r F̂_r^(−1/2r)``, ``F̂ = F / (1 − β₂ᵗ)``.
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

from .config import CoupledNewtonConfig, EigenConfig, RootInvConfig
from .root_inverse import batched_eigh, coupled_newton_root_inverse, eigh_root_inverse

__all__ = [
    "EigenvalueCorrectedPreconditioner",
    "Preconditioner",
    "RootInversePreconditioner",
    "mode_product",
]


def mode_product(X: Tensor, mats: Sequence[Tensor], transpose: bool = False) -> Tensor:
    """``X ×₁ A₁ ×₂ … ×_r A_r`` for a stack ``X`` of shape ``(B, d₁, …, d_r)``.

    Entry ``j`` along dimension ``k`` of the result is ``Σ_i A_k[j, i] X[…, i, …]``
    (``Σ_i A_k[i, j] X[…, i, …]`` with ``transpose``).  Each dimension costs one ``bmm``:
    contracting the leading dimension and appending the result last cycles the
    dimensions, so after ``r`` products they are back in order with no permute.
    """
    B = X.shape[0]
    for A in mats:
        d = A.shape[-1]
        rest = X.shape[2:]
        flat = X.reshape(B, d, -1).mT
        X = (flat @ A if transpose else flat @ A.mT).reshape(B, *rest, d)
    return X


@dataclass(frozen=True)
class Preconditioner:
    """What both preconditioners share: the Kronecker factors and their update."""

    shape: tuple[int, ...]
    beta2: float
    epsilon: float
    use_bias_correction: bool
    root_inv_config: RootInvConfig

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
            state[f"{self.amortized_key}{k}"] = eye.repeat(B, 1, 1)
        state["failed_amortized_computations"] = torch.zeros(B, dtype=torch.int64, device=device)
        return state

    amortized_key = "root"

    def update_factors(self, state: dict[str, Tensor], G: Tensor) -> None:
        """``F_k ← β₂F_k + (1−β₂)G₍ₖ₎G₍ₖ₎ᵀ`` for every dimension, as one batched product each."""
        B = G.shape[0]
        alpha = 1.0 if self.beta2 == 1.0 else 1.0 - self.beta2
        for k, d in enumerate(self.shape):
            Gk = G.movedim(k + 1, 1).reshape(B, d, -1)
            state[f"factor{k}"].baddbmm_(Gk, Gk.mT, beta=self.beta2, alpha=alpha)

    def amortize(self, state: dict[str, Tensor], step: int) -> list[tuple[int, int]]:
        """Refresh the amortized results; return the ``(block, factor)`` pairs that failed.

        A failed block keeps its previous result.  Raises if a factor is not finite.
        """
        bc2 = self.bias_correction2(step)
        failed_pairs: list[tuple[int, int]] = []
        for k in range(self.order):
            F = state[f"factor{k}"]
            if not bool(torch.isfinite(F).all()):
                bad = (~torch.isfinite(F).flatten(1).all(dim=1)).nonzero().flatten().tolist()
                raise FloatingPointError(
                    f"Kronecker factor {k} of block(s) {bad} holds NaN or Inf: the factors "
                    "overflowed. Lower lr, use factor_dtype=torch.float64, or check the loss."
                )
            A = F / bc2 if bc2 != 1.0 else F
            result, failed = self._compute(A)
            target = state[f"{self.amortized_key}{k}"]
            if bool(failed.any()):
                keep = ~failed
                target[keep] = result[keep]
                failed_pairs.extend((int(b), k) for b in failed.nonzero().flatten().tolist())
            else:
                target.copy_(result)
        return failed_pairs

    def _compute(self, A: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def after_amortize(self, state: dict[str, Tensor], G: Tensor, step: int) -> None:
        """Update state that needs the current amortized results (none for Shampoo)."""

    def precondition(self, state: dict[str, Tensor], M: Tensor, step: int) -> Tensor:
        """The preconditioned direction for the filtered gradient stack ``M``."""
        raise NotImplementedError


@dataclass(frozen=True)
class RootInversePreconditioner(Preconditioner):
    """Shampoo: each factor's inverse ``2r``-th root, applied along its dimension."""

    def _compute(self, A: Tensor) -> tuple[Tensor, Tensor]:
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
            return X, failed
        assert isinstance(cfg, EigenConfig)
        return eigh_root_inverse(
            A,
            root,
            self.epsilon,
            pseudo_inverse=cfg.pseudo_inverse,
            rank_rtol=cfg.rank_rtol,
            retry_double_precision=cfg.retry_double_precision,
        )

    def precondition(self, state: dict[str, Tensor], M: Tensor, step: int) -> Tensor:  # noqa: D102
        return mode_product(M, [state[f"root{k}"] for k in range(self.order)], transpose=True)


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

    def _compute(self, A: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.root_inv_config
        retry = cfg.retry_double_precision if isinstance(cfg, EigenConfig) else True
        res = batched_eigh(A, retry)
        return res.eigenvectors, res.failed

    def _basis(self, state: dict[str, Tensor]) -> list[Tensor]:
        return [state[f"eigenvectors{k}"] for k in range(self.order)]

    def after_amortize(self, state: dict[str, Tensor], G: Tensor, step: int) -> None:
        """``E ← β₂E + (1−β₂)(G rotated into the eigenbasis)²``."""
        rotated = mode_product(G, self._basis(state), transpose=True)
        E = state["corrected_eigenvalues"]
        if self.beta2 == 1.0:
            E.addcmul_(rotated, rotated)
        else:
            E.mul_(self.beta2).addcmul_(rotated, rotated, value=1.0 - self.beta2)

    def precondition(self, state: dict[str, Tensor], M: Tensor, step: int) -> Tensor:  # noqa: D102
        basis = self._basis(state)
        rotated = mode_product(M, basis, transpose=True)
        denom = state["corrected_eigenvalues"].sqrt()
        bc2 = self.bias_correction2(step)
        if bc2 != 1.0:
            denom = denom / bc2**0.5
        return mode_product(rotated / denom.add_(self.epsilon), basis)
