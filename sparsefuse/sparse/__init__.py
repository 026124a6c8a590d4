"""The shared sparse core: row formats (:mod:`.formats`), dense -> sparse compaction (:mod:`.compact`) and the
gather-accumulate product (:mod:`.spmm`) that every sparse x dense product in sparsefuse is built on.

Used by the SAE decode/encode (:mod:`sparsefuse.sae`), the SPLADE backward and the TwELL FFN (:mod:`sparsefuse.ffn`).
"""

from .compact import dense_to_csr, dense_to_ell
from .formats import CSR, ELL, TwELL
from .spmm import JumpReLUEncoder, matmul_skip_zeros, sparse_matmul, torch_sparse_matmul

__all__ = [
    "CSR", "ELL", "TwELL", "JumpReLUEncoder", "dense_to_csr", "dense_to_ell", "matmul_skip_zeros", "sparse_matmul",
    "torch_sparse_matmul",
]  # fmt: skip
