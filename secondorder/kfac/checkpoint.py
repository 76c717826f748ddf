"""K-FAC's ``state_dict``: what it holds, how a loaded one is checked, how it is restored.

Every check runs before anything is set, so a refused state leaves K-FAC unchanged.
Beyond keys, types and shapes, the values are checked where the next steps rely on
them: factors and decompositions finite, the factors' diagonals and the eigenvalues
``>= 0``, each factor symmetric with ``F_ij² <= F_ii·F_jj`` (A and G are covariances:
an indefinite factor would otherwise be "repaired" silently by the decompositions'
safeguards), the inverses' and Cholesky factors' diagonals
``> 0`` (they come from ``A + λI``, positive definite), and a decomposition present
where this rank preconditions the layer before it next recomputes it.  Tensors saved
on another device are moved to the layer's, as ``torch.optim`` does; a tensor on the
``meta`` device has no values and is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from .config import check_damping
from .layers import KFACLayer

__all__ = [
    "check_counters",
    "check_covariance",
    "check_layers_state",
    "check_tensor",
    "check_values",
    "layers_state",
    "loaded_layers",
]


def layers_state(layers: Mapping[str, KFACLayer]) -> dict[str, Any]:
    """Copies of every layer's factors and this rank's decompositions.

    The factors are always there (the identity before the first update, where the
    running averages start), so every state of one K-FAC has the same tensors of the
    same shapes: a fresh K-FAC's state is the template ``torch.distributed.checkpoint``
    loads into.
    """
    out: dict[str, Any] = {}
    for name, layer in layers.items():
        entry: dict[str, Any] = {}
        a, g = (
            layer.identity_factors() if layer.A is None or layer.G is None else (layer.A, layer.G)
        )
        entry["A"] = a.clone()
        entry["G"] = g.clone()
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


def check_layers_state(
    entries: Any,
    layers: Mapping[str, KFACLayer],
    compute_method: str,
    needs_inverse: Collection[str] = (),
) -> None:
    """Check that ``entries`` holds one sound entry for each of ``layers``.

    ``needs_inverse`` names the layers whose decomposition the next step uses without
    recomputing it (this rank preconditions them and no inverse update is due).
    """
    if not isinstance(entries, dict):
        raise TypeError("K-FAC state_dict: 'layers' must be a dict of layer name → entry")
    names = set(entries)
    if names != set(layers):
        raise ValueError(
            f"K-FAC state_dict holds layers {sorted(names)} but this model's preconditioned "
            f"layers are {sorted(layers)}"
        )
    for name, entry in entries.items():
        where = f"K-FAC state_dict: layer {name!r}"
        _check_entry(where, entry, layers[name], compute_method, name in needs_inverse)


def _check_entry(where: str, entry: Any, layer: KFACLayer, method: str, needed: bool) -> None:
    if not isinstance(entry, dict):
        raise TypeError(f"{where} entry must be a dict, got {type(entry).__name__}")
    if ("A" in entry) != ("G" in entry):
        have, lack = ("A", "G") if "A" in entry else ("G", "A")
        raise ValueError(f"{where} has factor {have} but no {lack}: both or neither")
    a_shape, g_shape = layer.factor_shapes()
    for key, shape in (("A", a_shape), ("G", g_shape)):
        if key in entry:
            check_tensor(where, f"factor {key}", entry[key], shape)
            check_values(where, f"factor {key}", entry[key], positive=False)
            check_covariance(where, f"factor {key}", entry[key])
    inv = entry.get("inv", {})
    if not isinstance(inv, dict):
        raise TypeError(f"{where} 'inv' must be a dict, got {type(inv).__name__}")
    if not inv:
        if needed:
            raise ValueError(
                f"{where} has no decomposition, but this rank preconditions the layer with "
                "it before the next inverse update recomputes it: the checkpoint lost it. "
                "Save the state_dict of every rank and load each rank's own, or load at a "
                "step where inv_update_steps recomputes it."
            )
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
        if key in ("QA", "QG"):
            check_values(where, f"decomposition {key}", inv[key], positive=None)
        else:
            # eigenvalues >= 0; inverses and Cholesky factors of A + λI have a diagonal > 0
            check_values(where, f"decomposition {key}", inv[key], positive=key[0] != "d")


def loaded_layers(
    entries: Mapping[str, Any], layers: Mapping[str, KFACLayer], inv_dtype: torch.dtype
) -> dict[str, tuple[Tensor | None, Tensor | None, dict[str, Tensor]]]:
    """Each layer's ``(A, G, inv)`` from checked ``entries``, in new tensors.

    On each layer's device: factors in its ``factor_dtype`` (None when the entry has
    none), decompositions in ``inv_dtype``.  Nothing is assigned.
    """
    out: dict[str, tuple[Tensor | None, Tensor | None, dict[str, Tensor]]] = {}
    for name, entry in entries.items():
        layer = layers[name]
        dev = layer.device
        a = g = None
        if "A" in entry:
            a = entry["A"].to(dev, layer.factor_dtype, copy=True)
            g = entry["G"].to(dev, layer.factor_dtype, copy=True)
        inv = {k: v.to(dev, inv_dtype, copy=True) for k, v in entry.get("inv", {}).items()}
        out[name] = (a, g, inv)
    return out


def check_tensor(where: str, what: str, t: Any, shape: tuple[int, ...]) -> None:
    """Raise unless ``t`` is a floating tensor of ``shape`` that holds values."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{where} {what} must be a floating tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where} {what} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.device.type == "meta":
        raise ValueError(
            f"{where} {what} is on the meta device, which holds no values: load the "
            "checkpoint with torch.load(..., map_location='cpu') (or the training device)."
        )


def check_values(where: str, what: str, t: Tensor, positive: bool | None) -> None:
    """Raise unless ``t`` is finite and its diagonal ``> 0`` (``positive``) or ``>= 0``.

    The diagonal of a stack of square matrices ``(groups, n, n)``, or every entry of a
    vector of diagonal values ``(1, n)``; ``positive=None`` checks finiteness only.
    """
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(
            f"{where} {what} has {bad} non-finite value(s) (inf or NaN): the checkpoint is "
            "damaged. Load one saved before the fault, or start this K-FAC afresh."
        )
    if positive is None:
        return
    diag = t.diagonal(dim1=-2, dim2=-1) if t.ndim == 3 else t
    low = diag.min()
    if (low <= 0) if positive else (low < 0):
        need = (
            "> 0 (it comes from A + λI, which is positive definite)"
            if positive
            else (">= 0 (a covariance or its eigenvalues)")
        )
        raise ValueError(
            f"{where} {what} has a diagonal value {float(low)!r}, but it must be {need}: "
            "the checkpoint is damaged. Load one saved before the fault, or start this "
            "K-FAC afresh."
        )


#: Rows of a factor checked at once (bounds the float64 temporaries of a large factor).
_CHUNK_ELEMENTS = 1 << 22


def check_covariance(where: str, what: str, t: Tensor) -> None:
    """Raise unless each matrix of ``t`` (a finite ``(groups, n, n)`` stack) could be one.

    Two necessary conditions of a positive semidefinite matrix, O(n²) each, in float64
    with the rounding of ``t``'s dtype allowed for (``u = n·eps``): symmetry,
    ``|F_ij − F_ji| <= u·√(F_ii·F_jj)``, and ``F_ij² <= F_ii·F_jj·(1 + u)``.  A
    ``(1, n)`` vector of diagonal values (an Embedding's A) has nothing to check.
    """
    if t.ndim != 3:
        return
    n = t.shape[-1]
    u = n * torch.finfo(t.dtype).eps
    rows = max(1, _CHUNK_ELEMENTS // max(n, 1))
    for grp in range(t.shape[0]):
        f = t[grp]
        d = f.diagonal().to(torch.float64).clamp_min(0.0)
        for start in range(0, n, rows):
            block = f[start : start + rows].to(torch.float64)
            bound = d[start : start + rows, None] * d[None, :]
            mirror = f[:, start : start + rows].T.to(torch.float64)
            asym = (block - mirror).abs() > u * bound.sqrt()
            big = block.square() > bound * (1 + u)
            for bad, why in ((asym, "is not symmetric"), (big, "is not a covariance")):
                if bool(bad.any()):
                    i, j = (int(x) for x in bad.nonzero()[0])
                    i += start
                    raise ValueError(
                        f"{where} {what} {why}: F[{i}, {j}] = {float(f[i, j])!r}, F[{j}, "
                        f"{i}] = {float(f[j, i])!r}, F[{i}, {i}] = {float(f[i, i])!r}, F[{j}, "
                        f"{j}] = {float(f[j, j])!r} (group {grp}), but a factor is symmetric "
                        "with F[i, j]² <= F[i, i]·F[j, j]: the checkpoint is damaged. Load "
                        "one saved before the fault, or start this K-FAC afresh."
                    )
