"""``sparsefuse::jumprelu_encode``: the fused encode as a custom op, and ``sparsefuse::jumprelu_ell_decode``: the
gather product of its ELL, whose overflowed tokens are recomputed from the encoder's inputs (inference only: no
autograd is registered, a sparse format is not a differentiable output; differentiate through the dense encode, as
:class:`sparsefuse.nn.SparseJumpReLUSAE` does when gradients are needed). As ops, torch.compile sees both as calls
(the launches inside them are not traced)."""

from __future__ import annotations

import torch

from ... import _backend
from ..._backend import Backend, backend_for, on_tensor_device
from ...sparse import ELL, sparse_matmul
from ..encoder import JumpReLUEncoder
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


def jumprelu_ell_decode(
    values: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    W_dec: torch.Tensor,
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    threshold: torch.Tensor,
    b_dec: torch.Tensor | None,
) -> torch.Tensor:
    """``acts @ W_dec`` [M, d_model] for the fused encode's ELL (values/indices [M, width], counts [M]) of x [M, d_in]
    (its tokens past the width recomputed from x, W_enc, b_enc, threshold and b_dec on the device). The op's body,
    also called directly for a plain eager call."""
    ell = ELL(values, indices, counts, W_enc.shape[1])
    return sparse_matmul(ell, W_dec, encoder=JumpReLUEncoder(x, W_enc, b_enc, threshold, b_dec))


# the op runs the body itself (on the tensors' GPU): one signature, the schema inferred from it
jumprelu_ell_decode_op = torch.library.custom_op("sparsefuse::jumprelu_ell_decode", mutates_args=())(
    on_tensor_device(jumprelu_ell_decode)
)


@jumprelu_ell_decode_op.register_fake
def _(values, indices, counts, W_dec, x, W_enc, b_enc, threshold, b_dec):
    return values.new_empty((values.shape[0], W_dec.shape[1]), dtype=torch.promote_types(values.dtype, W_dec.dtype))
