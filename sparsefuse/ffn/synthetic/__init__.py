"""Synthetic weights whose ReLU gates have the statistics of a sparse ReLU LLM: one gated-FFN layer with inputs
shaped for a target sparsity (:mod:`.layer`), and a whole calibrated ReLU Llama (:mod:`.model`)."""

from .layer import SyntheticFFN, gate_statistics, synthetic_ffn
from .model import LLAMA_SHAPES, model_gate_statistics, synthetic_llama

__all__ = [
    "SyntheticFFN",
    "synthetic_ffn",
    "gate_statistics",
    "LLAMA_SHAPES",
    "synthetic_llama",
    "model_gate_statistics",
]
