"""Defaults that depend on the residual adapter: classifiers get the multiplicative rule and D = I.

Why.  With square-root residuals ``rᵢ = sqrt(CEᵢ)`` the Gauss-Newton model asks every
sample's cross-entropy to reach zero along a straight line, while the true loss decays
like ``exp(-margin)``: the model over-predicts the reduction of a long step, so an
accepted step typically has a gain ratio ρ between 0.2 and 0.7.  Nielsen's rule
multiplies λ by ``max(1/3, 1 - (2ρ - 1)³)``, which is about 1 for ρ near 0.5, so λ
stays where ρ ≈ 0.5 (λ ≈ 30 with Marquardt's scaling on a digits CNN) and every step is
short; its doubling ν also drives λ from 1e-3 to ~1e5 in the first step's rejected
attempts, and λ then falls at most 3x per step.  The multiplicative rule divides λ by
10 after every accepted step whatever ρ was, so λ falls until a step is rejected and
LM takes near Gauss-Newton steps that the model would call too optimistic but that
still reduce the loss a lot: the digits CNN of ``benchmarks/lm_classifier.py``
reaches a train cross-entropy near zero in 45 steps where Nielsen's rule leaves 0.35
after 60 (``benchmarks/notes/CLASSIFIER.md``).

Classifiers also get ``D = I`` in place of Marquardt's ``diag(JᵀJ)``.  On mini-batches
Marquardt's scaling damps each weight by its column's norm in *this* batch, and the
weights a batch barely touches (inputs that are zero there, saturated units) get
almost no damping and long steps that the next batches pay for: on the bench's digits
problems (60 steps, 4 initialisations, ``benchmarks/notes/NOTES.md``) test accuracy was
0.40-0.68 (MLP), 0.75-0.93 (CNN) and 0.84-0.90 (wide MLP) with Marquardt's scaling
and 0.96-0.98 on all three with ``D = I``, at a tenth of the training loss.  With
``D = I`` the dual matrix of a model of ``nn.Linear`` layers also comes from the
layers' factors (:class:`~secondorder.lm.jacobian.FactorGram`), far cheaper than
``J D⁻¹Jᵀ``.

On least-squares problems whose residuals are plain differences (``mse``) the
Gauss-Newton model is accurate near a fit, ρ is close to 1, and Nielsen's rule keeps
its default, with Marquardt's scale invariance: :func:`residual_defaults` returns
nothing for them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from .residuals import (
    LossResidual,
    binary_cross_entropy,
    binary_cross_entropy_probs,
    cross_entropy,
)

__all__ = ["CLASSIFIER_DEFAULTS", "is_classifier_residual", "residual_defaults"]

#: The settings a square-root cross-entropy adapter gets unless the caller gives them.
CLASSIFIER_DEFAULTS: Mapping[str, Any] = {
    "damping_rule": "multiplicative",
    "damping_matrix": "identity",
}

_CLASSIFIER_ADAPTERS = (cross_entropy, binary_cross_entropy, binary_cross_entropy_probs)


def is_classifier_residual(residual_fn: object) -> bool:
    """Whether ``residual_fn`` is a square-root cross-entropy adapter.

    :func:`~secondorder.lm.residuals.cross_entropy` and
    :func:`~secondorder.lm.residuals.binary_cross_entropy` (and its form on
    probabilities), also inside a :func:`functools.partial` (an ``eps`` bound, say) or
    mapped from a torch loss (``torch.nn.CrossEntropyLoss()``, ``BCEWithLogitsLoss``,
    ``BCELoss``).
    """
    fn = residual_fn
    while isinstance(fn, (functools.partial, LossResidual)):
        fn = fn.func if isinstance(fn, functools.partial) else fn.adapter
    return any(fn is adapter for adapter in _CLASSIFIER_ADAPTERS)


def residual_defaults(residual_fn: object) -> dict[str, Any]:
    """The :class:`~secondorder.lm.config.LMConfig` fields ``residual_fn`` changes.

    :data:`CLASSIFIER_DEFAULTS` for a cross-entropy adapter
    (:func:`is_classifier_residual`), ``{}`` for every other residual function.
    """
    if is_classifier_residual(residual_fn):
        return dict(CLASSIFIER_DEFAULTS)
    return {}
