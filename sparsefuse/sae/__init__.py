"""Sparse autoencoder inference built on the shared sparse core: decode, fused JumpReLU encode (SAELens patch next)."""

from .decode import sparse_decode, topk_decode, torch_sparse_decode
from .encode import jumprelu_encode, torch_jumprelu_encode

__all__ = ["sparse_decode", "topk_decode", "torch_sparse_decode", "jumprelu_encode", "torch_jumprelu_encode"]
