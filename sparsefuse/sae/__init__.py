"""Sparse autoencoder inference built on the shared sparse core: decode, fused JumpReLU and TopK encodes, the fused
JumpReLU forward; the SAELens patch lives in :mod:`sparsefuse.integrations.sae_lens`."""

from .decode import sparse_decode, topk_decode, torch_sparse_decode
from .encode import jumprelu_encode, torch_jumprelu_encode
from .encoder import JumpReLUEncoder
from .forward import jumprelu_sae_forward
from .topk import topk_encode, torch_topk_encode

__all__ = [
    "sparse_decode",
    "topk_decode",
    "torch_sparse_decode",
    "jumprelu_encode",
    "torch_jumprelu_encode",
    "topk_encode",
    "torch_topk_encode",
    "JumpReLUEncoder",
    "jumprelu_sae_forward",
]
