"""Drop-in ``nn.Module`` versions of sparsefuse ops. Modules hold parameters and call the functional API."""

from .activations import CELU, Snake1d

__all__ = ["Snake1d", "CELU"]
