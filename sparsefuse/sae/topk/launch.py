"""Launch of the TopK encode kernel: block shape, column groups, the candidates buffer."""

from __future__ import annotations

import torch

from ... import _backend
from ..._backend import cdiv, new_output, next_power_of_2, record_launch
from ..._triton.dot import ieee_fp32
from ..._validation import unit_last_stride
from .._encoder_tile import sae_input
from .kernels import topk_encode_fwd_kernel

MAX_KERNEL_K = 512  # larger k runs the chunked torch path (the running top-k would not fit in registers)


def _launch_shape(M: int, N: int, k_pad: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, columns per group). GPU blocks keep the tile, its keys and the running
    top-k in registers without spilling on sm_90 (checked with cuobjdump --dump-resource-usage)."""
    if _backend.INTERPRET:
        bm, bn, bk, warps, target_programs = 16, 32, 32, 4, 4
    else:
        bm = 64 if k_pad <= 64 else (32 if k_pad <= 128 else 16)  # the running top-k lives in registers
        bn = 64 if dtype == torch.float32 else 128
        bk, warps, target_programs = 32, 8, 4 * _backend.sm_count(device)
    tiles = cdiv(N, bn)
    groups = max(1, min(tiles, cdiv(target_programs, cdiv(M, bm))))
    # At least 16 k columns per group: fewer would write more candidates than they save, and the first tiles of
    # a group (empty running top-k: every entry is a candidate) are its slowest.
    tiles_per_group = max(cdiv(tiles, groups), cdiv(16 * k_pad, bn))
    return bm, bn, bk, warps, tiles_per_group * bn


def launch_topk_keys(
    x2: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    b_dec: torch.Tensor | None,
    feature_scale: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    """x2 [M, d_in] (M >= 1), W_enc [d_in, d_sae] -> the k best sort keys per token [M, k], sorted decreasing:
    every column group's k best from the kernel, then ``torch.topk`` over the candidates."""
    M, (d_in, d_sae) = x2.shape[0], W_enc.shape
    k_pad = next_power_of_2(k)
    x2 = sae_input(x2, b_dec)
    W = unit_last_stride(W_enc)  # dtype cast per tile in the kernel, not here
    b_enc = unit_last_stride(b_enc)  # read at unit stride
    feature_scale = unit_last_stride(feature_scale) if feature_scale is not None else None
    bm, bn, bk, warps, cols_per_group = _launch_shape(M, d_sae, k_pad, x2.dtype, x2.device)
    groups = cdiv(d_sae, cols_per_group)
    candidates = new_output((M, groups * k), torch.int64, x2.device)  # every element is written
    topk_encode_fwd_kernel[(cdiv(M, bm), groups)](
        x2,
        W,
        b_enc,
        feature_scale if feature_scale is not None else b_enc,
        candidates,
        M,
        d_in,
        d_sae,
        k,
        cols_per_group,
        groups * k,
        x2.stride(0),
        W.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        K_PAD=k_pad,
        HAS_SCALE=feature_scale is not None,
        IEEE_FP32=ieee_fp32(x2.dtype),
        num_warps=warps,
    )
    record_launch("topk_encode_fwd_kernel")
    return candidates.topk(k, dim=1).values  # sorted, decreasing
