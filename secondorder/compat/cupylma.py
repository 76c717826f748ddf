"""A drop-in for cuPyLMA users: ``from secondorder.compat.cupylma import LMA``.

cuPyLMA's ``LMA(model, devices, residual_fn, ...)`` with ``step(x, y, slice_size)``
returning ``(loss, terminated)`` maps onto :class:`~secondorder.LevenbergMarquardt`
with cuPyLMA's multiplicative damping rule and Marquardt's ``diag(JᵀJ)`` damping.
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

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..distributed.devices import resolve_devices
from ..lm.optimizer import LevenbergMarquardt, StepInfo
from ..lm.residuals import mse

__all__ = ["LMA", "get_available_gpus"]


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

    Args:
        model: the module to train.
        devices: devices to compute on, as cuPyLMA takes them (``get_available_gpus()``).
            An empty sequence or ``None`` keeps the model where it is.  Otherwise the
            model moves to the first device, is replicated on the others, and the
            slices of each batch go to the devices in turn, as in cuPyLMA; inputs and
            targets may stay on the host (``LevenbergMarquardt(..., devices=...)``).
        residual_fn: ``(outputs, targets) -> residuals`` (default: plain differences).
        learning_rate: scales every update.
        damping_start: initial λ.
        damping_up, damping_down: λ is multiplied by ``damping_up`` after a rejected
            attempt and by ``damping_down`` after an accepted step.
        solver: cuPyLMA passes a NumPy-style ``solve(A, b)`` function here; such a
            callable is accepted and not used (the step is solved by secondorder's
            Cholesky, which raises λ when the factorisation fails instead of
            throwing).  A string selects one of secondorder's solvers.
        dtype: cuPyLMA's dtype of the normal matrix (``numpy.float32`` there); here it
            sets ``gram_dtype``.  ``None`` keeps secondorder's default (``"auto"``).
        **options: any further :class:`~secondorder.config.LMConfig` field.
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[Any] | None = None,
        residual_fn: Callable[[Tensor, Tensor], Tensor] = mse,
        learning_rate: float = 1.0,
        damping_start: float = 1e-3,
        damping_up: float = 10.0,
        damping_down: float = 0.1,
        solver: str | Callable[..., Any] | None = None,
        dtype: Any = None,
        **options: Any,
    ) -> None:
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
        options.setdefault("damping_rule", "multiplicative")
        options.setdefault("damping_matrix", "marquardt")
        try:
            self.optimizer = LevenbergMarquardt(
                model,
                residual_fn,
                lr=learning_rate,
                damping=damping_start,
                damping_up=damping_up,
                damping_down=damping_down,
                **options,
            )
        except Exception:
            if devs and home is not None:
                model.to(home)
            raise
        #: The :class:`~secondorder.StepInfo` of the last step, for more detail.
        self.last_info: StepInfo | None = None

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
        return info.loss, info.terminated

    @property
    def damping(self) -> float:
        """The current λ."""
        return self.optimizer.damping
