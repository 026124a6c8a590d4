"""The shared sparse core: row formats (:mod:`.formats`), dense -> sparse compaction (:mod:`.compact`) and the
gather-accumulate product (:mod:`.spmm`) that every sparse x dense product in sparsefuse is built on.

Used by the SAE decode/encode (:mod:`sparsefuse.sae`), the SPLADE backward and the TwELL FFN (:mod:`sparsefuse.ffn`).
"""

from __future__ import annotations

import warnings
from typing import Any

from .._auto import SparsityMonitor, sampled_nonzero_stats
from .compact import dense_to_csr, dense_to_ell, dense_to_row_block_pattern
from .formats import CSR, ELL, BlockELL, RowBlockPattern, TwELL
from .sddmm import block_sddmm, torch_block_sddmm
from .spmm import ThresholdedLinear, block_sparse_matmul, matmul_skip_zeros, sparse_matmul, torch_sparse_matmul

__all__ = [
    "CSR", "ELL", "TwELL", "RowBlockPattern", "BlockELL", "ThresholdedLinear", "dense_to_csr", "dense_to_ell",
    "dense_to_row_block_pattern", "matmul_skip_zeros", "sparse_matmul", "torch_sparse_matmul", "block_sddmm",
    "torch_block_sddmm", "block_sparse_matmul", "SparsityMonitor", "sampled_nonzero_stats",
]

_warned_jumprelu_encoder = False


def __getattr__(name: str) -> Any:
    # JumpReLUEncoder describes an SAE encode, so it lives in sparsefuse.sae (a higher floor, imported only when the
    # old name is asked for).
    if name == "JumpReLUEncoder":
        global _warned_jumprelu_encoder
        if not _warned_jumprelu_encoder:
            _warned_jumprelu_encoder = True
            warnings.warn("sparsefuse.sparse.JumpReLUEncoder is deprecated; import it from sparsefuse.sae",
                          DeprecationWarning, stacklevel=2)
        from ..sae import JumpReLUEncoder

        return JumpReLUEncoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
