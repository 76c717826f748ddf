"""K-FAC layers: one file per kind of module, one shared base."""

from __future__ import annotations

from .base import KFACLayer, KroneckerLayer
from .conv import ConvLayer, conv_patch_rows, conv_patches
from .embedding import EmbeddingLayer
from .linear import LinearLayer

__all__ = [
    "ConvLayer",
    "EmbeddingLayer",
    "KFACLayer",
    "KroneckerLayer",
    "LinearLayer",
    "conv_patch_rows",
    "conv_patches",
]
