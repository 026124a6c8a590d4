"""CELU with scale and input_scale, out-of-place and in-place, forward and backward.

:mod:`.reference` holds the plain-torch ground truth, :mod:`.kernels` the Triton kernels, :mod:`.launch` their
launchers (and the cost model), :mod:`.op` the torch.library ops and :mod:`.functional` the public :func:`celu` and
:func:`celu_`.
"""

from ..._validation import CELU_DTYPES
from .functional import celu, celu_
from .kernels import celu_bwd_kernel, celu_fwd_kernel
from .op import celu_backward_op, celu_inplace_op, celu_op
from .reference import torch_celu, torch_celu_backward

__all__ = [
    "CELU_DTYPES",
    "celu",
    "celu_",
    "celu_op",
    "celu_inplace_op",
    "celu_backward_op",
    "torch_celu",
    "torch_celu_backward",
    "celu_fwd_kernel",
    "celu_bwd_kernel",
]
