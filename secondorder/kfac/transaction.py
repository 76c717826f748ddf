"""What one K-FAC step reads before it starts, and what it puts back if writing fails.

:class:`StepPlan` holds every scheduled value and the gradients a step uses, read and
checked before anything changes; its :meth:`~StepPlan.settings` are what the ranks
compare.  :class:`Snapshot` holds references to what the step's commit replaces (the
commit assigns new tensors, so references suffice) and copies of the ``.grad``
tensors it overwrites.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed import Reducer
from .exchange import Received
from .layers import KFACLayer
from .packing import pack_upper
from .parts import KFACParts

__all__ = [
    "STATS_ATTRS",
    "Snapshot",
    "StepPlan",
    "blank_settings",
    "kl_clip_scale",
    "stats_to_sum",
    "warn_about_statistics",
]

#: The scheduled values the ranks must agree on at every step.
SETTING_NAMES = (
    "step",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
    "factor_update_steps",
    "inv_update_steps",
    "next factor_update_steps",
)
#: A layer's statistics since the last factor update (reset by the commit).
STATS_ATTRS = (
    "a_sum",
    "g_sum",
    "a_rows",
    "g_samples",
    "forward_calls",
    "backward_calls",
    "counted",
    "dropped",
)


@dataclass
class StepPlan:
    """The values of one step, read (and checked) before anything changes."""

    step: int
    f_steps: int
    i_steps: int
    next_f_steps: int
    damping: float
    decay: float
    kl_clip: float | None
    lr: float
    invert: bool
    #: the layers with a gradient (agreed by the ranks before it is gathered).
    present: list[str]
    layers: list[str]
    #: their ``(groups, o, i)`` gradients, set once the ranks agreed on ``present``.
    grads: dict[str, Tensor] = field(default_factory=dict)
    #: the statistics to all-reduce (and their counts), when the factors are due.
    stats: list[Tensor] | None = None
    #: layers whose statistics an interrupted backward left out.
    dropped: list[str] = field(default_factory=list)
    #: the buffers this rank receives decompositions and gradients into.
    received: Received = field(default_factory=Received)

    def settings(self) -> dict[str, float]:
        """The values every rank must share, as floats (``kl_clip=None`` as -1)."""
        values = (
            self.step,
            self.damping,
            self.decay,
            -1.0 if self.kl_clip is None else self.kl_clip,
            self.lr,
            self.f_steps,
            self.i_steps,
            self.next_f_steps,
        )
        out = {name: float(v) for name, v in zip(SETTING_NAMES, values, strict=True)}
        # ranks must precondition the same layers, or their broadcasts would not pair up
        out.update(_gradient_masks(self.layers, self.present))
        return out


#: Layers per bit mask: a float64 holds the integers below 2**53 exactly.
MASK_BITS = 52


def _gradient_masks(layers: list[str], grads: Collection[str]) -> dict[str, float]:
    out = {}
    for start in range(0, len(layers), MASK_BITS):
        chunk = layers[start : start + MASK_BITS]
        bits = sum(1 << i for i, name in enumerate(chunk) if name in grads)
        out[f"layers with a gradient ({chunk[0]!r}..{chunk[-1]!r}, bit i = i-th)"] = float(bits)
    return out


def blank_settings(layers: Mapping[str, Any]) -> dict[str, float]:
    """The settings' names with zeros, for a rank whose checks failed."""
    names = [*SETTING_NAMES, *_gradient_masks(list(layers), ())]
    return dict.fromkeys(names, 0.0)


class Snapshot:
    """What a step's commit changes, kept so that an interrupt can put it back."""

    def __init__(
        self,
        counters: dict[str, Any],
        layers: dict[str, dict[str, Any]],
        capture: dict[str, Any],
        grads: list[tuple[nn.Parameter, Tensor | None, Tensor | None]],
    ) -> None:
        self.counters = counters
        self.layers = layers
        self.capture = capture
        self.grads = grads

    @classmethod
    def take(cls, kfac: KFACParts, params: Sequence[nn.Parameter]) -> Snapshot:
        """References to K-FAC's state and copies of the ``.grad`` of ``params``."""
        counters = {
            k: getattr(kfac, k, None)
            for k in ("steps", "skipped_factor_updates", "last_nu", "damping_override")
        }
        layers = {
            name: {k: getattr(layer, k) for k in ("A", "G", "inv", *STATS_ATTRS)}
            for name, layer in kfac.layers.items()
        }
        cap = kfac._capture
        capture = {
            "capturing": cap.capturing,
            "layer_pass": dict(cap.layer_pass),
            "layer_call": dict(cap.layer_call),
            "generation": cap.generation,
            "loaded": cap.loaded,
        }
        # the .grad tensor itself (DDP may hold it as a bucket view) and its values
        grads = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in params]
        return cls(counters, layers, capture, grads)

    def restore(self, kfac: KFACParts) -> None:
        """Put everything :meth:`take` saw back."""
        for p, tensor, values in self.grads:
            if tensor is None or values is None:
                p.grad = None
            else:
                tensor.copy_(values)
                p.grad = tensor
        for k, v in self.counters.items():
            setattr(kfac, k, v)
        layer: KFACLayer
        for name, saved in self.layers.items():
            layer = kfac.layers[name]
            for k, v in saved.items():
                setattr(layer, k, v)
        for k, v in self.capture.items():
            setattr(kfac._capture, k, v)


def stats_to_sum(
    layers: Mapping[str, KFACLayer], packed: bool, reducer: Reducer, device: torch.device
) -> list[Tensor]:
    """Every layer's ``[Σ a aᵀ, Σ g gᵀ]`` (upper triangles if ``packed``), then the counts.

    Copies when they travel: the all-reduce writes into its tensors, and a step that
    fails after it must leave this rank's own sums for the retry.
    """
    copy = reducer.world_size > 1
    tensors: list[Tensor] = []
    for layer in layers.values():
        for t in layer.stats():
            square = t.ndim == 3 and t.shape[-1] == t.shape[-2]
            tensors.append(pack_upper(t) if packed and square else t.clone() if copy else t)
    counts = torch.tensor(
        [[layer.a_rows, layer.g_samples] for layer in layers.values()],
        dtype=torch.float64,
        device=device,
    )
    return [*tensors, counts]


def kl_clip_scale(plan: StepPlan, pre: Mapping[str, Tensor]) -> float:
    """The KL clip ``ν = min(1, √(kl_clip / |lr² Σ⟨P, ∇⟩|))`` of the step (1 without a clip).

    The products are taken in the gradient's dtype, their sum accumulated in float64.
    """
    if plan.kl_clip is None or not pre:
        return 1.0
    grads = plan.grads
    vg = sum(float((pre[n] * grads[n]).sum(dtype=torch.float64)) for n in pre)
    vg *= plan.lr**2
    return 1.0 if vg == 0.0 else min(1.0, math.sqrt(plan.kl_clip / abs(vg)))


def warn_about_statistics(
    plan: StepPlan, bad: list[str], layers: Mapping[str, KFACLayer], grad_scaler: Any
) -> None:
    """Warn of a skipped factor update (without a GradScaler) or of dropped statistics.

    With a GradScaler, an overflow is expected now and then: the optimizer skips that
    step too, and :attr:`KFAC.skipped_factor_updates` counts it.
    """
    if bad and grad_scaler is None:
        dtypes = sorted({str(layers[n].factor_dtype) for n in bad})
        warnings.warn(
            f"K-FAC skipped the factor update of step {plan.step}: the statistics of layers "
            f"{bad} are not finite (factor_dtype {', '.join(dtypes)}). The gradients or "
            "the layer inputs hold inf or NaN, or their squares overflowed: pass "
            "factor_dtype=torch.float32 if the factors are half precision.",
            RuntimeWarning,
            stacklevel=3,
        )
    if plan.dropped:
        warnings.warn(
            f"K-FAC left out the statistics of layers {plan.dropped} gathered before step "
            f"{plan.step}: a backward was interrupted while they were being added.",
            RuntimeWarning,
            stacklevel=3,
        )
