"""The optimizer's checkpoint: torch.optim's ``state_dict`` schema with LM's entries.

Format 2 (written now) has torch.optim's shape.  LM's state is one record for the
whole parameter vector, so, as ``torch.optim.LBFGS`` does, it lives under the first
parameter's index::

    {
        "state": {0: {"damping": λ, "nu": ν, "scale": Moré's scale or None,
                      "steps": step count, "auto_jacobian": {signature: strategy}}},
        "param_groups": [{"lr": lr, "params": [0, 1, ...], "num_parameters": n,
                          "parameter_shapes": [[...], ...], "config": {LMConfig fields}}],
        "format_version": 2,
    }

Format 1 (written before) kept the same entries in one flat dict; it still loads.
Both hold only tensors, numbers, strings, lists and dicts, so they load with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor

from .config import LMConfig

__all__ = [
    "STATE_FORMAT_VERSION",
    "Checkpoint",
    "as_format1",
    "entries",
    "read_state_dict",
    "write_state_dict",
]

#: The format :func:`write_state_dict` writes; :func:`read_state_dict` reads it and 1.
STATE_FORMAT_VERSION = 2
_READABLE = (1, 2)


@dataclass(frozen=True)
class Checkpoint:
    """The optimizer's state in a checkpoint, validated.

    Attributes:
        damping, nu, scale: the damping state (λ, Nielsen's ν, Moré's running scale).
        steps: number of :meth:`~secondorder.lm.LevenbergMarquardt.step` calls.
        lrs: ``lr`` of each parameter group.
        auto_jacobian: the strategies ``jacobian="auto"`` chose, per input signature.
    """

    damping: float
    nu: float
    scale: Tensor | None
    steps: int
    lrs: list[Any]
    auto_jacobian: dict[str, str]


#: Settings added to LMConfig after format 2, and their defaults.
_LATER_SETTINGS: dict[str, Any] = {"cg_preconditioner": "jacobi"}


def write_state_dict(
    checkpoint: Checkpoint,
    config: LMConfig,
    shapes: list[list[int]],
    n: int,
) -> dict[str, Any]:
    """The format-2 state dict of ``checkpoint`` for parameters of ``shapes`` (n scalars)."""
    cfg = asdict(config)
    cfg["gram_dtype"] = None if config.gram_dtype is None else str(config.gram_dtype)
    for key, default in _LATER_SETTINGS.items():
        # Settings added after format 2 appear only when set, so a checkpoint of the
        # default configuration is the one earlier releases wrote.
        if cfg[key] == default:
            del cfg[key]
    scale = checkpoint.scale
    state = {
        "damping": checkpoint.damping,
        "nu": checkpoint.nu,
        "scale": None if scale is None else scale.clone(),
        "steps": checkpoint.steps,
        "auto_jacobian": dict(checkpoint.auto_jacobian),
    }
    groups = [
        {
            "lr": lr,
            "params": list(range(len(shapes))),
            "num_parameters": n,
            "parameter_shapes": shapes,
            "config": cfg,
        }
        for lr in checkpoint.lrs
    ]
    return {"state": {0: state}, "param_groups": groups, "format_version": STATE_FORMAT_VERSION}


def read_state_dict(
    state_dict: Any, shapes: list[list[int]], n: int, num_groups: int
) -> Checkpoint:
    """Validate a format-1 or format-2 state dict for parameters of ``shapes`` (n scalars).

    Everything is checked before anything is returned, so a malformed checkpoint
    leaves the optimizer exactly as it was.  A missing entry raises ``KeyError``
    naming it.
    """
    if not isinstance(state_dict, dict) or "format_version" not in state_dict:
        raise ValueError("state_dict is not a LevenbergMarquardt state dict (no format_version)")
    version = state_dict["format_version"]
    if version not in _READABLE:
        raise ValueError(
            f"state_dict has format_version={version!r}; this secondorder reads "
            f"versions {' and '.join(map(str, _READABLE))}"
        )
    flat = entries(state_dict)
    count = flat["num_parameters"]
    if count != n or flat["parameter_shapes"] != shapes:
        raise ValueError(
            f"state_dict is for a model with {count} parameters of shapes "
            f"{flat['parameter_shapes']}, but this optimizer has {n} "
            f"of shapes {shapes}"
        )
    damping, nu, steps, lrs = (flat[k] for k in ("damping", "nu", "steps", "lr"))
    for name, value in (("damping", damping), ("nu", nu)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise ValueError(f"state_dict has {name}={value!r}: must be a finite number >= 0")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"state_dict has steps={steps!r}: must be an integer >= 0")
    if not isinstance(lrs, (list, tuple)) or len(lrs) != num_groups:
        raise ValueError(
            f"state_dict has lr={lrs!r}: must hold one value per parameter group ({num_groups})"
        )
    scale = flat["scale"]
    return Checkpoint(
        damping=float(damping),
        nu=float(nu),
        scale=scale,
        steps=steps,
        lrs=list(lrs),
        auto_jacobian=dict(flat["auto_jacobian"]),
    )


def entries(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A format-1 or format-2 state dict's entries as one flat dict (format 1's layout).

    ``damping``, ``nu``, ``scale``, ``steps``, ``auto_jacobian``, ``num_parameters``,
    ``parameter_shapes``, ``config`` and ``lr`` (one value per group), whichever
    format holds them; a missing entry stays missing.
    """
    if state_dict.get("format_version") == 1:
        return {k: v for k, v in state_dict.items() if k != "format_version"}
    groups = state_dict["param_groups"]
    flat = dict(state_dict["state"].get(0, {}))
    first = groups[0] if groups else {}
    for key in ("num_parameters", "parameter_shapes", "config"):
        if key in first:
            flat[key] = first[key]
    flat["lr"] = [g["lr"] for g in groups]
    return flat


def as_format1(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The same checkpoint in format 1, the flat layout of releases before format 2."""
    return {"format_version": 1, **entries(state_dict)}
