"""transformers integrations: ``patch_llama`` (activation-sparse TwELL FFN for ReLU ``LlamaMLP`` layers; for training
``l1_loss`` and ``sparsity_report`` over the patched layers, ``shard_llama_fsdp2`` for FSDP2) and a SPLADE
encoder over any ``AutoModelForMaskedLM`` (the fused head replaces the vocabulary projection + pooling);
``load_sparse_checkpoint`` loads and patches the TwELL paper's released SparseLM checkpoints; imports transformers
lazily."""

from ._llama import (
    fuse_norms,
    fuse_rotary,
    is_relu_llama_mlp,
    l1_loss,
    patch_llama,
    patched_mlps,
    release_step,
    shard_llama_fsdp2,
    sparse_gate,
    sparsity_report,
)
from .sparselm import load_sparse_checkpoint
from .transformers_mlm import SpladeEncoderForMaskedLM, projection_bypassed, splade_encode, vocabulary_projection

__all__ = [
    "patch_llama",
    "load_sparse_checkpoint",
    "fuse_norms",
    "fuse_rotary",
    "is_relu_llama_mlp",
    "sparse_gate",
    "patched_mlps",
    "l1_loss",
    "release_step",
    "sparsity_report",
    "shard_llama_fsdp2",
    "SpladeEncoderForMaskedLM",
    "projection_bypassed",
    "splade_encode",
    "vocabulary_projection",
]
