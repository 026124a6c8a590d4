"""Drop-in ``nn.Module`` versions of sparsefuse ops. Modules hold parameters and call the functional API."""

from .activations import CELU, Snake1d
from .ffn import FATReLU, SparseGatedMLP
from .norms import RMSNorm
from .relu_mlp import SparseReluMLP
from .sae import SparseJumpReLUSAE
from .splade import SpladeHead

__all__ = [
    "Snake1d",
    "CELU",
    "SparseJumpReLUSAE",
    "SpladeHead",
    "SparseGatedMLP",
    "FATReLU",
    "SparseReluMLP",
    "RMSNorm",
]
