"""Snake1d activation (DAC / SNAC audio codecs), forward and backward in one pass each.

    y = x + 1 / (alpha + eps) * sin(alpha * x) ** 2          x [B, C, T], alpha [C] (one per channel)

:mod:`.reference` holds the plain-torch ground truth, :mod:`.kernels` the Triton kernels, :mod:`.launch` their
launchers, :mod:`.op` the torch.library ops and :mod:`.functional` the public :func:`snake`.
"""

from ..._validation import SNAKE_DTYPES
from .functional import snake
from .kernels import (
    ALPHA_DIRECT,
    ALPHA_LAST_ARRIVER,
    ALPHA_PARTIALS,
    SIN_ACCURATE,
    SIN_FAST,
    SIN_HARDWARE,
    SIN_LIBDEVICE,
    snake_bwd_kernel,
    snake_fwd_flat_kernel,
    snake_fwd_kernel,
)
from .launch import SnakeKnobs, division_magic
from .op import snake_backward_op, snake_op
from .reference import torch_snake, torch_snake_backward

__all__ = [
    "SNAKE_DTYPES",
    "snake",
    "snake_op",
    "snake_backward_op",
    "torch_snake",
    "torch_snake_backward",
    "snake_fwd_kernel",
    "snake_fwd_flat_kernel",
    "snake_bwd_kernel",
    "division_magic",
    "SnakeKnobs",
    "SIN_ACCURATE",
    "SIN_FAST",
    "SIN_LIBDEVICE",
    "SIN_HARDWARE",
    "ALPHA_DIRECT",
    "ALPHA_LAST_ARRIVER",
    "ALPHA_PARTIALS",
]
