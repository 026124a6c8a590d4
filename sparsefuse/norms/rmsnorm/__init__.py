"""RMSNorm (transformers' ``LlamaRMSNorm`` computation) in one Triton kernel forward and one backward.

:mod:`.reference` holds the plain-torch ground truth, :mod:`.kernels` the Triton kernels, :mod:`.launch` their
launchers (and the cost model), :mod:`.op` the torch.library ops and :mod:`.functional` the public
:func:`rms_norm`."""

from .functional import RMS_NORM_DTYPES, rms_norm
from .kernels import rms_norm_bwd_kernel, rms_norm_fwd_kernel
from .op import rms_norm_bwd_op, rms_norm_fwd_op
from .reference import torch_rms_norm, torch_rms_norm_backward

__all__ = [
    "RMS_NORM_DTYPES",
    "rms_norm",
    "rms_norm_fwd_op",
    "rms_norm_bwd_op",
    "torch_rms_norm",
    "torch_rms_norm_backward",
    "rms_norm_fwd_kernel",
    "rms_norm_bwd_kernel",
]
