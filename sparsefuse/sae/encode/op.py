"""``sparsefuse::jumprelu_encode``: the fused encode as a custom op (inference only: no autograd is registered, a
sparse format is not a differentiable output; differentiate through the dense encode, as
:class:`sparsefuse.nn.SparseJumpReLUSAE` does when gradients are needed)."""

from __future__ import annotations

import torch

from ... import _backend
from ..._backend import Backend, backend_for, on_tensor_device
from ...sparse import ELL
from .launch import launch_jumprelu_encode
from .reference import torch_jumprelu_encode


def _encode(
    x2: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    threshold: torch.Tensor,
    b_dec: torch.Tensor | None,
    max_l0: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("jumprelu_encode")
        ell = ELL.from_dense(torch_jumprelu_encode(x2, W_enc, b_enc, threshold, b_dec).to(x2.dtype), max_l0)
        return ell.values, ell.indices, ell.counts
    return launch_jumprelu_encode(x2, W_enc, b_enc, threshold, b_dec, max_l0)


@torch.library.custom_op("sparsefuse::jumprelu_encode", mutates_args=())
@on_tensor_device
def jumprelu_encode_op(
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    threshold: torch.Tensor,
    b_dec: torch.Tensor | None,
    max_l0: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _encode(x, W_enc, b_enc, threshold, b_dec, max_l0)


@jumprelu_encode_op.register_fake
def _(x, W_enc, b_enc, threshold, b_dec, max_l0):
    M = x.shape[0]
    return (x.new_empty((M, max_l0)), x.new_empty((M, max_l0), dtype=torch.int32), x.new_empty((M,), dtype=torch.int32))
