"""transformers integrations: ``patch_llama`` (activation-sparse TwELL FFN for ReLU ``LlamaMLP`` layers) and a SPLADE
encoder over any ``AutoModelForMaskedLM`` (the fused head replaces the vocabulary projection + pooling); imports
transformers lazily."""

from ._llama import is_relu_llama_mlp, patch_llama
from .transformers_mlm import SpladeEncoderForMaskedLM, projection_bypassed, splade_encode, vocabulary_projection

__all__ = [
    "patch_llama",
    "is_relu_llama_mlp",
    "SpladeEncoderForMaskedLM",
    "projection_bypassed",
    "splade_encode",
    "vocabulary_projection",
]
