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

:func:`read_state_dict` checks every entry before the optimizer changes anything:
numbers as the constructor checks them, the scale as a finite non-negative n-vector,
λ within ``damping_max``, and the saved settings against the optimizer's.  Resuming
with other settings takes another path than the saved run would have; the error
names each difference, and :func:`saved_settings` gives the checkpoint's settings to
build a matching optimizer with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from .._validation import check_number
from .config import LMConfig
from .damping import NIELSEN_SHRINK
from .jacobian import JACOBIANS

__all__ = [
    "STATE_FORMAT_VERSION",
    "Checkpoint",
    "as_format1",
    "check_settings",
    "entries",
    "read_state_dict",
    "saved_settings",
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
_LATER_SETTINGS: dict[str, Any] = {
    "cg_preconditioner": "jacobi",
    "damping_shrink": NIELSEN_SHRINK,
}

#: Settings a checkpoint may differ in: the state overrides ``lr`` and ``damping`` (the
#: initial values), and the others only change how a step's work is laid out.
_FREE_SETTINGS = ("lr", "damping", "slice_size", "memory_budget", "memory_limit")

#: Settings the saved state belongs to (ν to Nielsen's rule, the scale to Moré's
#: matrix): a difference in them is refused even with ``strict=False``.
_STATE_SETTINGS = ("damping_rule", "damping_matrix")


#: Settings of how a step runs, not of the run: a checkpoint neither stores nor checks
#: them, so a state dict moves between the default and the capturable step.
_MODE_SETTINGS = ("capturable", "check_every", "candidates")


def _settings_of(config: LMConfig) -> dict[str, Any]:
    """``config`` as a checkpoint stores it (dtypes as strings; no mode settings)."""
    cfg = {k: v for k, v in asdict(config).items() if k not in _MODE_SETTINGS}
    cfg["gram_dtype"] = None if config.gram_dtype is None else str(config.gram_dtype)
    return cfg


def saved_settings(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~secondorder.lm.config.LMConfig` settings a checkpoint was written with.

    ``LevenbergMarquardt(model, **saved_settings(sd))`` builds an optimizer that
    :meth:`~secondorder.lm.LevenbergMarquardt.load_state_dict` accepts ``sd`` into
    and that continues the saved run step for step.
    """
    saved = entries(state_dict).get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"state_dict holds no settings (config={saved!r})")
    known = {f.name for f in fields(LMConfig)}
    out = {**_LATER_SETTINGS, **{k: v for k, v in saved.items() if k in known}}
    dtype = out.get("gram_dtype")
    if isinstance(dtype, str) and dtype.startswith("torch."):
        out["gram_dtype"] = getattr(torch, dtype.removeprefix("torch."))
    return out


def write_state_dict(
    checkpoint: Checkpoint,
    config: LMConfig,
    shapes: list[list[int]],
    n: int,
) -> dict[str, Any]:
    """The format-2 state dict of ``checkpoint`` for parameters of ``shapes`` (n scalars)."""
    cfg = _settings_of(config)
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
    state_dict: Any,
    shapes: list[list[int]],
    n: int,
    num_groups: int,
    config: LMConfig,
    *,
    strict: bool = True,
) -> Checkpoint:
    """Validate a format-1 or format-2 state dict for an optimizer of ``config``.

    The parameters have ``shapes`` (n scalars in all).  Everything is checked before
    anything is returned, so a refused checkpoint leaves the optimizer exactly as it
    was: the numbers as the constructor checks them (λ also ``<= damping_max``), the
    scale, the Jacobian choices and the saved settings (:func:`check_settings`).  A
    missing entry raises ``KeyError`` naming it.
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
    check_settings(flat["config"], config, strict=strict)
    damping, nu, steps, lrs = (flat[k] for k in ("damping", "nu", "steps", "lr"))
    _check_entry("damping", damping, at_least=0.0)
    if damping > config.damping_max:
        raise ValueError(
            f"state_dict has damping={damping:g}: must be <= damping_max="
            f"{config.damping_max:g}; build the optimizer with the checkpoint's "
            "damping_max (see saved_settings)"
        )
    # Nielsen's ν starts at 2 and doubles on each rejection.
    _check_entry("nu", nu, at_least=2.0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"state_dict has steps={steps!r}: must be an integer >= 0")
    if not isinstance(lrs, (list, tuple)) or len(lrs) != num_groups:
        raise ValueError(
            f"state_dict has lr={lrs!r}: must hold one value per parameter group ({num_groups})"
        )
    for i, lr in enumerate(lrs):
        _check_entry(f"param_groups[{i}]['lr']", lr, above=0.0)
    scale = flat["scale"]
    _check_scale(scale, n, config.damping_matrix)
    auto = flat["auto_jacobian"]
    valid = tuple(j for j in JACOBIANS if j != "auto")
    if not isinstance(auto, dict) or not all(
        isinstance(k, str) and v in valid for k, v in auto.items()
    ):
        raise ValueError(
            f"state_dict has auto_jacobian={auto!r}: must map input signatures (str) "
            f"to one of {valid}"
        )
    return Checkpoint(
        damping=float(damping),
        nu=float(nu),
        scale=scale,
        steps=steps,
        lrs=[float(lr) for lr in lrs],
        auto_jacobian=dict(auto),
    )


def _check_entry(
    name: str, value: Any, *, above: float | None = None, at_least: float | None = None
) -> None:
    """A number of the checkpoint, checked as the constructor checks its settings."""
    try:
        check_number(name, value, above=above, at_least=at_least)
    except (TypeError, ValueError):
        bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
        raise ValueError(
            f"state_dict has {name}={value!r}: must be a finite number {bound}"
        ) from None


def _check_scale(scale: Any, n: int, damping_matrix: str) -> None:
    """Moré's running scale: None, or a finite, non-negative floating n-vector."""
    if scale is None:
        return
    if damping_matrix != "more":
        raise ValueError(
            f"state_dict has a Moré scale but this optimizer has damping_matrix="
            f"{damping_matrix!r}, which keeps none"
        )
    if not isinstance(scale, Tensor) or not scale.is_floating_point():
        what = f"dtype {scale.dtype}" if isinstance(scale, Tensor) else type(scale).__name__
        raise ValueError(f"state_dict has a scale of {what}: must be a floating tensor of {n}")
    if tuple(scale.shape) != (n,):
        raise ValueError(
            f"state_dict has a scale of shape {tuple(scale.shape)}: must have shape ({n},), "
            "one entry per parameter"
        )
    bad = int((~torch.isfinite(scale) | (scale < 0)).sum())
    if bad:
        raise ValueError(
            f"state_dict has a scale with {bad} of {n} entries NaN, infinite or negative: "
            "each must be a finite number >= 0"
        )


def check_settings(saved: Any, config: LMConfig, *, strict: bool = True) -> None:
    """Refuse a checkpoint written with other settings than ``config``'s.

    ``lr``, ``damping`` and the layout settings (``slice_size``, ``memory_budget``,
    ``memory_limit``) may differ.  With ``strict=False`` only the settings the state
    belongs to (``damping_rule``, ``damping_matrix``) must match; the optimizer's
    own values of the others apply.  Settings the checkpoint does not hold (written
    before they existed) take their defaults of that time.
    """
    if not isinstance(saved, dict):
        raise ValueError(f"state_dict has config={saved!r}: must be a dict of settings")
    ours = _settings_of(config)
    theirs = {**_LATER_SETTINGS, **saved}
    compared = _STATE_SETTINGS if not strict else tuple(k for k in ours if k not in _FREE_SETTINGS)
    unknown = sorted(k for k in theirs if k not in ours) if strict else []
    diffs = [
        f"{k}={theirs[k]!r} in the checkpoint, {ours[k]!r} here"
        for k in compared
        if k in theirs and theirs[k] != ours[k]
    ]
    diffs += [
        f"{k}={theirs[k]!r} in the checkpoint, not a setting of this secondorder" for k in unknown
    ]
    if not diffs:
        return
    state_only = all(k.split("=")[0] in _STATE_SETTINGS for k in diffs)
    hint = (
        ""
        if state_only or not strict
        else ", or load with load_state_dict(state_dict, strict=False) to keep this "
        "optimizer's settings (except damping_rule and damping_matrix, which the saved "
        "λ, ν and scale belong to)"
    )
    raise ValueError(
        "state_dict was written with other settings than this optimizer's: "
        + "; ".join(diffs)
        + ". Build the optimizer with the checkpoint's settings: LevenbergMarquardt(model, "
        "**secondorder.lm.checkpoint.saved_settings(state_dict))" + hint + "."
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
