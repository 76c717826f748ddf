"""Writing a step's point into the model, its BatchNorm statistics and its replicas.

The parameters are written last in a step, so anything that raises before leaves
them as they were.  A model with BatchNorm in training mode also needs one real
forward at the new point to move its running statistics; if that forward raises (an
interrupt), the parameters and buffers are put back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..distributed.devices import sync_replica
from .model import ModelFunction, interacting_modules, to_device

__all__ = ["write_point"]


def write_point(
    function: ModelFunction, x: Tensor, inputs: Any, accepted: Tensor | None = None
) -> None:
    """Write ``x`` into the model and every replica.

    ``accepted``: for the capturable step, a 0-d bool on the device; ``x`` is then the
    old point where it is false, and the running statistics are put back by a mask
    (the forward at ``x`` runs either way: deciding on the host would read it).
    """
    model = function.model
    if interacting_modules(model):
        old = function.flat()
        buffers = [b.clone() for b in model.buffers()]
        function.write(x)
        try:
            with torch.no_grad():
                model(to_device(inputs, function.params[0].device))
        except BaseException:
            function.write(old)
            with torch.no_grad():
                for b, saved in zip(model.buffers(), buffers, strict=True):
                    b.copy_(saved)
            raise
        if accepted is not None:
            with torch.no_grad():
                for b, saved in zip(model.buffers(), buffers, strict=True):
                    b.copy_(torch.where(accepted, b, saved))
    else:
        function.write(x)
    for replica in function.replicas:
        sync_replica(model, replica.model)
