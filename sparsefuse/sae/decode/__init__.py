"""Sparse SAE decode (see :mod:`.functional`); its ``method="auto"`` cost model in :mod:`.auto`."""

from . import auto
from .auto import DEFAULT_MAX_L0, DecodeKnobs
from .functional import METHODS, sparse_decode, topk_decode
from .op import sparse_decode_backward_op, sparse_decode_op
from .reference import torch_sparse_decode

__all__ = [
    "sparse_decode",
    "topk_decode",
    "torch_sparse_decode",
    "sparse_decode_op",
    "sparse_decode_backward_op",
    "METHODS",
    "DEFAULT_MAX_L0",
    "DecodeKnobs",
    "auto",
]
