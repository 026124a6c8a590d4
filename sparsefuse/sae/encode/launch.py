"""Launch of the fused JumpReLU encode: allocate the ELL, launch, put each row's entries in feature order."""

from __future__ import annotations

import torch
import triton

from ..._backend import cdiv, next_power_of_2, record_launch
from ..._triton.dot import ieee_fp32
from ..._validation import unit_last_stride
from .._encoder_tile import sae_input
from .kernels import jumprelu_encode_kernel

# From Triton 3.9 the slot claim of a tile from a tensor-core product (16-bit, or fp32 with TF32 allowed) is made on
# the flattened tile: the 2-D atomic over it aborts that compiler's layout-conversion pass. Earlier Tritons compile
# the 2-D claim (the form the sae_forward benchmarks measured); fp32's IEEE product keeps it everywhere.
FLATTENS_TENSOR_CORE_CLAIM = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9)


def launch_jumprelu_encode(
    x2: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    threshold: torch.Tensor,
    b_dec: torch.Tensor | None,
    max_l0: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2 [M, d_in], W_enc [d_in, d_sae] -> ELL (values [M, max_l0] in x's dtype, indices [M, max_l0] int32,
    counts [M] int32: the true totals)."""
    M, (d_in, d_sae) = x2.shape[0], W_enc.shape
    values = torch.zeros(M, max_l0, dtype=x2.dtype, device=x2.device)
    indices = torch.zeros(M, max_l0, dtype=torch.int32, device=x2.device)
    counts = torch.zeros(M, dtype=torch.int32, device=x2.device)
    if M and d_sae:
        x2 = sae_input(x2, b_dec)
        W = unit_last_stride(W_enc)  # dtype cast per tile in the kernel, not here
        b_enc, threshold = unit_last_stride(b_enc), unit_last_stride(threshold)  # read at unit stride
        ieee = ieee_fp32(x2.dtype)
        grid = lambda meta: (cdiv(M, meta["BLOCK_M"]), cdiv(d_sae, meta["BLOCK_N"]))  # noqa: E731
        jumprelu_encode_kernel[grid](
            x2,
            W,
            b_enc,
            threshold,
            values,
            indices,
            counts,
            M,
            d_in,
            d_sae,
            max_l0,
            x2.stride(0),
            W.stride(0),
            min(next_power_of_2(M), 8192),
            IEEE_FP32=ieee,
            FLAT_CLAIM=FLATTENS_TENSOR_CORE_CLAIM and not ieee,
        )
        record_launch("jumprelu_encode_kernel")
        values, indices = _in_feature_order(values, indices, counts, d_sae)
    return values, indices, counts


def _in_feature_order(
    values: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor, d_sae: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's stored entries sorted by feature id (slots past the count: index 0, value 0). Fired entries claim
    slots in whatever order the GPU runs them; sorting (~3% of the fused forward at Gemma Scope 2B) makes the ELL,
    and the decode's summation order, the same on every run."""
    stored = torch.arange(values.shape[1], device=values.device)[None, :] < counts[:, None]
    keys, order = torch.where(stored, indices, d_sae).sort(dim=1)
    stored_sorted = keys < d_sae
    return torch.where(stored_sorted, values.gather(1, order), 0), torch.where(stored_sorted, keys, 0)
