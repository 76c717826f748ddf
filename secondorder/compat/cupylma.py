"""A drop-in for cuPyLMA users: ``from secondorder.compat.cupylma import LMA, configuration``.

cuPyLMA's ``LMA(model, devices, residual_fn, solver, learning_rate, damping_start,
damping_up, damping_down, dtype)`` (0.2), its released 0.1.x form ``LMA(model,
devices, loss_fn, residual_fn, ...)``, and ``step(x, y, slice_size)`` returning
``(loss, terminated)`` map onto :class:`~secondorder.LevenbergMarquardt` with
cuPyLMA's multiplicative damping rule and Marquardt's ``diag(JᵀJ)`` damping.
cuPyLMA's global :data:`configuration` (``DAMPING_MAX``, ``DAMPING_MIN``,
``UPDATE_ATTEMPTS``, ``FORCED_JACOBIAN_MODE``/``JACOBIAN_MODE``) is read when an
:class:`LMA` is built.
What changes for the better without any edit of the calling code:

* ``learning_rate`` scales the update (cuPyLMA stores it and never applies it);
* float64 models work (cuPyLMA supports float32 only);
* the reported loss is ``mean(r²)`` of whatever ``residual_fn`` returns, not an
  assumed MSE;
* a zero column of J (a dead unit) no longer stalls training: the damping diagonal
  has a floor, so ``JᵀJ + λD`` is positive definite for every λ > 0;
* a step is kept only when the gain ratio is positive, so the loss never rises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..distributed.devices import resolve_devices
from ..lm.optimizer import LevenbergMarquardt, StepInfo
from ..lm.residuals import mse

__all__ = ["LMA", "Configuration", "configuration", "get_available_gpus"]


class Configuration:
    """cuPyLMA's global settings, with cuPyLMA's defaults; read when an :class:`LMA` is built.

    ``DAMPING_MAX``/``DAMPING_MIN`` bound λ (``damping_max``/``damping_min``),
    ``UPDATE_ATTEMPTS`` is ``max_attempts``, and ``FORCED_JACOBIAN_MODE=True`` with
    ``JACOBIAN_MODE`` ``"forward"`` or ``"reverse"`` (``"graph"``: reverse) fixes the
    whole-slice Jacobian mode (``jacobian="batch_forward"``/``"batch_reverse"``).
    The overlap, dispatch and verbosity switches are accepted and change nothing:
    secondorder always overlaps copies on CUDA and dispatches slices cyclically.
    Options passed to :class:`LMA` take precedence.  A misspelt name raises
    :class:`AttributeError` instead of being ignored.
    """

    __slots__ = (
        "DAMPING_MAX",
        "DAMPING_MIN",
        "FORCED_JACOBIAN_MODE",
        "JACOBIAN_MODE",
        "OPTIM_CYCLIC_DISPATCH",
        "OPTIM_OVERLAP_D2H_H2D",
        "OPTIM_OVERLAP_H2D",
        "UPDATE_ATTEMPTS",
        "VERBOSE_MODEL",
        "VERBOSE_OPTIM",
    )

    def __init__(self) -> None:
        self.DAMPING_MAX: float = 1e10
        self.DAMPING_MIN: float = 1e-10
        self.UPDATE_ATTEMPTS: int = 10
        self.OPTIM_OVERLAP_H2D: bool = True
        self.OPTIM_OVERLAP_D2H_H2D: bool = True
        self.OPTIM_CYCLIC_DISPATCH: bool = True
        self.VERBOSE_MODEL: bool = False
        self.VERBOSE_OPTIM: bool = False
        self.FORCED_JACOBIAN_MODE: bool = False
        self.JACOBIAN_MODE: str = "forward"

    def options(self) -> dict[str, Any]:
        """The :class:`~secondorder.config.LMConfig` settings these values stand for."""
        out: dict[str, Any] = {
            "damping_max": self.DAMPING_MAX,
            "damping_min": self.DAMPING_MIN,
            "max_attempts": self.UPDATE_ATTEMPTS,
        }
        if self.FORCED_JACOBIAN_MODE:
            modes = {
                "forward": "batch_forward",
                "reverse": "batch_reverse",
                "graph": "batch_reverse",
            }
            if self.JACOBIAN_MODE not in modes:
                raise ValueError(
                    f"Unknown configuration.JACOBIAN_MODE={self.JACOBIAN_MODE!r}; valid "
                    f"choices are {tuple(modes)}."
                )
            out["jacobian"] = modes[self.JACOBIAN_MODE]
        return out


#: The settings every :class:`LMA` built afterwards reads (as ``cupylma.configuration``).
configuration = Configuration()

#: The parameters after ``residual_fn`` in cuPyLMA's positional order.
_POSITIONAL = ("solver", "learning_rate", "damping_start", "damping_up", "damping_down", "dtype")


def _is_solver(obj: object) -> bool:
    """Whether ``obj`` is a linear solver (``numpy.linalg.solve`` ...), not a residual function.

    Tells ``LMA(model, devices, residual_fn, solver)`` from 0.1.x's ``LMA(model,
    devices, loss_fn, residual_fn)``: a solver is a string or a function whose name
    says ``solve`` or that lives in a ``linalg`` module.
    """
    if isinstance(obj, str):
        return True
    name = getattr(obj, "__name__", "") or ""
    module = getattr(obj, "__module__", "") or ""
    return "solve" in name or "linalg" in module


def get_available_gpus() -> list[torch.device]:
    """The CUDA devices of this process, as cuPyLMA lists them (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _torch_dtype(dtype: Any) -> torch.dtype:
    """``numpy.float32``, ``"float64"``, ``torch.float32`` ... as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = np.dtype(dtype).name
    if name not in ("float32", "float64"):
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    return torch.float32 if name == "float32" else torch.float64


class LMA:
    """cuPyLMA's optimizer interface over :class:`~secondorder.LevenbergMarquardt`.

    Both of cuPyLMA's argument orders are accepted::

        LMA(model, devices, residual_fn, solver, learning_rate, ...)   # cuPyLMA 0.2
        LMA(model, devices, loss_fn, residual_fn, solver, ...)         # cuPyLMA 0.1.x

    The two are told apart by the fourth argument: a solver (a string, or a function
    such as ``numpy.linalg.solve`` whose name says ``solve`` or that comes from a
    ``linalg`` module) means the 0.2 order; any other function, 0.1.x's
    ``residual_fn``.  ``loss_fn=`` may also be passed by keyword.

    Args:
        model: the module to train.
        devices: devices to compute on, as cuPyLMA takes them (``get_available_gpus()``).
            An empty sequence or ``None`` keeps the model where it is.  Otherwise the
            model moves to the first device, is replicated on the others, and the
            slices of each batch go to the devices in turn, as in cuPyLMA; inputs and
            targets may stay on the host (``LevenbergMarquardt(..., devices=...)``).
        residual_fn: ``(outputs, targets) -> residuals`` (default: plain differences).
        loss_fn: 0.1.x's ``(outputs, targets) -> scalar`` loss: :meth:`step` then
            returns its value at the parameters the step ends with, averaged over the
            slices weighted by their size, as 0.1.x reports it.  Steps are still
            accepted on ``½‖r‖²``.  ``None`` (0.2): the loss is ``mean(r²)``.
        solver: cuPyLMA passes a NumPy-style ``solve(A, b)`` function here; such a
            callable is accepted and not used (the step is solved by secondorder's
            Cholesky, which raises λ when the factorisation fails instead of
            throwing).  A string selects one of secondorder's solvers.
        learning_rate: scales every update.
        damping_start: initial λ.
        damping_up, damping_down: λ is multiplied by ``damping_up`` after a rejected
            attempt and by ``damping_down`` after an accepted step.
        dtype: cuPyLMA's dtype of the normal matrix (``numpy.float32`` there); here it
            sets ``gram_dtype``.  ``None`` keeps secondorder's default (``"auto"``).
        **options: any further :class:`~secondorder.config.LMConfig` field; these
            override :data:`configuration`.
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[Any] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        named = self._arguments(args, kwargs)
        loss_fn = named.pop("loss_fn")
        residual_fn = named.pop("residual_fn")
        solver, dtype = named.pop("solver"), named.pop("dtype")
        options = {**configuration.options(), **named.pop("options")}
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if isinstance(solver, str):
            options.setdefault("solver", solver)
        elif solver is not None and not callable(solver):
            raise TypeError(f"solver must be a solver name or a callable, got {solver!r}")
        if dtype is not None:
            options.setdefault("gram_dtype", _torch_dtype(dtype))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        devs: list[torch.device] = []
        home = next((p.device for p in model.parameters()), None)
        if devices is not None and not (isinstance(devices, (list, tuple)) and not devices):
            # Validated before the model moves, so a bad entry leaves it where it was.
            devs = list(resolve_devices(devices, None, torch.device("cpu")).devices)
            options["devices"] = devs
            # On the first device the model itself serves as that device's replica.
            model.to(devs[0])
        self.model = model
        self.devices = devs
        #: 0.1.x's reporting loss, or None.
        self.loss_fn = loss_fn
        options.setdefault("damping_rule", "multiplicative")
        options.setdefault("damping_matrix", "marquardt")
        try:
            self.optimizer = LevenbergMarquardt(
                model,
                residual_fn,
                lr=named["learning_rate"],
                damping=named["damping_start"],
                damping_up=named["damping_up"],
                damping_down=named["damping_down"],
                **options,
            )
        except Exception:
            if devs and home is not None:
                model.to(home)
            raise
        #: The :class:`~secondorder.StepInfo` of the last step, for more detail.
        self.last_info: StepInfo | None = None

    @staticmethod
    def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The constructor's arguments by name, from either of cuPyLMA's orders."""
        named: dict[str, Any] = {
            "loss_fn": None,
            "residual_fn": mse,
            "solver": None,
            "learning_rate": 1.0,
            "damping_start": 1e-3,
            "damping_up": 10.0,
            "damping_down": 0.1,
            "dtype": None,
        }
        rest = list(args)
        positional: tuple[str, ...]
        if len(rest) >= 2 and callable(rest[1]) and not _is_solver(rest[1]):
            # 0.1.x: LMA(model, devices, loss_fn, residual_fn, solver, ...).
            positional = ("loss_fn", "residual_fn", *_POSITIONAL)
        else:
            positional = ("residual_fn", *_POSITIONAL)
        if len(rest) > len(positional):
            raise TypeError(
                f"LMA takes at most {2 + len(positional)} positional arguments (model, "
                f"devices, {', '.join(positional)}), got {2 + len(rest)}"
            )
        given = dict(zip(positional, rest, strict=False))
        for key in list(kwargs):
            if key in named:
                if key in given:
                    raise TypeError(f"LMA got multiple values for argument {key!r}")
                given[key] = kwargs.pop(key)
        named.update(given)
        named["options"] = kwargs
        return named

    def step(self, x: Tensor, y: Tensor, slice_size: int | None = None) -> tuple[float, bool]:
        """One LM iteration on ``(x, y)``; returns ``(loss, terminated)``.

        With several devices, a ``slice_size`` of the whole batch or more is replaced
        by ``ceil(batch / len(devices))``, as cuPyLMA does, so every device gets a slice.
        """
        if (
            len(self.devices) > 1
            and isinstance(slice_size, int)
            and isinstance(x, Tensor)
            and x.ndim > 0
            and slice_size >= x.shape[0]
        ):
            slice_size = -(-x.shape[0] // len(self.devices))
        info = self.optimizer.step(x, y, slice_size=slice_size)
        self.last_info = info
        if self.loss_fn is None:
            return float(info.loss), info.terminated
        return self._reported_loss(x, y, slice_size), info.terminated

    def _reported_loss(self, x: Tensor, y: Tensor, slice_size: int | None) -> float:
        """0.1.x's loss: ``loss_fn`` per slice, weighted by the slice's samples."""
        assert self.loss_fn is not None
        device = next(self.model.parameters()).device
        size = x.shape[0] if slice_size is None else max(1, min(slice_size, x.shape[0]))
        total = 0.0
        with torch.no_grad():
            for start in range(0, x.shape[0], size):
                xs = x[start : start + size].to(device)
                ys = y[start : start + size].to(device)
                total += float(self.loss_fn(self.model(xs), ys)) * xs.shape[0]
        return total / x.shape[0]

    @property
    def damping(self) -> float:
        """The current λ."""
        return self.optimizer.damping
