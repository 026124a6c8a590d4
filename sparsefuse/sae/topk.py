"""TopK SAE encode that never materialises the dense pre-activations.

    pre      = (x - b_dec) @ W_enc + b_enc          x [M, d_in], W_enc [d_in, d_sae]   (then * feature_scale)
    selected = the k largest entries of each row of pre
    top_acts = relu(pre[selected])                   (SAELens ``TopK``: select on the raw pre-activation, then ReLU)

Selection is on the float32 pre-activation (fp32 accumulation). Each (value, feature) pair is packed into one int64
*sort key* -- the float's order-preserving integer image in the high 32 bits and ``0x7FFFFFFF - feature`` in the
low 32 -- so one integer comparison orders by value and breaks exact ties towards the lower feature index, NaN
counts as larger than every number (as in ``torch.topk``), and -0.0 equals +0.0. Results are sorted by decreasing
pre-activation, ties by increasing feature index: deterministic from run to run. SAELens calls
``torch.topk(sorted=False)`` on pre-activations rounded to the SAE dtype, so its order is unspecified and, in
bfloat16/float16, its choice among features whose rounded values tie is arbitrary; ours is the exact top-k of the
float32 values.

Kernel: a program owns BLOCK_M tokens and a group of feature columns. For each [BLOCK_M, BLOCK_N] tile of ``pre``
(``tl.dot``, fp32 accumulation) it merges the tile into a running top-k per token held in registers: only entries
above the token's current k-th best key are candidates, and they are inserted largest first, each replacing the
current minimum, so a tile costs one pass per candidate of its busiest token (after the first tiles, a few).
Every group writes its k best keys; ``torch.topk`` over the [M, groups * k] candidates finishes. Memory:
M * groups * k keys, never M * d_sae.

Autograd: gradients for x, W_enc, b_enc and b_dec (the backward scatters the k gradients into a dense
[M, d_sae] buffer and uses dense matmuls, like the dense encode's backward); ``feature_scale`` gets none.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .. import _backend
from .._backend import Backend, backend_for, compute_dtype, new_output, record_launch
from .._validation import check_float, check_same_device, describe
from .._triton.dot import ieee_fp32
from .encode import encoder_pre_tile, sae_input

_MATMUL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = ("relu", "none")
MAX_KERNEL_K = 512  # larger k runs the chunked torch path (the running top-k would not fit in registers)
TORCH_CHUNK = 4096  # features per step of the chunked torch path

# Sort keys: below every real key (real ones are >= the key of -inf, about -0.996 * 2**63); slot j of an empty
# buffer holds EMPTY_KEY + j so that the slots stay distinct.
EMPTY_KEY = tl.constexpr(-(2**63) + 2**24)
_LOW_MASK = 0x7FFFFFFF
_NAN_ORDERED = 0x7FC00000  # above +inf's image 0x7F800000


# --- sort keys (torch side) ---------------------------------------------------------------------------------------
def _pack_keys(pre: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 pre [M, C], feature ids cols [C] -> int64 keys [M, C] (see module docstring)."""
    bits = torch.where(pre == 0, 0, pre.view(torch.int32))  # -0.0 -> +0.0
    ordered = torch.where(bits < 0, bits ^ _LOW_MASK, bits)
    ordered = torch.where(torch.isnan(pre), _NAN_ORDERED, ordered)
    return (ordered.to(torch.int64) << 32) | (_LOW_MASK - cols.to(torch.int64))


def _unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 keys -> (feature ids int64, float32 values)."""
    ordered = (keys >> 32).to(torch.int32)
    values = torch.where(ordered < 0, ordered ^ _LOW_MASK, ordered).view(torch.float32)
    return _LOW_MASK - (keys & _LOW_MASK), values


# --- reference ----------------------------------------------------------------------------------------------------
def torch_topk_encode(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, k: int, b_dec=None,
                      activation: str = "relu", feature_scale=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """float64 reference: (top_indices int64 [M, k], top_acts float64 [M, k]) sorted by decreasing pre-activation,
    exact ties by increasing feature index, NaN first."""
    sae_in = x.reshape(-1, x.shape[-1]).double()
    if b_dec is not None:
        sae_in = sae_in - b_dec.double()
    pre = sae_in @ W_enc.double() + b_enc.double()
    if feature_scale is not None:
        pre = pre * feature_scale.double()
    pre = torch.where(pre == 0, 0.0, pre)  # -0.0 ties with +0.0
    order = torch.sort(pre, dim=1, descending=True, stable=True).indices[:, :k]
    acts = pre.gather(1, order)
    return order, (acts.relu() if activation == "relu" else acts)


# --- kernel -------------------------------------------------------------------------------------------------------
@triton.jit
def _sort_keys(pre, cols):
    # pre [BLOCK_M, BLOCK_N] fp32, cols [BLOCK_N] -> int64 keys (same mapping as _pack_keys)
    bits = tl.where(pre == 0, 0, pre.to(tl.int32, bitcast=True))
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(pre != pre, 0x7FC00000, ordered)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)[None, :]


@triton.jit
def topk_encode_fwd_kernel(x_ptr, w_ptr, b_enc_ptr, scale_ptr, keys_ptr,
                           M, K, N, k, cols_per_group, n_candidates, stride_xm, stride_wk,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           K_PAD: tl.constexpr, HAS_SCALE: tl.constexpr,
                           IEEE_FP32: tl.constexpr):  # fmt: skip
    # x [M, K] (x - b_dec), w [K, N] (unit column strides), b_enc/scale [N];
    # out: keys [M, n_candidates], this program's k best keys at columns [group * k, group * k + k)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_mask = rows < M
    group = tl.program_id(1)
    col_start = group * cols_per_group
    col_end = tl.minimum(col_start + cols_per_group, N)
    slots = tl.arange(0, K_PAD)
    real_slot = slots < k  # [K_PAD]; slots >= k are padding, kept out of every minimum
    best_keys = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int64) + (slots.to(tl.int64) + EMPTY_KEY)[None, :]
    kth = tl.min(tl.where(real_slot[None, :], best_keys, 0x7FFFFFFFFFFFFFFF), axis=1)  # [BLOCK_M] k-th best key
    for n0 in range(col_start, col_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        col_mask = cols < col_end
        pre = encoder_pre_tile(x_ptr, w_ptr, b_enc_ptr, rows, cols, row_mask, col_mask, K, stride_xm, stride_wk,
                               BLOCK_M, BLOCK_N, BLOCK_K, IEEE_FP32)  # [BLOCK_M, BLOCK_N]  # fmt: skip
        if HAS_SCALE:
            pre = pre * tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        keys = tl.where(row_mask[:, None] & col_mask[None, :], _sort_keys(pre, cols), EMPTY_KEY)
        # Insert the tile's entries that beat the k-th best, largest first (each replaces the current k-th); the
        # busiest token sets the pass count. Entries still to insert are those in (kth, last inserted).
        passes = tl.max(tl.minimum(tl.sum((keys > kth[:, None]).to(tl.int32), axis=1), k))
        below = tl.full([BLOCK_M], 0x7FFFFFFFFFFFFFFF, dtype=tl.int64)  # last key inserted per token
        for _ in range(passes):
            candidate = (keys > kth[:, None]) & (keys < below[:, None])  # [BLOCK_M, BLOCK_N]
            top = tl.max(tl.where(candidate, keys, EMPTY_KEY), axis=1)  # [BLOCK_M]
            replace = (best_keys == kth[:, None]) & (top > kth)[:, None] & real_slot[None, :]
            best_keys = tl.where(replace, top[:, None], best_keys)
            kth = tl.min(tl.where(real_slot[None, :], best_keys, 0x7FFFFFFFFFFFFFFF), axis=1)
            below = top
    dst = rows[:, None].to(tl.int64) * n_candidates + group * k + slots[None, :]
    tl.store(keys_ptr + dst, best_keys, mask=row_mask[:, None] & real_slot[None, :])


# --- launcher -----------------------------------------------------------------------------------------------------
def _launch_shape(M: int, N: int, k_pad: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, columns per group). GPU blocks keep the tile, its keys and the running
    top-k in registers without spilling on sm_90 (checked with cuobjdump --dump-resource-usage)."""
    if _backend.INTERPRET:
        bm, bn, bk, warps, target_programs = 16, 32, 32, 4, 4
    else:
        bm = 64 if k_pad <= 64 else (32 if k_pad <= 128 else 16)  # the running top-k lives in registers
        bn = 64 if dtype == torch.float32 else 128
        bk, warps, target_programs = 32, 8, 4 * _backend.sm_count(device)
    tiles = triton.cdiv(N, bn)
    groups = max(1, min(tiles, triton.cdiv(target_programs, triton.cdiv(M, bm))))
    # At least 16 k columns per group: fewer would write more candidates than they save, and the first tiles of
    # a group (empty running top-k: every entry is a candidate) are its slowest.
    tiles_per_group = max(triton.cdiv(tiles, groups), triton.cdiv(16 * k_pad, bn))
    return bm, bn, bk, warps, tiles_per_group * bn


def _topk_keys_torch(x2, W_enc, b_enc, b_dec, feature_scale, k) -> torch.Tensor:
    """The same selection in plain torch, TORCH_CHUNK features at a time (memory: M * (k + chunk) keys).
    Returns the k best keys per row, sorted decreasing."""
    dtype = compute_dtype(x2.dtype)
    sae_in = sae_input(x2, b_dec).to(dtype)
    best = None
    for f0 in range(0, W_enc.shape[1], TORCH_CHUNK):
        f1 = min(f0 + TORCH_CHUNK, W_enc.shape[1])
        pre = sae_in @ W_enc[:, f0:f1].to(dtype) + b_enc[f0:f1].to(dtype)
        if feature_scale is not None:
            pre = pre * feature_scale[f0:f1].to(dtype)
        keys = _pack_keys(pre, torch.arange(f0, f1, device=x2.device))
        merged = keys if best is None else torch.cat([best, keys], dim=1)
        best = merged.topk(min(k, merged.shape[1]), dim=1).values  # sorted, decreasing
    return best


def _topk_encode(x2: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor | None,
                 feature_scale: torch.Tensor | None, k: int, relu: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    # -> (top_acts [M, k], top_indices [M, k] int64)
    M, (d_in, d_sae) = x2.shape[0], W_enc.shape
    k_pad = triton.next_power_of_2(k)
    if M == 0:
        keys = torch.zeros(0, k, dtype=torch.int64, device=x2.device)
    elif backend_for(x2) is Backend.TORCH or k_pad > MAX_KERNEL_K:
        if backend_for(x2) is Backend.TORCH:
            _backend.warn_reference_once("topk_encode")
        keys = _topk_keys_torch(x2, W_enc, b_enc, b_dec, feature_scale, k)
    else:
        x2 = sae_input(x2, b_dec)
        W = W_enc if W_enc.stride(-1) == 1 else W_enc.contiguous()  # dtype cast per tile in the kernel, not here
        bm, bn, bk, warps, cols_per_group = _launch_shape(M, d_sae, k_pad, x2.dtype, x2.device)
        groups = triton.cdiv(d_sae, cols_per_group)
        candidates = new_output((M, groups * k), torch.int64, x2.device)  # every element is written
        topk_encode_fwd_kernel[(triton.cdiv(M, bm), groups)](
            x2, W, b_enc, feature_scale if feature_scale is not None else b_enc,
            candidates, M, d_in, d_sae, k, cols_per_group, groups * k, x2.stride(0), W.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_PAD=k_pad, HAS_SCALE=feature_scale is not None,
            IEEE_FP32=ieee_fp32(x2.dtype), num_warps=warps,
        )  # fmt: skip
        record_launch("topk_encode_fwd_kernel")
        keys = candidates.topk(k, dim=1).values  # sorted, decreasing
    indices, values = _unpack_keys(keys)
    return (values.relu() if relu else values).to(x2.dtype), indices


# --- op registration ----------------------------------------------------------------------------------------------
# The op returns (top_acts, top_indices): the differentiable output first (opcheck's autograd test sums the outputs
# into the first one's dtype); the functional API returns them the other way round, like torch.topk's pair.
@torch.library.custom_op("sparsefuse::topk_encode", mutates_args=())
def topk_encode_op(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor | None,
                   feature_scale: torch.Tensor | None, k: int, relu: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _topk_encode(x, W_enc, b_enc, b_dec, feature_scale, k, relu)


@topk_encode_op.register_fake
def _(x, W_enc, b_enc, b_dec, feature_scale, k, relu):
    M = x.shape[0]
    return x.new_empty((M, k)), x.new_empty((M, k), dtype=torch.int64)


def _topk_setup(ctx, inputs, output) -> None:
    x, W_enc, b_enc, b_dec, feature_scale, k, relu = inputs
    acts, indices = output
    ctx.relu = relu
    ctx.mark_non_differentiable(indices)
    ctx.save_for_backward(x, W_enc, b_enc, b_dec, feature_scale, indices, acts)


def _topk_backward(ctx, grad_acts, grad_indices):
    x, W_enc, b_enc, b_dec, feature_scale, indices, acts = ctx.saved_tensors
    need_x, need_w, need_b_enc, need_b_dec = ctx.needs_input_grad[:4]
    dtype = compute_dtype(x.dtype)
    grad_pre = grad_acts.to(dtype)
    if ctx.relu:
        grad_pre = grad_pre * (acts > 0)
    if feature_scale is not None:
        grad_pre = grad_pre * feature_scale.to(dtype)[indices]
    # Selected features are distinct within a row, so a scatter (not an add) places each gradient.
    dense = grad_pre.new_zeros(x.shape[0], W_enc.shape[1]).scatter_(1, indices, grad_pre)  # [M, d_sae]
    grad_x = grad_w = grad_b_enc = grad_b_dec = None
    if need_x or need_b_dec:
        grad_sae_in = dense @ W_enc.to(dtype).t()
        grad_x = grad_sae_in.to(x.dtype) if need_x else None
        grad_b_dec = (-grad_sae_in.sum(0)).to(b_dec.dtype) if need_b_dec else None
    if need_w:
        sae_in = x if b_dec is None else (x.to(dtype) - b_dec.to(dtype)).to(x.dtype)
        grad_w = (sae_in.to(dtype).t() @ dense).to(W_enc.dtype)
    if need_b_enc:
        grad_b_enc = dense.sum(0).to(b_enc.dtype)
    return grad_x, grad_w, grad_b_enc, grad_b_dec, None, None, None


topk_encode_op.register_autograd(_topk_backward, setup_context=_topk_setup)


# --- functional API -----------------------------------------------------------------------------------------------
def topk_encode(x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, k: int, *,
                b_dec: torch.Tensor | None = None, activation: str = "relu",
                feature_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """TopK SAE encode without the dense pre-activations (SAELens ``TopKSAE.encode`` semantics).

    Args:
        x: [..., d_in], float32/float16/bfloat16.
        W_enc: [d_in, d_sae] (cast to x's dtype tile by tile); b_enc: [d_sae].
        k: features kept per token, 1 <= k <= d_sae.
        b_dec: [d_in], subtracted from x first (SAELens ``apply_b_dec_to_input``); the difference is rounded to
            x's dtype as SAELens does.
        activation: "relu" (SAELens ``TopK``: ReLU after the selection) or "none" (raw pre-activations).
        feature_scale: optional [d_sae] multiplier of the pre-activations before the selection (SAELens
            ``rescale_acts_by_decoder_norm``: ``W_dec.norm(dim=-1)``); not differentiated.
    Returns:
        (top_indices int64 [..., k], top_acts [..., k] in x's dtype), sorted by decreasing pre-activation, exact
        ties by increasing feature index (see module docstring for NaN and rounding).
    """
    op = "topk_encode"
    for name, t in (("x", x), ("W_enc", W_enc), ("b_enc", b_enc)):
        check_float(op, name, t, _MATMUL_DTYPES)
    check_same_device(op, x=x, W_enc=W_enc, b_enc=b_enc)
    d_in, d_sae = W_enc.shape if W_enc.dim() == 2 else (-1, -1)
    if W_enc.dim() != 2 or x.dim() < 1 or x.shape[-1] != d_in or b_enc.shape != (d_sae,):
        raise ValueError(f"{op}: expected x [..., d_in], W_enc [d_in, d_sae] and b_enc [d_sae]; got x {describe(x)}, "
                         f"W_enc {describe(W_enc)}, b_enc {describe(b_enc)}")  # fmt: skip
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= d_sae:
        raise ValueError(f"{op}: k must be an int in [1, d_sae={d_sae}]; got {k!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    for name, t, size in (("b_dec", b_dec, d_in), ("feature_scale", feature_scale, d_sae)):
        if t is not None:
            check_float(op, name, t, _MATMUL_DTYPES)
            check_same_device(op, x=x, **{name: t})
            if t.shape != (size,):
                raise ValueError(f"{op}: {name} must have shape [{size}]; got {describe(t)}")
    if feature_scale is not None and feature_scale.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: feature_scale is not differentiated; pass feature_scale.detach()")
    acts, indices = topk_encode_op(x.reshape(-1, d_in), W_enc, b_enc, b_dec, feature_scale, k, activation == "relu")
    batch = x.shape[:-1]
    return indices.reshape(*batch, k), acts.reshape(*batch, k)
