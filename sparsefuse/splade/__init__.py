"""Fused SPLADE head: max/sum pooling of ``log1p(relu(hidden @ weight.T + bias))`` over the sequence without
materialising the [batch, seq_len, vocab] logits; sparse (max) or recomputed (sum) backward."""

from .head import POOLINGS, splade_pool, splade_pool_backward_op, splade_pool_op, torch_splade_pool

__all__ = ["POOLINGS", "splade_pool", "splade_pool_op", "splade_pool_backward_op", "torch_splade_pool"]
