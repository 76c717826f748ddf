"""The input windows a convolution sees: padded as the layer pads, strided, dilated.

Shared by K-FAC's patch rows (:mod:`secondorder.kfac.layers.conv`) and LM's per-sample
convolution rows (:mod:`secondorder.lm.conv_rows`), which lay the same windows out
differently.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["padded", "windows"]


def padded(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """``x`` padded exactly as ``module`` pads it (any ``padding_mode``, ``"same"``)."""
    pad = module._reversed_padding_repeated_twice
    if not any(pad):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, list(pad), mode=mode)


def windows(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """A view ``(N, C, *positions, *kernel)`` of the padded input under every output.

    Entry ``[i, c, *p, *κ]`` is input channel ``c`` of sample ``i`` at kernel offset
    ``κ`` of output position ``p``: a window of the dilated kernel's span at every
    stride, then every ``dilation``-th tap.  No copy is made.
    """
    v = padded(module, x)
    nd = len(module.kernel_size)
    conv_dims = zip(module.kernel_size, module.dilation, module.stride, strict=True)
    for d, (k, dil, st) in enumerate(conv_dims):
        v = v.unfold(2 + d, dil * (k - 1) + 1, st)
    taps = (slice(None),) * (2 + nd) + tuple(slice(None, None, dil) for dil in module.dilation)
    return v[taps]
