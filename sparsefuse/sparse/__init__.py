"""The shared sparse core: row formats (:mod:`.formats`), dense -> sparse compaction (:mod:`.compact`) and the
gather-accumulate product (:mod:`.spmm`) that every sparse x dense product in sparsefuse is built on.

Status: building blocks of the SAE issue; the public ``sparse_decode`` / encode API is not built on them yet.
"""

from .compact import dense_to_csr, dense_to_ell
from .formats import CSR, ELL
from .spmm import JumpReLUEncoder, matmul_skip_zeros, sparse_matmul, torch_sparse_matmul

__all__ = ["CSR", "ELL", "JumpReLUEncoder", "dense_to_csr", "dense_to_ell", "matmul_skip_zeros", "sparse_matmul", "torch_sparse_matmul"]
