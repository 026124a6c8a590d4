"""Sparse autoencoder inference built on the shared sparse core (decode now; encode and SAELens patching next)."""

from .decode import sparse_decode, topk_decode, torch_sparse_decode

__all__ = ["sparse_decode", "topk_decode", "torch_sparse_decode"]
