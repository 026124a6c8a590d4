"""Fused JumpReLU SAE encode straight into ELL (see :mod:`.functional`)."""

from .._encoder_tile import encoder_pre_tile, sae_input
from ..encoder import JumpReLUEncoder
from .functional import jumprelu_encode
from .kernels import jumprelu_encode_kernel
from .op import jumprelu_encode_op
from .reference import torch_jumprelu_encode

__all__ = [
    "jumprelu_encode",
    "jumprelu_encode_op",
    "torch_jumprelu_encode",
    "jumprelu_encode_kernel",
    "encoder_pre_tile",
    "sae_input",
    "JumpReLUEncoder",
]
