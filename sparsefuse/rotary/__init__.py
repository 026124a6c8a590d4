"""Rotary position embedding (RoPE) of q and k, forward and backward: a fused drop-in for transformers'
``apply_rotary_pos_emb`` as Llama calls it.

:mod:`.reference` holds the plain-torch ground truth, :mod:`.kernels` the Triton kernels, :mod:`.launch` their
launchers (and the cost model), :mod:`.op` the torch.library ops and :mod:`.functional` the public
:func:`apply_rotary_pos_emb`.
"""

from .functional import ROTARY_DTYPES, apply_rotary_pos_emb, check_rotary_args
from .kernels import rotary_kernel
from .op import rotary_bwd_op, rotary_fwd_op
from .reference import rotate_half, torch_apply_rotary_pos_emb, torch_rotary_backward

__all__ = [
    "ROTARY_DTYPES",
    "apply_rotary_pos_emb",
    "check_rotary_args",
    "rotary_fwd_op",
    "rotary_bwd_op",
    "rotate_half",
    "torch_apply_rotary_pos_emb",
    "torch_rotary_backward",
    "rotary_kernel",
]
