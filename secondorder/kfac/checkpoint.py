"""K-FAC's ``state_dict``: what it holds, how a loaded one is checked, how it is restored.

Every check runs before anything is set, so a refused state leaves K-FAC unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .config import check_damping
from .layers import KFACLayer

__all__ = ["check_counters", "check_layers_state", "check_tensor", "layers_state", "load_layers"]


def layers_state(layers: Mapping[str, KFACLayer]) -> dict[str, Any]:
    """Copies of every layer's factors (when set) and this rank's decompositions."""
    out: dict[str, Any] = {}
    for name, layer in layers.items():
        entry: dict[str, Any] = {}
        if layer.A is not None and layer.G is not None:
            entry["A"] = layer.A.clone()
            entry["G"] = layer.G.clone()
        entry["inv"] = {k: v.clone() for k, v in layer.inv.items()}
        out[name] = entry
    return out


def check_counters(state: Any) -> None:
    """Check the state's type, its keys and its ``steps``/``damping_override``/skip count."""
    if not isinstance(state, dict):
        raise TypeError(f"K-FAC state_dict must be a dict, got {type(state).__name__}")
    missing = {"steps", "layers"} - set(state)
    if missing:
        raise ValueError(f"K-FAC state_dict lacks {sorted(missing)}")
    steps = state["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"K-FAC state_dict: steps={steps!r} must be an integer >= 0")
    override = state.get("damping_override")
    if override is not None:
        try:
            check_damping(override)
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"K-FAC state_dict: damping_override={override!r} must be a finite number "
                "> 0 or None"
            ) from exc
    skipped = state.get("skipped_factor_updates", 0)
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise ValueError(
            f"K-FAC state_dict: skipped_factor_updates={skipped!r} must be an integer >= 0"
        )


def check_layers_state(entries: Any, layers: Mapping[str, KFACLayer], compute_method: str) -> None:
    """Check that ``entries`` holds one well-shaped entry for each of ``layers``."""
    if not isinstance(entries, dict):
        raise TypeError("K-FAC state_dict: 'layers' must be a dict of layer name → entry")
    names = set(entries)
    if names != set(layers):
        raise ValueError(
            f"K-FAC state_dict holds layers {sorted(names)} but this model's preconditioned "
            f"layers are {sorted(layers)}"
        )
    for name, entry in entries.items():
        _check_entry(f"K-FAC state_dict: layer {name!r}", entry, layers[name], compute_method)


def _check_entry(where: str, entry: Any, layer: KFACLayer, method: str) -> None:
    if not isinstance(entry, dict):
        raise TypeError(f"{where} entry must be a dict, got {type(entry).__name__}")
    if ("A" in entry) != ("G" in entry):
        have, lack = ("A", "G") if "A" in entry else ("G", "A")
        raise ValueError(f"{where} has factor {have} but no {lack}: both or neither")
    a_shape, g_shape = layer.factor_shapes()
    for key, shape in (("A", a_shape), ("G", g_shape)):
        if key in entry:
            check_tensor(where, f"factor {key}", entry[key], shape)
    inv = entry.get("inv", {})
    if not isinstance(inv, dict):
        raise TypeError(f"{where} 'inv' must be a dict, got {type(inv).__name__}")
    if not inv:
        return  # no decomposition yet, or one this rank does not hold
    layouts = layer.inverse_layouts(method)
    layout = next((lay for lay in layouts if set(lay) == set(inv)), None)
    if layout is None:
        raise ValueError(
            f"{where} holds decomposition {sorted(inv)}, which compute_method="
            f"{method!r} cannot use (it expects one of "
            f"{[sorted(lay) for lay in layouts]}); load it into a K-FAC built with the "
            "compute_method that saved it."
        )
    for key, shape in layout.items():
        check_tensor(where, f"decomposition {key}", inv[key], shape)


def load_layers(entries: Mapping[str, Any], layers: Mapping[str, KFACLayer]) -> None:
    """Set every layer's factors and decompositions from checked ``entries``."""
    for name, entry in entries.items():
        layer = layers[name]
        if "A" in entry:
            layer.A = entry["A"].to(layer.factor_dtype).clone()
            layer.G = entry["G"].to(layer.factor_dtype).clone()
        else:
            layer.A = layer.G = None
        layer.inv = {k: v.clone() for k, v in entry.get("inv", {}).items()}


def check_tensor(where: str, what: str, t: Any, shape: tuple[int, ...]) -> None:
    """Raise unless ``t`` is a floating tensor of ``shape``."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{where} {what} must be a floating tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where} {what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
