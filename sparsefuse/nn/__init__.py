"""Drop-in ``nn.Module`` versions of sparsefuse ops. Modules hold parameters and call the functional API."""

from .activations import CELU, Snake1d
from .sae import SparseJumpReLUSAE
from .ffn import SparseGatedMLP
from .splade import SpladeHead

__all__ = ["Snake1d", "CELU", "SparseJumpReLUSAE", "SpladeHead", "SparseGatedMLP"]
