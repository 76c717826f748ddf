"""Classify scikit-learn's handwritten digits with an MLP and a CNN: LM against Adam.

    python examples/digits_classification.py                 # 30 s of training per run
    python examples/digits_classification.py --budget 20     # another wall-clock budget
    python examples/digits_classification.py --quick         # a few seconds, for CI
    python examples/digits_classification.py --models cnn --threads 1

The 8×8 digit images (1,797 of them, shipped with scikit-learn, no download) are split
75/25 into training and test sets, and a fifth of the training set is held out again as
a validation set.  The test set is used once, at the end: the validation set alone
picks the epoch whose parameters are kept (``restore_best=True``) and, with
``--patience``, stops training early.

Levenberg-Marquardt minimises the cross-entropy through the square-root trick
(``so.residuals.cross_entropy``: one residual ``sqrt(CE)`` per sample) on the full
training batch; Adam (lr 3e-3, batch 64) minimises the same loss.  Both are driven by
``so.fit`` from the same initial weights, and both get the same wall-clock budget of
training (``--budget`` seconds; validation is off the clock): a run stops at the first
step that ends past the budget, when the optimizer terminates, or when validation
accuracy has not improved for ``--patience`` epochs.  Two networks are trained:

* ``mlp``: 64 → hidden → 10 with tanh, on the flattened images;
* ``cnn``: a 3×3 convolution with ``channels`` maps, tanh, 2×2 max-pooling, and a
  linear layer to the 10 classes, on the 1×8×8 images.

Validation accuracy against training time goes to ``out/digits_classification.png``,
one panel per network, with each run's test accuracy in the legend.  ``--quick``
trains on 300 images for a fixed number of steps instead of a time budget (so its
result does not depend on the machine's speed): a smoke test, not a comparison.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import secondorder as so
from secondorder.training import Callback, History, StepRecord, fit

ADAM_LR, ADAM_BATCH = 3e-3, 64


def data(limit: int | None, seed: int):
    """Training, validation and test sets: 75/25 train/test, then 80/20 train/validation."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    xtr, xva, ytr, yva = train_test_split(xtr, ytr, test_size=0.2, random_state=seed, stratify=ytr)
    return (xtr, ytr), (xva, yva), (xte, yte)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


class Budget(Callback):
    """Stop at the first step that ends past ``seconds`` of training (validation excluded)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step(self, record: StepRecord, info: object) -> bool:
        return record.time >= self.seconds


def make_model(kind: str, hidden: int, channels: int) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, channels, kernel_size=3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(channels * 4 * 4, 10),
    )


def train(name: str, model: nn.Module, train_set, validation, epochs: int, args) -> History:
    """One ``so.fit`` run; the parameters of the best validation epoch are kept."""
    callbacks = [] if args.budget is None else [Budget(args.budget)]
    common = dict(
        epochs=epochs,
        validation=validation,
        metric="accuracy",
        patience=args.patience,
        restore_best=True,
        callbacks=callbacks,
        progress=not args.quick,
    )
    if name == "LM":
        opt = so.LevenbergMarquardt(model, so.residuals.cross_entropy)
        return fit(opt, train_set, **common)
    loader = DataLoader(
        TensorDataset(*train_set),
        batch_size=ADAM_BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    adam = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    return fit(adam, loader, model=model, loss_fn=nn.functional.cross_entropy, **common)


def compare(kind, args, train_set, validation, test):
    torch.manual_seed(args.seed)
    model = make_model(kind, args.hidden, args.channels)
    count = sum(p.numel() for p in model.parameters())
    runs = {}
    for name, epochs in (("LM", args.lm_epochs), ("Adam", args.adam_epochs)):
        net = copy.deepcopy(model)  # the same initial weights for both
        history = train(name, net, train_set, validation, epochs, args)
        test_accuracy = accuracy(net, *test)  # the only use of the test set
        print(
            f"{name} {kind}: {count} parameters, {len(history)} steps in {len(history.epochs)} "
            f"epochs, {history.time[-1]:.2f} s of training, best validation accuracy "
            f"{history.best_validation:.3f} (epoch {history.best_epoch}), "
            f"test accuracy {test_accuracy:.3f}"
        )
        print(f"       ({history.stop_reason})")
        runs[name] = (history, test_accuracy)
    return runs, count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small and fast, for CI")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the plot")
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
    parser.add_argument("--hidden", type=int, default=32, help="MLP hidden units")
    parser.add_argument("--channels", type=int, default=6, help="CNN feature maps")
    parser.add_argument(
        "--budget", type=float, default=30.0, help="seconds of training per run (both)"
    )
    parser.add_argument(
        "--patience", type=int, default=None, help="stop after this many epochs without a "
        "better validation accuracy (both optimizers; default: train for the whole budget)"
    )  # fmt: skip
    parser.add_argument("--lm-epochs", type=int, default=100_000, help="LM steps at most")
    parser.add_argument("--adam-epochs", type=int, default=100_000, help="Adam epochs at most")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    limit = None
    if args.quick:
        limit, args.hidden, args.channels = 300, 16, 3
        args.budget, args.lm_epochs, args.adam_epochs = None, 8, 30

    train_set, validation, test = data(limit, args.seed)
    print(
        f"{len(train_set[0])} training, {len(validation[0])} validation and {len(test[0])} "
        f"test images; {torch.get_num_threads()} torch threads; "
        + ("fixed step counts (quick)" if args.budget is None else f"budget {args.budget:g} s")
    )
    results = {kind: compare(kind, args, train_set, validation, test) for kind in args.models}

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    labels = {"LM": "LM, full batch", "Adam": f"Adam, batch {ADAM_BATCH}"}
    for ax, (kind, (runs, count)) in zip(axes[0], results.items(), strict=True):
        for name, (history, test_accuracy) in runs.items():
            times = [e.time for e in history.epochs]
            label = f"{labels[name]} (test {test_accuracy:.3f})"
            ax.plot(times, history.validation, marker=".", markersize=3, label=label)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation accuracy")
        ax.set_title(f"digits, {kind.upper()} ({count} parameters)")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    path = args.out / "digits_classification.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
