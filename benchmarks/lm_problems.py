"""The LM suite's problems: curve fitting (sinc) and digits classification.

Each is built by :func:`lm_problem`, which sets the loss (MSE or cross-entropy through
square-root residuals) and the settings LM's methods read (``slice_size``,
``adam_lr``, ``lm_fast``, ...).  Any family's methods can run on them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from secondorder.lm.residuals import cross_entropy, mse

from .core import Problem
from .workloads import cnn, digits, mlp, sinc_data

__all__ = ["PROBLEMS", "build_problems", "lm_problem", "make_problem"]

PROBLEMS = ("sinc", "sinc_large", "digits_mlp", "digits_cnn", "wide_dual", "wide_cg")


def _mean_squared_residual(
    residual: Callable[[Tensor, Tensor], Tensor], outputs: Tensor, targets: Tensor
) -> Tensor:
    r = residual(outputs, targets).double()
    return (r * r).mean()


def lm_problem(
    *,
    key: str,
    title: str,
    kind: str,
    train: tuple[Tensor, Tensor],
    test: tuple[Tensor, Tensor] | None,
    make_model: Callable[[], nn.Module],
    batch_size: int | None,
    target: float,
    max_steps: int,
    adam_steps: int,
    budget_s: float,
    adam_lr: float,
    adam_note: str,
    lm_fast: dict[str, Any],
    slice_size: int | None = None,
    lm_extra: dict[str, dict[str, Any]] | None = None,
    scipy: bool = False,
    eval_every: int = 1,
) -> Problem:
    """A problem of the LM suite: MSE or cross-entropy through square-root residuals.

    ``slice_size``: samples per Jacobian slice of the LM methods; ``max_steps``: steps
    per LM method, Adam gets ``adam_steps`` at ``adam_lr`` (chosen as ``adam_note``
    says); ``lm_fast``: options of "secondorder LM (fastest)", ``lm_extra`` further
    variants ``{label: options}``; ``scipy``: whether scipy runs (curve fitting only).
    The curve's loss is the mean squared residual in float64.
    """
    cls = kind == "classification"
    residual = cross_entropy if cls else mse
    return Problem(
        key=key,
        title=title,
        kind=kind,
        train=train,
        test=test,
        make_model=make_model,
        loss=nn.functional.cross_entropy if cls else nn.functional.mse_loss,
        curve_loss=functools.partial(_mean_squared_residual, residual),
        batch_size=batch_size,
        target=target,
        max_steps=max_steps,
        budget_s=budget_s,
        eval_every=eval_every,
        note=f"Adam's lr {adam_lr:g} ({adam_note}).",
        settings={
            "residual": residual,
            "slice_size": slice_size,
            "adam_lr": adam_lr,
            "adam_note": adam_note,
            "adam_steps": adam_steps,
            "lm_fast": lm_fast,
            "lm_extra": lm_extra or {},
            "scipy": scipy,
        },
    )


_ADAM_SWEEP = "fixed per problem, not swept in this run"
_F32 = {"gram_dtype": torch.float32}


def build_problems(
    quick: bool = False, tiny: bool = False, keys: Sequence[str] = PROBLEMS
) -> dict[str, Problem]:
    """The problems named in ``keys``, built (and their data loaded) on demand.

    ``quick`` shrinks the budgets to a few minutes in all on 2 cores; ``tiny`` shrinks
    everything to seconds (for tests).
    """
    unknown = [k for k in keys if k not in PROBLEMS]
    if unknown:
        raise ValueError(f"Unknown problems {unknown}; valid choices are {PROBLEMS}.")
    mode = "tiny" if tiny else "quick" if quick else "full"
    return {k: make_problem(k, mode) for k in keys}


def make_problem(key: str, mode: str) -> Problem:
    """Problem ``key`` in ``mode`` (``"full"``, ``"quick"`` or ``"tiny"``)."""
    if mode == "tiny":
        return _TINY[key]()
    return _full_problems(mode == "quick")[key]()


def _tiny(key: str, title: str, kind: str, data: Any, model: Any, **kw: Any) -> Problem:
    train, test = data if kind == "classification" else (data, None)
    return lm_problem(
        key=key, title=title, kind=kind, train=train, test=test, make_model=model,
        target=kw.pop("target", 1e-6 if kind == "regression" else 0.5), max_steps=4,
        adam_steps=8, budget_s=20.0, adam_lr=1e-2, adam_note="fixed",
        lm_fast=kw.pop("lm_fast", _F32), **kw,
    )  # fmt: skip


_TINY: dict[str, Callable[[], Problem]] = {
    "sinc": lambda: _tiny(
        "sinc", "sinc(10x), 200 points, tiny", "regression", sinc_data(200), mlp([1, 6, 1]),
        batch_size=None, scipy=True,
    ),
    "sinc_large": lambda: _tiny(
        "sinc_large", "sinc(10x), 300 points, sliced, tiny", "regression", sinc_data(300),
        mlp([1, 8, 1]), batch_size=None, slice_size=100,
    ),
    "digits_mlp": lambda: _tiny(
        "digits_mlp", "digits MLP, tiny", "classification", digits(96), mlp([64, 8, 10]),
        batch_size=32,
    ),
    "digits_cnn": lambda: _tiny(
        "digits_cnn", "digits CNN, tiny", "classification", digits(96), cnn(2), batch_size=32,
    ),
    "wide_dual": lambda: _tiny(
        "wide_dual", "wide MLP, dual form, tiny", "classification", digits(96),
        mlp([64, 16, 10]), batch_size=16, lm_fast={"form": "dual", **_F32},
    ),
    "wide_cg": lambda: _tiny(
        "wide_cg", "wide sinc, CG, tiny", "regression", sinc_data(120), mlp([1, 32, 1]),
        batch_size=None, lm_fast={"solver": "cg", "cg_max_iter": 20},
    ),
}  # fmt: skip


def _full_problems(quick: bool) -> dict[str, Callable[[], Problem]]:
    f32 = _F32
    q = quick
    return {
        "sinc": lambda: lm_problem(
            key="sinc",
            title="sinc(10x), 20,000 points, Linear(1,64)-Tanh-Linear(64,1), float32, full batch",
            kind="regression",
            train=sinc_data(20_000),
            test=None,
            make_model=mlp([1, 64, 1]),
            batch_size=None,
            slice_size=None,
            target=1e-6,
            max_steps=300 if q else 800,
            adam_steps=1_000 if q else 4_000,
            budget_s=40.0 if q else 120.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            scipy=True,
            eval_every=1,
        ),
        "sinc_large": lambda: lm_problem(
            key="sinc_large",
            title="cuPyLMA's example: sinc(10x), 100,000 points, Linear(1,256)-Tanh-"
            "Linear(256,1), Jacobian slices of 25,000",
            kind="regression",
            train=sinc_data(100_000),
            test=None,
            make_model=mlp([1, 256, 1]),
            batch_size=None,
            slice_size=25_000,
            target=1e-6,
            max_steps=15 if q else 100,
            adam_steps=150 if q else 1_000,
            budget_s=25.0 if q else 180.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            scipy=not q,
            eval_every=1,
        ),
        "digits_mlp": lambda: lm_problem(
            key="digits_mlp",
            title="digits (sklearn), MLP 64-32-10, cross-entropy (square-root residuals), "
            "batches of 256",
            kind="classification",
            train=digits()[0],
            test=digits()[1],
            make_model=mlp([64, 32, 10]),
            batch_size=256,
            slice_size=None,
            target=0.95,
            max_steps=60 if q else 300,
            adam_steps=300 if q else 1_500,
            budget_s=15.0 if q else 60.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            eval_every=6,
        ),
        "digits_cnn": lambda: lm_problem(
            key="digits_cnn",
            title="digits (sklearn), CNN conv3x3(8)-Tanh-MaxPool-Linear(128,10), "
            "cross-entropy (square-root residuals), batches of 256",
            kind="classification",
            train=digits()[0],
            test=digits()[1],
            make_model=cnn(8),
            batch_size=256,
            slice_size=None,
            target=0.95,
            max_steps=60 if q else 300,
            adam_steps=300 if q else 1_500,
            budget_s=15.0 if q else 60.0,
            adam_lr=1e-2,
            adam_note=_ADAM_SWEEP,
            lm_fast=f32,
            eval_every=6,
        ),
        "wide_dual": lambda: lm_problem(
            key="wide_dual",
            title="digits, wide MLP 64-256-10 (19,210 parameters), batches of 128 residuals: "
            "dual form",
            kind="classification",
            train=digits()[0],
            test=digits()[1],
            make_model=mlp([64, 256, 10]),
            batch_size=128,
            slice_size=None,
            target=0.95,
            max_steps=40 if q else 200,
            adam_steps=200 if q else 1_000,
            budget_s=15.0 if q else 60.0,
            adam_lr=3e-3,
            adam_note=_ADAM_SWEEP,
            lm_fast={"form": "dual", **f32},
            eval_every=4,
        ),
        "wide_cg": lambda: lm_problem(
            key="wide_cg",
            title=(
                "sinc(10x), 4,000 points, Linear(1,1024)-Tanh-Linear(1024,1) (3,073 parameters)"
                if q
                else "sinc(10x), 12,000 points, Linear(1,3072)-Tanh-Linear(3072,1) "
                "(9,217 parameters)"
            )
            + ", full batch: Gram against CG",
            kind="regression",
            train=sinc_data(4_000 if q else 12_000),
            test=None,
            make_model=mlp([1, 1024 if q else 3072, 1]),
            batch_size=None,
            slice_size=None,
            target=1e-5,
            max_steps=6 if q else 30,
            adam_steps=200 if q else 1_000,
            budget_s=25.0 if q else 120.0,
            adam_lr=1e-3,
            adam_note=_ADAM_SWEEP,
            lm_fast={"solver": "cg", "cg_max_iter": 100},
            lm_extra={} if q else {"secondorder LM (cholesky, float32 Gram)": f32},
            eval_every=1,
        ),
    }
