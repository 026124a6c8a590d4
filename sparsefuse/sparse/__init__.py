"""The shared sparse core: row formats (:mod:`.formats`, the training format :class:`.Hybrid` among them),
dense -> sparse compaction (:mod:`.compact`) and the gather-accumulate product (:mod:`.spmm`) that every
sparse x dense product in sparsefuse is built on.

Used by the SAE decode/encode (:mod:`sparsefuse.sae`), the SPLADE backward and the TwELL FFN (:mod:`sparsefuse.ffn`).
"""

from __future__ import annotations

import warnings
from typing import Any

from .._plan import SparsityMonitor, sampled_nonzero_stats
from .block_grad import block_ell_sddmm, block_ell_transpose, transposed_matmul
from .block_pack import PackedFactors, pack_block_factors, spilled_blocks, unpack_block_factors
from .block_spmm import block_sparse_matmul
from .compact import dense_to_csr, dense_to_ell, dense_to_hybrid, dense_to_row_block_pattern
from .formats import CSR, ELL, BlockCSC, BlockELL, Hybrid, RowBlockPattern, TwELL
from .scan import matmul_skip_zeros
from .sddmm import block_sddmm, torch_block_sddmm
from .spmm import ThresholdedLinear, sparse_matmul, torch_sparse_matmul

__all__ = [
    "CSR",
    "ELL",
    "TwELL",
    "RowBlockPattern",
    "BlockELL",
    "BlockCSC",
    "Hybrid",
    "dense_to_hybrid",
    "ThresholdedLinear",
    "dense_to_csr",
    "dense_to_ell",
    "dense_to_row_block_pattern",
    "matmul_skip_zeros",
    "sparse_matmul",
    "torch_sparse_matmul",
    "block_sddmm",
    "torch_block_sddmm",
    "block_sparse_matmul",
    "block_ell_sddmm",
    "block_ell_transpose",
    "transposed_matmul",
    "PackedFactors",
    "pack_block_factors",
    "unpack_block_factors",
    "spilled_blocks",
    "SparsityMonitor",
    "sampled_nonzero_stats",
]


def _jumprelu_encoder(x, W_enc, b_enc, threshold, b_dec=None) -> ThresholdedLinear:
    """The deprecated ``sparsefuse.sparse.JumpReLUEncoder(x, W_enc, b_enc, threshold, b_dec)``: the same layer as the
    core's generic :class:`ThresholdedLinear` (``sparsefuse.sae.JumpReLUEncoder`` keeps the SAE's field names)."""
    return ThresholdedLinear(x, W_enc, b_enc, threshold, b_dec)


def __getattr__(name: str) -> Any:
    # The core carries no SAE names; the old name still builds the same layer, with a warning.
    if name == "JumpReLUEncoder":
        warnings.warn(
            "sparsefuse.sparse.JumpReLUEncoder is deprecated: use sparsefuse.sae.JumpReLUEncoder "
            "(or the generic sparsefuse.sparse.ThresholdedLinear)",
            DeprecationWarning,
            stacklevel=2,
        )
        return _jumprelu_encoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
