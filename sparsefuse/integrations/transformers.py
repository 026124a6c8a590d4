"""transformers integrations: a SPLADE encoder over any ``AutoModelForMaskedLM`` (the fused head replaces the
vocabulary projection + pooling); imports transformers lazily."""

from .transformers_mlm import SpladeEncoderForMaskedLM, projection_bypassed, splade_encode, vocabulary_projection

__all__ = ["SpladeEncoderForMaskedLM", "projection_bypassed", "splade_encode", "vocabulary_projection"]
