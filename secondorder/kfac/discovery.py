"""Which submodules of a model K-FAC preconditions, and why the others keep plain gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .layers import ConvLayer, EmbeddingLayer, KFACLayer, LinearLayer

__all__ = ["FUNCTIONAL_PARENTS", "SUPPORTED_MODULES", "discover_layers", "make_layer"]

#: Module classes K-FAC preconditions; everything else keeps its plain gradient.
SUPPORTED_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)
#: Containers that use their submodules' weights without calling the submodules, so
#: those submodules' hooks never fire.
FUNCTIONAL_PARENTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def make_layer(name: str, module: nn.Module, factor_dtype: torch.dtype | None) -> KFACLayer:
    """The :class:`KFACLayer` that keeps the factors of ``module``."""
    if isinstance(module, nn.Linear):
        return LinearLayer(name, module, factor_dtype)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return ConvLayer(name, module, factor_dtype)
    if isinstance(module, nn.Embedding):
        return EmbeddingLayer(name, module, factor_dtype)
    raise TypeError(
        f"layer {name!r} is a {type(module).__name__}, which K-FAC does not support; "
        f"supported kinds are {[c.__name__ for c in SUPPORTED_MODULES]}"
    )


def _functional_children(named: dict[str, nn.Module]) -> set[str]:
    functional: set[str] = set()
    for name, m in named.items():
        if isinstance(m, FUNCTIONAL_PARENTS):
            functional.update(f"{name}.{c}" if name else c for c, _ in m.named_modules() if c)
    return functional


def _check_modules(
    modules: Sequence[str], named: dict[str, nn.Module], functional: set[str]
) -> None:
    unknown = [m for m in modules if m not in named]
    if unknown:
        raise ValueError(
            f"Invalid modules={list(modules)!r}: {unknown} are not submodule names of "
            "the model (see model.named_modules())."
        )
    for m in modules:
        if not isinstance(named[m], SUPPORTED_MODULES):
            raise TypeError(
                f"Invalid modules entry {m!r}: it is a {type(named[m]).__name__}, which "
                f"K-FAC does not support; supported kinds are "
                f"{[c.__name__ for c in SUPPORTED_MODULES]}. Leave it out and it keeps "
                "its plain gradient."
            )
        if m in functional:
            raise ValueError(
                f"Invalid modules entry {m!r}: its parent calls its weight functionally, "
                "so its hooks never fire."
            )


def discover_layers(
    model: nn.Module,
    modules: Sequence[str] | None,
    skip_layers: Sequence[str],
    factor_dtype: torch.dtype | None,
) -> tuple[dict[str, KFACLayer], dict[str, str]]:
    """Layers to precondition (name → layer, model order) and skipped modules (name → why).

    ``modules`` names the submodules to precondition (default: every supported, trainable
    one); ``skip_layers`` holds names or class names (any case) to leave out.
    """
    named = dict(model.named_modules())
    skip = {s.lower() for s in skip_layers}
    functional = _functional_children(named)
    if modules is not None:
        if isinstance(modules, str):
            modules = [modules]
        _check_modules(modules, named, functional)
    layers: dict[str, KFACLayer] = {}
    skipped: dict[str, str] = {}
    for name, m in named.items():
        label = name or "<model>"
        own = [p for p in m.parameters(recurse=False)]
        if modules is not None and name not in modules:
            if own:
                skipped[label] = "not in modules"
            continue
        if not isinstance(m, SUPPORTED_MODULES):
            if own:
                skipped[label] = f"{type(m).__name__} is not supported"
            continue
        if name.lower() in skip or type(m).__name__.lower() in skip:
            skipped[label] = "in skip_layers"
        elif name in functional:
            skipped[label] = "weight used functionally by its parent"
        elif not m.weight.requires_grad:
            skipped[label] = "frozen (weight.requires_grad is False)"
        else:
            layers[label] = make_layer(label, m, factor_dtype)
    if not layers:
        raise ValueError(
            "the model has no layer K-FAC can precondition (supported: "
            f"{[c.__name__ for c in SUPPORTED_MODULES]}, trainable, not in skip_layers); "
            f"skipped: {skipped or 'no module with parameters'}"
        )
    return layers, skipped
