"""Fused activations: Snake1d and CELU (forward + backward Triton kernels, torch.library ops)."""

from .celu import celu, celu_, torch_celu, torch_celu_backward
from .snake import snake, torch_snake, torch_snake_backward

__all__ = ["snake", "celu", "celu_", "torch_snake", "torch_snake_backward", "torch_celu", "torch_celu_backward"]
