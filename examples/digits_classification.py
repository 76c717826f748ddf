"""Classify scikit-learn's handwritten digits with an MLP: LM against Adam.

    python examples/digits_classification.py            # full data set, about a minute
    python examples/digits_classification.py --quick    # a few seconds, for CI

The 8×8 digit images (1,797 of them, shipped with scikit-learn, no download) are split
75/25 into training and test sets.  Levenberg-Marquardt minimises the cross-entropy
through the square-root trick (``so.residuals.cross_entropy``: one residual
``sqrt(CE)`` per sample) on the full training batch; Adam minimises the same loss.
Test accuracy is measured after every epoch and plotted against training time in
``out/digits_classification.png``.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import secondorder as so
from secondorder.fit import fit


def data(limit: int | None, seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return xtr, xte, ytr, yte


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train_adam(model, xtr, ytr, xte, yte, epochs, budget):
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xtr, ytr), batch_size=64, shuffle=True
    )
    curve, spent = [], 0.0
    for _ in range(epochs):
        t0 = time.perf_counter()
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        spent += time.perf_counter() - t0
        curve.append((spent, accuracy(model, xte, yte)))
        if spent > budget:
            break
    return curve


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small and fast, for CI")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the plot")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=40, help="LM steps (full batch)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    limit = None
    if args.quick:
        limit, args.hidden, args.epochs = 400, 16, 10

    xtr, xte, ytr, yte = data(limit, args.seed)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10))
    adam_model = copy.deepcopy(model)
    count = sum(p.numel() for p in model.parameters())
    print(f"{len(xtr)} training and {len(xte)} test images; {count} parameters")

    opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy)
    history = fit(
        opt,
        (xtr, ytr),
        epochs=args.epochs,
        validation=(xte, yte),
        metric="accuracy",
        patience=10,
        progress=not args.quick,
    )
    lm_time = history.time[-1]
    print(
        f"LM:   {len(history)} steps in {lm_time:.2f} s, train CE {history.loss[-1]:.3f}, "
        f"test accuracy {history.validation[-1]:.3f} (best {history.best_validation:.3f})"
    )
    print(f"      ({history.stop_reason})")

    curve = train_adam(adam_model, xtr, ytr, xte, yte, epochs=1000, budget=max(lm_time, 0.5))
    print(f"Adam: {len(curve)} epochs in {curve[-1][0]:.2f} s, test accuracy {curve[-1][1]:.3f}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(
        [e.time for e in history.epochs], history.validation, marker=".", label="LM, full batch"
    )
    ax.plot([t for t, _ in curve], [a for _, a in curve], marker=".", label="Adam, batch 64")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"digits, MLP 64-{args.hidden}-10")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = args.out / "digits_classification.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
