"""JumpReLU SAE encode that emits the sparse format from the matmul's epilogue.

    pre  = (x - b_dec) @ W_enc + b_enc          x [M, d_in], W_enc [d_in, d_sae]
    acts = relu(pre) * (pre > threshold)          (SAELens JumpReLU; threshold in fp32)

A program computes a [BLOCK_M tokens, BLOCK_N features] tile of ``pre`` with ``tl.dot`` (fp32 accumulation) and,
instead of writing it, keeps the entries that fire: each fired entry claims a slot in its token's ELL row with
one integer atomic and is stored there. ``x - b_dec`` is computed once before the launch. The dense
[M, d_sae] activations never reach memory. Counts are exact totals; a token that fired more than ``max_l0``
features is marked overflowed (``ELL.overflowed()``): decoding it without its dense row yields NaN, never a
silently truncated reconstruction, and ``validate=True`` raises instead. Entries race for slots, so a row is
sorted by feature id after the kernel: the ELL, and what is decoded from it, are the same on every run. (A row that
overflowed keeps the first ``max_l0`` entries to claim a slot, in feature order; it is recomputed, not decoded from
them.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, record_launch
from .._validation import check_float, check_same_device, describe
from .._triton.dot import dot_accumulate, ieee_fp32
from ..sparse import ELL
from ..sparse.spmm import JumpReLUEncoder

_MATMUL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def torch_jumprelu_encode(x, W_enc, b_enc, threshold, b_dec=None) -> torch.Tensor:
    """Dense reference activations [M, d_sae] in float64."""
    return JumpReLUEncoder(x.reshape(-1, x.shape[-1]), W_enc, b_enc, threshold, b_dec).reference_activations()


def sae_input(x2: torch.Tensor, b_dec: torch.Tensor | None) -> torch.Tensor:
    """``x - b_dec`` rounded to x's dtype, as SAELens computes it, with unit column stride: the encoders' A operand.
    Subtracted once here rather than per tile: in the K loop it routed every x tile through registers before
    ``tl.dot`` (1.4x slower at Gemma Scope 2B, scripts/probe_encode.py)."""
    if b_dec is not None:
        x2 = (x2 - b_dec).to(x2.dtype)  # (keeps x's strides)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def encoder_pre_tile(x_ptr, w_ptr, b_enc_ptr, rows, cols, row_mask, col_mask, K, stride_xm, stride_wk,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     IEEE_FP32: tl.constexpr):  # fmt: skip
    """SAE pre-activations ``x @ W + b_enc`` of one [BLOCK_M tokens, BLOCK_N features] tile, fp32 (shared by the
    JumpReLU and TopK encodes; x is already ``x - b_dec``, see :func:`sae_input`)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]  # fmt: skip
        w = tl.load(w_ptr + k[:, None].to(tl.int64) * stride_wk + cols[None, :],
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(x.dtype)  # [BLOCK_K, BLOCK_N]  # fmt: skip
        acc = dot_accumulate(acc, x, w, IEEE_FP32)
    return acc + tl.load(b_enc_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]


def _encode_configs() -> list[triton.Config]:
    shapes = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
              (64, 256, 64, 8, 3), (256, 128, 64, 8, 3), (32, 128, 64, 4, 4)]  # fmt: skip
    return _backend.tuning_configs(
        [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
         for bm, bn, bk, w, st in shapes],
        interpret_config=triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}),
    )  # fmt: skip


# Tuned per (d_in, d_sae, power-of-two token bucket); the slot counters are re-zeroed between trial runs.
@triton.autotune(configs=_encode_configs(), key=["K", "N", "M_BUCKET"], reset_to_zero=["counts_ptr"])
@triton.jit
def jumprelu_encode_kernel(x_ptr, w_ptr, b_enc_ptr, threshold_ptr, values_ptr, indices_ptr, counts_ptr,
                           M, K, N, width, stride_xm, stride_wk, M_BUCKET,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           IEEE_FP32: tl.constexpr):  # fmt: skip
    # x [M, K] (x - b_dec), w [K, N] (unit column strides), b_enc/threshold [N];
    # out: values/indices [M, width], counts [M] int32 (zeroed)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask, col_mask = rows < M, cols < N
    pre = encoder_pre_tile(x_ptr, w_ptr, b_enc_ptr, rows, cols, row_mask, col_mask, K, stride_xm, stride_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, IEEE_FP32)  # fmt: skip
    threshold = tl.load(threshold_ptr + cols, mask=col_mask, other=float("inf")).to(tl.float32)
    fired = (pre > threshold[None, :]) & (pre > 0) & row_mask[:, None] & col_mask[None, :]  # [BLOCK_M, BLOCK_N]
    # One slot claim per fired entry: with few entries firing per tile this beats a per-row count + cumsum (3353 vs
    # 3820 us at Gemma Scope 2B, 4096 tokens; the cumsum over the MMA-layout tile is the costly part) and loses
    # only when half the features fire (6312 vs 3600 us), where every token overflows and is recomputed anyway.
    row_counts = counts_ptr + rows[:, None] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    slot = tl.atomic_add(row_counts, 1, mask=fired, sem="relaxed")  # [BLOCK_M, BLOCK_N] slots claimed
    keep = fired & (slot < width)
    dst = rows[:, None].to(tl.int64) * width + slot
    tl.store(values_ptr + dst, pre.to(values_ptr.dtype.element_ty), mask=keep)
    tl.store(indices_ptr + dst, cols[None, :] + tl.zeros_like(slot), mask=keep)


def _encode(x2: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, threshold: torch.Tensor,
            b_dec: torch.Tensor | None, max_l0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    M, (d_in, d_sae) = x2.shape[0], W_enc.shape
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("jumprelu_encode")
        ell = ELL.from_dense(torch_jumprelu_encode(x2, W_enc, b_enc, threshold, b_dec).to(x2.dtype), max_l0)
        return ell.values, ell.indices, ell.counts
    values = torch.zeros(M, max_l0, dtype=x2.dtype, device=x2.device)
    indices = torch.zeros(M, max_l0, dtype=torch.int32, device=x2.device)
    counts = torch.zeros(M, dtype=torch.int32, device=x2.device)
    if M and d_sae:
        x2 = sae_input(x2, b_dec)
        W = W_enc if W_enc.stride(-1) == 1 else W_enc.contiguous()  # dtype cast per tile in the kernel, not here
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(d_sae, meta["BLOCK_N"]))  # noqa: E731
        jumprelu_encode_kernel[grid](
            x2, W, b_enc, threshold, values, indices, counts,
            M, d_in, d_sae, max_l0, x2.stride(0), W.stride(0), min(triton.next_power_of_2(M), 8192),
            IEEE_FP32=ieee_fp32(x2.dtype),
        )  # fmt: skip
        record_launch("jumprelu_encode_kernel")
        values, indices = _in_feature_order(values, indices, counts, d_sae)
    return values, indices, counts


def _in_feature_order(values: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor,
                      d_sae: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each row's stored entries sorted by feature id (slots past the count: index 0, value 0). Fired entries claim
    slots in whatever order the GPU runs them; sorting (~3% of the fused forward at Gemma Scope 2B) makes the ELL,
    and the decode's summation order, the same on every run."""
    stored = torch.arange(values.shape[1], device=values.device)[None, :] < counts[:, None]
    keys, order = torch.where(stored, indices, d_sae).sort(dim=1)
    stored_sorted = keys < d_sae
    return torch.where(stored_sorted, values.gather(1, order), 0), torch.where(stored_sorted, keys, 0)


# Inference op: no autograd is registered (a sparse format is not a differentiable output); differentiate through
# the dense encode (sparsefuse.nn.SparseJumpReLUSAE does when gradients are needed).
@torch.library.custom_op("sparsefuse::jumprelu_encode", mutates_args=())
def jumprelu_encode_op(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, threshold: torch.Tensor,
                       b_dec: torch.Tensor | None, max_l0: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _encode(x, W_enc, b_enc, threshold, b_dec, max_l0)


@jumprelu_encode_op.register_fake
def _(x, W_enc, b_enc, threshold, b_dec, max_l0):
    M = x.shape[0]
    return (x.new_empty((M, max_l0)), x.new_empty((M, max_l0), dtype=torch.int32),
            x.new_empty((M,), dtype=torch.int32))  # fmt: skip


def jumprelu_encode(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, threshold: torch.Tensor, *,
                    b_dec: torch.Tensor | None = None, max_l0: int = 256, validate: bool = False) -> ELL:  # fmt: skip
    """Fused JumpReLU encode straight into ELL (see module docstring). x [..., d_in] -> ELL of [M, d_sae]."""
    op = "jumprelu_encode"
    for name, t in (("x", x), ("W_enc", W_enc), ("b_enc", b_enc), ("threshold", threshold)):
        check_float(op, name, t, _MATMUL_DTYPES)
    check_same_device(op, x=x, W_enc=W_enc, b_enc=b_enc, threshold=threshold)
    d_in, d_sae = W_enc.shape if W_enc.dim() == 2 else (-1, -1)
    if W_enc.dim() != 2 or x.shape[-1] != d_in or b_enc.shape != (d_sae,) or threshold.shape != (d_sae,):
        raise ValueError(f"{op}: expected x [..., d_in], W_enc [d_in, d_sae], b_enc and threshold [d_sae]; got x "
                         f"{describe(x)}, W_enc {describe(W_enc)}, b_enc {describe(b_enc)}, threshold "
                         f"{describe(threshold)}")  # fmt: skip
    if b_dec is not None and (b_dec.shape != (d_in,) or not b_dec.is_floating_point()):
        raise ValueError(f"{op}: b_dec must be a floating [{d_in}] tensor; got {describe(b_dec)}")
    if not isinstance(max_l0, int) or isinstance(max_l0, bool) or max_l0 <= 0:
        raise ValueError(f"{op}: max_l0 must be a positive int; got {max_l0!r}")
    values, indices, counts = jumprelu_encode_op(x.reshape(-1, d_in), W_enc, b_enc, threshold, b_dec, max_l0)
    ell = ELL(values, indices, counts, d_sae)
    if validate and values.shape[0]:
        largest = int(ell.counts.max())
        if largest > max_l0:
            raise ValueError(f"{op}: a token fired {largest} features but max_l0={max_l0}; raise max_l0")
    return ell
