"""The side-by-side's configurations: models, batches and KAISA's hyperparameters.

:mod:`benchmarks.kfac_peer` runs them; :func:`tiny` shrinks one so that every path of
the benchmark runs in seconds (its numbers then measure nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .workloads import mnist1d, mnist1d_cnn

__all__ = ["CONFIGS", "BlockLinears", "PeerConfig", "configs", "tiny"]


class BlockLinears(nn.Module):
    """A pre-norm transformer block whose Linear layers see tokens as rows.

    ``(B, T, d)`` in and out; the four Linear layers (qkv ``d→3d``, output ``d→d``, MLP
    ``d→4d→d``) are applied to the ``(B·T, d)`` rows, so that each token is one sample
    for both K-FAC implementations (KAISA averages a Linear layer's G over extra
    dimensions where secondorder sums them per sample: with rows, both agree).
    """

    def __init__(self, d: int, heads: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.qkv(self.ln1(x).reshape(b * t, d))
        q, k, v = h.reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b * t, d)).reshape(b, t, d)
        m = self.fc2(F.gelu(self.fc1(self.ln2(x).reshape(b * t, d))))
        return x + m.reshape(b, t, d)


@dataclass(frozen=True)
class PeerConfig:
    """One side-by-side configuration: model, batches and KAISA's hyperparameters."""

    key: str
    title: str
    model: Callable[[], nn.Module]
    batches: Callable[[], list[tuple[Tensor, Tensor]]]
    loss: Callable[[Tensor, Tensor], Tensor]
    every: int
    steps: int  # per side per round (a multiple of ``every``: same work each round)
    lr: float = 0.1
    damping: float = 0.003
    kl_clip: float = 0.001
    factor_decay: float = 0.95
    compute_method: str = "eigen"


def _cnn_batches() -> list[tuple[Tensor, Tensor]]:
    (x, y), _ = mnist1d(5000)
    return [(x[i : i + 128], y[i : i + 128]) for i in range(0, x.shape[0] - 127, 128)]


def _block_model(d: int, heads: int = 8) -> Callable[[], nn.Module]:
    return lambda: BlockLinears(d, heads=heads)


def _block_batches(d: int, b: int = 8, t: int = 64, n: int = 8) -> list[tuple[Tensor, Tensor]]:
    # a fixed random teacher: the block learns to map random inputs to its outputs
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(d, d, generator=gen) / math.sqrt(d)
    out = []
    for _ in range(n):
        x = torch.randn(b, t, d, generator=gen)
        out.append((x, torch.tanh(x @ teacher)))
    return out


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


def configs(quick: bool = True) -> list[PeerConfig]:
    """The configurations; ``quick`` runs fewer steps per round of the slow ones."""
    cnn = mnist1d_cnn()
    d = 512
    out = []
    for method in ("eigen", "inverse"):
        for every, steps in ((10, 20), (1, 4 if quick else 10)):
            out.append(
                PeerConfig(
                    key=f"cnn_{method}_every{every}",
                    title=f"MNIST-1D CNN, batch 128, {method}, every {every}",
                    model=cnn,
                    batches=_cnn_batches,
                    loss=F.cross_entropy,
                    every=every,
                    steps=steps,
                    compute_method=method,
                )
            )
        for every, steps in ((10, 10), (1, 2 if quick else 5)):
            out.append(
                PeerConfig(
                    key=f"block{d}_{method}_every{every}",
                    title=f"transformer block d={d} (MLP 4x), 512 tokens, {method}, every {every}",
                    model=_block_model(d),
                    batches=functools.partial(_block_batches, d),
                    loss=_mse,
                    every=every,
                    steps=steps,
                    lr=0.05,
                    compute_method=method,
                )
            )
    return out


CONFIGS = configs()


def _signals(b: int = 16, n: int = 2) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 40, generator=gen), torch.randint(0, 10, (b,), generator=gen))] * n


def tiny(cfg: PeerConfig) -> PeerConfig:
    """``cfg`` at toy sizes and a frequency of at most 2: every path in seconds."""
    cnn = cfg.key.startswith("cnn")
    every = min(cfg.every, 2)
    return dataclasses.replace(
        cfg,
        model=mnist1d_cnn(channels=4, hidden=16) if cnn else _block_model(16, heads=2),
        batches=_signals if cnn else functools.partial(_block_batches, 16, b=2, t=8, n=2),
        every=every,
        steps=every,
    )
