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

__all__ = ["autoencoder", "cnn", "digits", "mlp", "mnist1d", "mnist1d_cnn", "sinc_data"]


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


@functools.lru_cache(maxsize=2)
def mnist1d(samples: int = 5000) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """MNIST-1D generated offline by the ``mnist1d`` package: 40-point signals, 10 classes.

    ``make_dataset`` with the package's default arguments (seed 42) and ``samples``
    signals, split 80 % train / 20 % test by the package: 5,000 gives the standard
    4,000 / 1,000.  Inputs are ``(samples, 40)`` float32, labels int64.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = samples
    d = make_dataset(args)
    train = (torch.tensor(d["x"], dtype=torch.float32), torch.tensor(d["y"], dtype=torch.int64))
    test = (
        torch.tensor(d["x_test"], dtype=torch.float32),
        torch.tensor(d["y_test"], dtype=torch.int64),
    )
    return train, test


def mnist1d_cnn(seed: int = 0, channels: int = 32, hidden: int = 256) -> Callable[[], nn.Module]:
    """The issue's MNIST-1D CNN on flat 40-point signals.

    Conv1d(1,c,5,pad 2)-ReLU-Conv1d(c,c,3,pad 1)-ReLU-Linear(40c, hidden)-ReLU-
    Linear(hidden, 10); with the defaults Linear(1280, 256), the network KAISA was timed on.
    """

    def make() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Unflatten(1, (1, 40)),
            nn.Conv1d(1, channels, 5, padding=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(40 * channels, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    return make


def autoencoder(sizes: Sequence[int], seed: int = 0) -> Callable[[], nn.Module]:
    """A deep autoencoder in the style of Martens & Grosse's (Hinton & Salakhutdinov's).

    Linear layers of ``sizes`` (encoder down to the code, decoder back up) with Sigmoid
    between them, a linear code layer (no activation after the middle layer) and a
    Sigmoid output, so reconstructions of inputs in [0, 1] stay in [0, 1].
    """
    middle = len(sizes) // 2

    def make() -> nn.Module:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(a, b))
            if i + 1 != middle:
                layers.append(nn.Sigmoid())
        return nn.Sequential(*layers)

    return make
