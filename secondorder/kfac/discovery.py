"""Which submodules of a model K-FAC preconditions, and why the others keep plain gradients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .layers import ConvLayer, EmbeddingLayer, KFACLayer, LinearLayer

__all__ = [
    "FUNCTIONAL_PARENTS",
    "SUPPORTED_MODULES",
    "check_model_and_scaler",
    "discover_layers",
    "layer_table",
    "make_layer",
]

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
    _check_skip_layers(skip_layers, named)
    _check_materialized(layers)
    _check_untied(model, layers)
    if not layers:
        raise ValueError(
            "the model has no layer K-FAC can precondition (supported: "
            f"{[c.__name__ for c in SUPPORTED_MODULES]}, trainable, not in skip_layers); "
            f"skipped: {skipped or 'no module with parameters'}"
        )
    return layers, skipped


def _check_skip_layers(skip_layers: Sequence[str], named: dict[str, nn.Module]) -> None:
    known = {n.lower() for n in named} | {type(m).__name__.lower() for m in named.values()}
    unknown = [s for s in skip_layers if s.lower() not in known]
    if unknown:
        raise ValueError(
            f"Invalid skip_layers={list(skip_layers)!r}: {unknown} match no submodule name "
            "or class name of the model (see model.named_modules()); a misspelt entry would "
            "leave the layer preconditioned."
        )


def _check_materialized(layers: dict[str, KFACLayer]) -> None:
    for name, layer in layers.items():
        for p in layer.module.parameters(recurse=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise ValueError(
                    f"layer {name!r} ({type(layer.module).__name__}) has uninitialized "
                    "parameters: run the model once on a sample batch, so that lazy "
                    "modules know their shapes, before building K-FAC."
                )
            if p.device.type == "meta":
                raise ValueError(
                    f"layer {name!r} has its parameters on the meta device (shapes without "
                    "values): materialize the model first (model.to_empty(device=...) and "
                    "initialize it), then build K-FAC."
                )


def _check_untied(model: nn.Module, layers: dict[str, KFACLayer]) -> None:
    # a parameter that two modules share (tied weights) gets one gradient, the sum of
    # both uses: preconditioning it as two blocks would let the last one win
    # (one module registered under two names is one module: its calls share the block)
    users: dict[int, dict[int, str]] = {}
    for mod_name, m in model.named_modules(remove_duplicate=False):
        for p_name, p in m.named_parameters(recurse=False):
            place = f"{mod_name}.{p_name}" if mod_name else p_name
            users.setdefault(id(p), {}).setdefault(id(m), place)
    for name, layer in layers.items():
        for p in layer.params():
            places = list(users.get(id(p), {}).values())
            if len(places) > 1:
                raise ValueError(
                    f"layer {name!r}: its parameter is shared by {places} (tied weights). "
                    "K-FAC preconditions one module's parameters as one block, so a tied "
                    "parameter would be preconditioned once per module with the last "
                    "write winning. Pass skip_layers with every module that shares it to "
                    "keep its plain gradient (or share it by calling one module twice)."
                )


def check_model_and_scaler(model: Any, grad_scaler: Any) -> None:
    """Raise unless ``model`` is a module and ``grad_scaler`` a GradScaler, a callable or None."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if grad_scaler is not None and not (hasattr(grad_scaler, "get_scale") or callable(grad_scaler)):
        raise TypeError(
            f"Invalid grad_scaler={grad_scaler!r}: must be a torch.amp.GradScaler or a "
            "callable returning the current loss scale."
        )


def layer_table(
    layers: Mapping[str, KFACLayer], workers: Mapping[str, int], skipped: Mapping[str, str]
) -> str:
    """The preconditioned layers (factor shapes, decomposing rank) and the plain ones."""
    lines = ["K-FAC preconditions:"]
    for name, layer in layers.items():
        a, g = layer.factor_shapes()
        lines.append(
            f"  {name:<30} {layer.kind:<10} A {tuple(a)}  G {tuple(g)}  "
            f"inverse on rank {workers[name]}"
        )
    lines.append("Plain gradients:" if skipped else "Plain gradients: none")
    for name, why in skipped.items():
        lines.append(f"  {name:<30} {why}")
    return "\n".join(lines)
