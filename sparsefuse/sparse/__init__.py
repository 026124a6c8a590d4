"""The shared sparse core: row formats (:mod:`.formats`), dense -> sparse compaction (:mod:`.compact`) and the
gather-accumulate product (:mod:`.spmm`) that every sparse x dense product in sparsefuse is built on.

Used by the SAE decode/encode (:mod:`sparsefuse.sae`), the SPLADE backward and the TwELL FFN (:mod:`sparsefuse.ffn`).
"""

from .compact import dense_to_csr, dense_to_ell, dense_to_row_block_pattern
from .formats import CSR, ELL, BlockELL, RowBlockPattern, TwELL
from .._auto import SparsityMonitor, sampled_nonzero_stats
from .sddmm import block_sddmm, torch_block_sddmm
from .spmm import JumpReLUEncoder, block_sparse_matmul, matmul_skip_zeros, sparse_matmul, torch_sparse_matmul

__all__ = [
    "CSR", "ELL", "TwELL", "RowBlockPattern", "BlockELL", "JumpReLUEncoder", "dense_to_csr", "dense_to_ell", "dense_to_row_block_pattern",
    "matmul_skip_zeros", "sparse_matmul", "torch_sparse_matmul", "block_sddmm", "torch_block_sddmm",
    "block_sparse_matmul", "SparsityMonitor", "sampled_nonzero_stats",
]  # fmt: skip
