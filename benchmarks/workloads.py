"""Data sets and model factories that any family's problems can share.

Every factory seeds torch itself, so two calls build the same initial weights: every
method of a problem starts from the same point.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["cnn", "digits", "mlp", "sinc_data"]


def sinc_data(points: int) -> tuple[Tensor, Tensor]:
    """``sinc(10x)`` on ``points`` evenly spaced x in [-1, 1], as column vectors."""
    x = torch.linspace(-1.0, 1.0, points).unsqueeze(1)
    return x, torch.sinc(10.0 * x)


def mlp(sizes: Sequence[int], seed: int = 0) -> Callable[[], nn.Module]:
    """Linear layers of ``sizes`` with Tanh between them (none after the last)."""

    def make() -> nn.Module:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.Tanh())
        return nn.Sequential(*layers)

    return make


def cnn(channels: int, seed: int = 0) -> Callable[[], nn.Module]:
    """conv3x3(channels)-Tanh-MaxPool-Linear(·, 10) on flat 8x8 images (digits)."""

    def make() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, channels, 3, padding=1),
            nn.Tanh(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(channels * 16, 10),
        )

    return make


@functools.lru_cache(maxsize=2)
def digits(limit: int | None = None) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """scikit-learn's digits (shipped with the package): 8x8 images scaled to [0, 1].

    A fixed shuffle, then 80 % train and 20 % test; ``limit`` keeps the first
    ``limit`` training and ``limit // 2`` test samples.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(0.8 * x.shape[0])
    train, test = (x[:split], y[:split]), (x[split:], y[split:])
    if limit is not None:
        train = (train[0][:limit], train[1][:limit])
        test = (test[0][: limit // 2], test[1][: limit // 2])
    return train, test
