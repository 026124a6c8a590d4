"""TopK SAE encode without the dense pre-activations (see :mod:`.functional`)."""

from .._encoder_tile import encoder_pre_tile, sae_input
from .functional import ACTIVATIONS, topk_encode
from .kernels import EMPTY_KEY, topk_encode_fwd_kernel
from .keys import TopKEncodeKnobs
from .launch import MAX_KERNEL_K
from .op import topk_encode_op
from .reference import torch_topk_encode

__all__ = [
    "topk_encode",
    "topk_encode_op",
    "torch_topk_encode",
    "topk_encode_fwd_kernel",
    "ACTIVATIONS",
    "MAX_KERNEL_K",
    "TopKEncodeKnobs",
    "EMPTY_KEY",
    "encoder_pre_tile",
    "sae_input",
]
