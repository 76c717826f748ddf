"""Which modules hold the trainable parameters: the one layer discovery of LM.

The outer-product rule of the per-sample reverse Jacobian
(:func:`~secondorder.lm.jacobian.outer_product_layers`) and the K-FAC preconditioner of
the CG solver (:func:`~secondorder.lm.kfac_cg.kronecker_blocks`) both start from
:func:`trainable_layers`: every module that owns one of the unknowns, with the
names under which its weight and bias are unknowns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["TrainableLayer", "trainable_layers"]


@dataclass(frozen=True)
class TrainableLayer:
    """A module that owns trainable parameters, and their names among the unknowns.

    Attributes:
        name: the module's qualified name in the model (``""`` for the model itself).
        module: the module.
        weight, bias: the names of the parameters registered as ``weight`` and
            ``bias`` among the unknowns (``None`` where there is none, or where it is
            not one of the unknowns).
        owns: whether every unknown the module holds is its own ``weight`` or ``bias``.
    """

    name: str
    module: nn.Module
    weight: str | None
    bias: str | None
    owns: bool = True


def trainable_layers(
    model: nn.Module, names: Sequence[str], params: Sequence[Tensor]
) -> list[TrainableLayer]:
    """Every module of ``model`` that owns one of the unknowns ``params`` (named ``names``).

    A parameter shared by several modules is named once (its first name); each module
    that holds it is listed.  Modules are in ``model.named_modules()`` order.
    """
    canonical = {id(p): name for name, p in zip(names, params, strict=True)}
    layers: list[TrainableLayer] = []
    for qual, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) in canonical]
        if not own:
            continue
        weight_p = module._parameters.get("weight")
        bias_p = module._parameters.get("bias")
        weight = None if weight_p is None else canonical.get(id(weight_p))
        bias = None if bias_p is None else canonical.get(id(bias_p))
        owns = all(p is weight_p or p is bias_p for p in own)
        layers.append(TrainableLayer(qual, module, weight, bias, owns))
    return layers
