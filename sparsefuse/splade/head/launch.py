"""Launchers of the SPLADE head: configs, allocation, grids and launches of :mod:`.kernels` and
:mod:`.sum_kernels`, and the max-pooling backward through the shared sparse core. Nothing here checks arguments
(:mod:`.functional` did) or picks a backend (:mod:`.op` did): the inputs are valid and the kernels run (compiled or
interpreted).

Forward tuning: a fixed rule (:func:`_fwd_config`), no autotuning. Measured on an H200 (Triton 3.6, torch 2.11),
bf16 max pooling at B=32, S=256, H=768, V=30522, inference / with SAVE_AUX:

* TMA + persistent, BLOCK_M x BLOCK_N x BLOCK_K = 128x256x64, 8 warps, 3 stages: 628 us (88% of the measured
  matmul rate) / 778 us;
* the same without TMA (pointer loads): 702 / 831 us;
* one tile per program, pointer loads, 128x128x64, 4 warps, 3 stages: 655 / 729 us (best with SAVE_AUX);
* for comparison, a program per (b, vocabulary tile) walking the sequence (autotuned; picked 128x128 w4 s3):
  875 / 990 us; at B=64, S=512 3442 / 3753 us against 2433 / 3038 us for TMA + persistent 128x256, and at
  V=250002 7410 / 8179 us against 5505 / 6429 us.

Hence the rule: on Hopper (capability 9.x), 16-bit inputs whose layout TMA accepts (16-byte aligned bases and row
strides, hidden's rows equally spaced), inference (sum pooling too, which saves nothing; not measured) runs TMA +
persistent 128x256x64 w8 s3; with SAVE_AUX, and for 16-bit inputs elsewhere, one tile per program with pointer
loads, 128x128x64 w4 s3 (2 stages where a block gets < 128 KiB of shared memory). BLOCK_M is 64 when S <= 64 (short
queries). fp32 uses 64x128x32 w4 s3 with pointer loads. The S <= 64, fp32 and non-Hopper choices are reasonable
defaults, not measurements. Under the interpreter the same rule runs with 16x32x16 tiles (and 4 persistent
programs), so the CPU tests cover both the TMA + persistent and the pointer-load paths.

TMA loads need ``triton.set_allocator`` (device-side tensor descriptors take global scratch): it is set only before
a TMA launch and only when no allocator is set yet, to one that allocates with torch on the current device and
stream, so it works under CUDA graph capture.

Backward, max pooling: only the argmax position of each (b, v) receives a gradient. When gradients are needed the
forward also stores ``argmax`` [B, V] (int32; first position on ties, like ``torch.max``) and the derivative there,
``slope = c / (1 + m)`` for its logit m and mask value c (0 where m <= 0 or the row is fully masked), fp32 [B, V].
Then with ``dlogit = grad * slope`` (zero entries are skipped everywhere):

* grad_bias[v]   = sum_b dlogit[b, v]                                   (a column sum)
* grad_weight[v] = sum_b dlogit[b, v] * hidden[b, argmax[b, v]]          (ELL, one row per v, width B)
* grad_hidden[b, s] = sum_{v: argmax[b, v] = s} dlogit[b, v] * weight[v] (CSR, one row per (b, s))

Both sparse products are the shared gather-accumulate kernel (:func:`sparsefuse.sparse.sparse_matmul`). The
CSR of grad_hidden is built on the device without a host sync: a stable sort of the (b, argmax) keys and a
``searchsorted`` for the row offsets; its arrays are sized B*V (the upper bound), so no count is needed first.
Sum pooling recomputes the logits in two kernels (:mod:`.sum_kernels`).

Determinism: the backward uses no float atomics anywhere (integer-only sort/compaction, fixed-order reductions), so
results are bitwise reproducible run to run; this is the only mode and needs no flag. (A scatter-add of
``dlogit * weight[v]`` into grad_hidden would read each weight row once instead of once per batch row, at the price
of B*V*H float atomics and run-to-run variation; it is not implemented.)
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch
import triton
import triton.language as tl

from ... import _backend
from ..._backend import cdiv, new_output, record_launch, tuning_configs
from ..._plan.config import KnobGroup, current, register_knobs
from ..._triton.dot import ieee_fp32
from ..._validation import unit_last_stride
from ...sparse import CSR, ELL, dense_to_ell, sparse_matmul
from .kernels import splade_fwd_combine_kernel, splade_fwd_kernel
from .sum_kernels import splade_sum_bwd_hidden_kernel, splade_sum_bwd_weight_kernel

__all__ = ["launch_splade_forward", "launch_splade_backward"]

_L2_BUDGET_BYTES = 16 << 20  # hidden states of one program group that should stay in L2 together
_TMA_API = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
_INTERPRET_PROGRAMS = 4  # "SMs" of a persistent grid under the interpreter (several tiles per program)


# --- layout -------------------------------------------------------------------------------------------------------


def _kernel_layout(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """hidden/weight with unit last strides (other strides are passed to the kernels), bias contiguous; a copy
    only where the layout differs."""
    return unit_last_stride(hidden), unit_last_stride(weight), bias.contiguous() if bias is not None else None


def _mask_scales(mask: torch.Tensor | None) -> bool:
    """Whether the mask may weigh kept positions by values other than 1 (kernels.py: MASK_SCALES). Read from the
    dtype, never the values (that would cost a host sync): a bool mask is 0/1, any other dtype may not be."""
    return mask is not None and mask.dtype != torch.bool


def _mask_for_kernel(mask: torch.Tensor | None) -> torch.Tensor | None:
    # bool is read through a zero-copy uint8 view (one byte per element either way)
    return mask.view(torch.uint8) if mask is not None and mask.dtype == torch.bool else mask


def _mask_strides(kmask: torch.Tensor | None) -> tuple[int, int]:
    return (kmask.stride(0), kmask.stride(1)) if kmask is not None else (0, 0)


# --- forward config -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Tile shape and schedule of splade_fwd_kernel (chosen by :func:`_fwd_config`)."""

    block_m: int  # sequence positions of one batch row per tile
    block_n: int  # vocabulary columns per tile
    block_k: int  # hidden (reduction) slice per step
    num_warps: int
    num_stages: int
    persistent: bool = False  # one program per SM, the tile loop flattened with the K loop
    tma: bool = False  # tensor-descriptor (TMA) loads instead of pointer loads


@functools.cache
def _device_info(index: int) -> tuple[int, int, int]:
    """(compute capability major, SM count, opt-in shared memory per block in bytes) of a CUDA device."""
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0)
    if not smem:  # torch without this property: the datacenter parts have >= 164 KiB, the others ~100 KiB
        smem = 164 << 10 if p.major in (9, 10) or (p.major, p.minor) == (8, 0) else 99 << 10
    return p.major, p.multi_processor_count, smem


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _tma_eligible(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA loads are possible for this call: Triton has device-side tensor descriptors, the GPU is a Hopper (or the
    interpreter runs), the inputs are 16-bit, the bases and row strides are 16-byte aligned, and hidden's rows are
    equally spaced so that it can be described as one [B*S, H] matrix."""
    if not _TMA_API or hidden.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not _backend.INTERPRET and not (hidden.is_cuda and _device_info(_cuda_index(hidden.device))[0] == 9):
        return False
    B, S, H = hidden.shape
    size = hidden.element_size()
    return (
        H * size >= 16
        and B * S < 2**31
        and hidden.stride(2) == 1
        and weight.stride(1) == 1
        and (B == 1 or hidden.stride(0) == S * hidden.stride(1))
        and all(
            x % 16 == 0
            for x in (hidden.data_ptr(), weight.data_ptr(), hidden.stride(1) * size, weight.stride(0) * size)
        )
    )


@dataclasses.dataclass(frozen=True)
class SpladeKnobs(KnobGroup):
    """The SPLADE head's forward schedule (registered as ``"splade"``; read at each launch). ``fwd_config``: a
    :class:`FwdConfig` in place of the rule of :func:`_fwd_config` (tests run every schedule and load path at
    small tiles); TMA loads need inputs the rule would accept (:func:`_tma_eligible`)."""

    fwd_config: FwdConfig | None = None


register_knobs("splade", SpladeKnobs())


def _fwd_config(hidden: torch.Tensor, weight: torch.Tensor, save_aux: bool) -> FwdConfig:
    """The forward's config rule (module docstring), unless the knobs give one. Under the interpreter the same rule
    with small tiles, so the CPU tests run the TMA + persistent kernel for inference and the pointer-load kernel
    with SAVE_AUX."""
    forced = current().knobs("splade").fwd_config
    if forced is not None:
        if forced.tma and not _tma_eligible(hidden, weight):
            raise ValueError(f"planning(splade=...): fwd_config {forced} takes TMA loads these inputs cannot take")
        return forced
    tma = not save_aux and _tma_eligible(hidden, weight)
    if _backend.INTERPRET:
        return FwdConfig(16, 32, 16, num_warps=4, num_stages=1, persistent=tma, tma=tma)
    block_m = 64 if hidden.shape[1] <= 64 else 128  # short sequences (queries): half the masked rows
    if tma:  # measured best for inference on an H200
        return FwdConfig(block_m, 256, 64, num_warps=8, num_stages=3, persistent=True, tma=True)
    if hidden.dtype == torch.float32:
        return FwdConfig(64, 128, 32, num_warps=4, num_stages=3)
    big_smem = _device_info(_cuda_index(hidden.device))[2] >= 128 << 10
    return FwdConfig(block_m, 128, 64, num_warps=4, num_stages=3 if big_smem else 2)  # measured best with SAVE_AUX


# --- TMA scratch allocator ----------------------------------------------------------------------------------------


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's global scratch (device-side tensor descriptors) from torch's caching allocator, on the current
    device and stream, i.e. where Triton launches. Stream-ordered like any temporary, and under CUDA graph capture
    it comes from the graph's private pool, so captured launches replay with a valid buffer."""
    del stream  # torch.empty allocates on the current stream, the one Triton launches on
    buffer = torch.empty(size + alignment, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))
    start = -buffer.data_ptr() % alignment  # 0 in practice: torch's blocks are 512-byte aligned
    return buffer[start : start + size]


_allocator_fallback = threading.local()


def _ensure_tma_allocator() -> None:
    """Installs :func:`_torch_scratch` with ``triton.set_allocator`` unless an allocator is already set. Called
    only before TMA launches. Triton keeps the allocator in a ContextVar, so this sets it once per thread/context
    and never replaces one that the application installed."""
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator
        current = current.get() if hasattr(current, "get") else current  # a ContextVar, or a module global
        missing = isinstance(current, _allocation.NullAllocator)
    except (ImportError, AttributeError):  # Triton's private layout differs: set ours once per thread
        missing = not getattr(_allocator_fallback, "done", False)
        _allocator_fallback.done = True
    if missing:
        triton.set_allocator(_torch_scratch)


# --- forward ------------------------------------------------------------------------------------------------------


def launch_splade_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    pooling: str,
    save_aux: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B, S, H], weight [V, H], bias [V] | None, mask [B, S] | None -> (out [B, V] in hidden's dtype,
    argmax [B, V] int32, slope [B, V] fp32); argmax/slope are empty unless max pooling with save_aux."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    keep_aux = save_aux and pooling == "max"
    out = new_output((B, V), hidden.dtype, hidden.device)
    argmax = torch.empty((B, V) if keep_aux else (0,), dtype=torch.int32, device=hidden.device)
    slope = new_output((B, V) if keep_aux else (0,), torch.float32, hidden.device)
    if B == 0 or V == 0:
        return out, argmax, slope
    if S == 0:  # no position contributes: every score is 0 (and no gradient flows)
        out.zero_()
        argmax.zero_()
        slope.zero_()
        return out, argmax, slope
    hidden, weight, bias = _kernel_layout(hidden, weight, bias)
    kmask = _mask_for_kernel(mask)
    cfg = _fwd_config(hidden, weight, keep_aux)
    n_s_tiles = cdiv(S, cfg.block_m)
    single_pass = n_s_tiles == 1
    num_tiles = B * n_s_tiles * cdiv(V, cfg.block_n)
    if cfg.persistent:
        n_sms = _INTERPRET_PROGRAMS if _backend.INTERPRET else _device_info(_cuda_index(hidden.device))[1]
        grid = (min(num_tiles, n_sms),)
    else:
        grid = (num_tiles,)
    if cfg.tma and hidden.is_cuda:
        _ensure_tma_allocator()
    # M tiles whose hidden rows fit in L2 together sweep the vocabulary side by side
    group_m = max(1, min(B * n_s_tiles, _L2_BUDGET_BYTES // (cfg.block_m * max(H, 1) * hidden.element_size())))
    mask_scales = pooling == "max" and _mask_scales(mask)
    part = part_arg = part_slope = out  # placeholders (never read or written)
    if not single_pass:
        part = torch.empty((B * n_s_tiles, V), dtype=torch.float32, device=hidden.device)
        if keep_aux:
            part_arg = torch.empty((B * n_s_tiles, V), dtype=torch.int32, device=hidden.device)
            if mask_scales:  # the derivative at each partial's max (kernels.py: MASK_SCALES)
                part_slope = torch.empty((B * n_s_tiles, V), dtype=torch.float32, device=hidden.device)
    bias_arg = bias if bias is not None else out
    argmax_arg, slope_arg = (argmax, slope) if keep_aux else (out, out)
    args = (
        hidden,
        weight,
        bias_arg,
        kmask if kmask is not None else out,
        out,
        argmax_arg,
        slope_arg,
        part,
        part_arg,
        part_slope,
        B,
        S,
        V,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        *_mask_strides(kmask),
        n_s_tiles,
        group_m,
    )
    constants = dict(
        H=H,
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        HAS_BIAS=bias is not None,
        SAVE_AUX=keep_aux,
        SINGLE_PASS=single_pass,
        IEEE_FP32=ieee_fp32(hidden.dtype),
        NATIVE_NAN_MAX=not _backend.INTERPRET,
        num_stages=cfg.num_stages,
    )
    splade_fwd_kernel[grid](
        *args,
        **constants,
        BLOCK_N=cfg.block_n,
        POOL_MAX=pooling == "max",
        HAS_MASK=kmask is not None,
        MASK_SCALES=1 if mask_scales else 0,
        PERSISTENT=cfg.persistent,
        USE_TMA=cfg.tma,
        num_warps=cfg.num_warps,
    )
    record_launch("splade_fwd_kernel")
    if mask_scales:  # pass 2 (kernels.py): the tiles whose kept positions differ in weight, at a tile that fits
        block_n = min(cfg.block_n, 64)
        splade_fwd_kernel[(B * n_s_tiles * cdiv(V, block_n),)](
            *args,
            **constants,
            BLOCK_N=block_n,
            POOL_MAX=True,
            HAS_MASK=True,
            MASK_SCALES=2,
            PERSISTENT=False,
            USE_TMA=False,
            num_warps=4,
        )
        record_launch("splade_fwd_kernel:weighted_tiles")
    if not single_pass:
        block_v = 128 if _backend.INTERPRET else 1024
        splade_fwd_combine_kernel[(B * cdiv(V, block_v),)](
            part,
            part_arg,
            part_slope,
            bias_arg,
            out,
            argmax_arg,
            slope_arg,
            V,
            n_s_tiles,
            BLOCK_V=block_v,
            POOL_MAX=pooling == "max",
            HAS_BIAS=bias is not None,
            SAVE_AUX=keep_aux,
            MASK_SCALES=mask_scales,
            num_warps=4,
        )
        record_launch("splade_fwd_combine_kernel")
    return out, argmax, slope


# --- backward -----------------------------------------------------------------------------------------------------


def _block_h() -> int:
    return 16 if _backend.INTERPRET else 64


def _tune_buckets(B: int, S: int) -> tuple[int, int]:
    return S.bit_length(), B.bit_length()  # autotune once per power-of-two size class, not per padded length


def _sum_bwd_configs() -> list[triton.Config]:
    return tuning_configs(
        [
            triton.Config({"BLOCK_S": bs, "BLOCK_V": bv, "BLOCK_HO": ho}, num_warps=w, num_stages=st)
            for bs, bv, ho, w, st in [
                (64, 128, 128, 4, 3),
                (64, 64, 256, 8, 3),
                (128, 64, 128, 8, 3),
                (64, 128, 256, 8, 3),
                (32, 128, 128, 4, 4),
            ]
        ],
        interpret_config=triton.Config({"BLOCK_S": 16, "BLOCK_V": 32, "BLOCK_HO": 32}),
    )


_sum_bwd_hidden = triton.autotune(configs=_sum_bwd_configs(), key=["V", "H", "s_bucket", "b_bucket"])(
    splade_sum_bwd_hidden_kernel
)
_sum_bwd_weight = triton.autotune(configs=_sum_bwd_configs(), key=["V", "H", "s_bucket", "b_bucket", "NEED_BIAS"])(
    splade_sum_bwd_weight_kernel
)


def _hidden_grad_pattern(dlogit: torch.Tensor, argmax: torch.Tensor, S: int) -> CSR:
    """CSR [B*S, V] of dlogit [B, V] grouped by the row (b, argmax[b, v]) that produced each max, columns
    ascending. Built on the device without a host sync: a stable sort of the row keys (zero entries get the key B*S
    and sort past every row), then searchsorted for the row offsets. values/indices are sized B*V, the upper
    bound."""
    B, V = dlogit.shape
    n_rows = B * S
    key_dtype = torch.int32 if n_rows < 2**31 - 1 else torch.int64
    base = torch.arange(B, device=dlogit.device, dtype=key_dtype).mul_(S).unsqueeze(1)
    keys = torch.where(dlogit != 0, argmax.to(key_dtype) + base, n_rows).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    rows = torch.arange(n_rows + 1, device=dlogit.device, dtype=key_dtype)
    row_offsets = torch.searchsorted(sorted_keys, rows)  # int64 [B*S + 1]
    return CSR(dlogit.flatten()[order], (order % V).to(torch.int32), row_offsets, V)


def _weight_grad_pattern(dlogit: torch.Tensor, argmax: torch.Tensor, S: int) -> ELL:
    """ELL [V, B*S]: row v holds dlogit[b, v] for every b with a non-zero gradient, pointing at hidden row
    b*S + argmax[b, v]. Width B is the largest possible count, so no row can overflow."""
    B = dlogit.shape[0]
    by_batch = dense_to_ell(dlogit.t(), B)  # column index = b
    hidden_rows = argmax.t() + torch.arange(B, device=argmax.device, dtype=torch.int32).mul_(S).unsqueeze(0)
    indices = torch.gather(hidden_rows, 1, by_batch.indices.long()).to(torch.int32)
    return ELL(by_batch.values, indices, by_batch.counts, B * S)


def _max_backward(grad, hidden, weight, bias, mask, argmax, slope, need_hidden, need_weight, need_bias):
    """Max pooling: the gradient of each (b, v) reaches its argmax row only, as two products of the shared sparse
    core (module docstring)."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    if argmax.numel() != B * V:  # the forward ran without saving them (e.g. the op was called directly)
        _, argmax, slope = launch_splade_forward(hidden, weight, bias, mask, "max", True)
    dlogit = grad.float() * slope  # [B, V]; 0 where the max was <= 0 or the row fully masked
    grad_hidden = grad_weight = grad_bias = None
    if need_hidden:
        pattern = _hidden_grad_pattern(dlogit, argmax, S)
        grad_hidden = sparse_matmul(pattern, weight, out_dtype=hidden.dtype).view(B, S, H)
    if need_weight:
        pattern = _weight_grad_pattern(dlogit, argmax, S)
        grad_weight = sparse_matmul(pattern, hidden.reshape(B * S, H), out_dtype=weight.dtype)
    if need_bias:
        grad_bias = dlogit.sum(dim=0).to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def _sum_backward(grad, hidden, weight, bias, mask, need_hidden, need_weight, need_bias):
    """Sum pooling: the two logit-recomputing kernels (:mod:`.sum_kernels`)."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    kmask = _mask_for_kernel(mask)
    block_h = _block_h()
    s_bucket, b_bucket = _tune_buckets(B, S)
    placeholder = grad
    common = dict(
        BLOCK_H=block_h,
        HAS_BIAS=bias is not None,
        HAS_MASK=kmask is not None,
        EVEN_H=H % block_h == 0,
        IEEE_FP32=ieee_fp32(hidden.dtype),
    )
    strides = (
        grad.stride(0),
        grad.stride(1),
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        *_mask_strides(kmask),
    )
    inputs = (
        grad,
        hidden,
        weight,
        bias if bias is not None else placeholder,
        kmask if kmask is not None else placeholder,
    )
    grad_hidden = grad_weight = grad_bias = None
    if need_hidden:
        grad_hidden = new_output((B, S, H), hidden.dtype, hidden.device)
        _sum_bwd_hidden[lambda meta: (B * cdiv(S, meta["BLOCK_S"]) * cdiv(H, meta["BLOCK_HO"]),)](
            *inputs, grad_hidden, B, S, V, H, *strides, s_bucket, b_bucket, **common
        )
        record_launch("splade_sum_bwd_hidden_kernel")
    if need_weight or need_bias:
        grad_weight = new_output((V, H), weight.dtype, weight.device)
        grad_bias32 = new_output((V,), torch.float32, weight.device) if need_bias else grad_weight
        _sum_bwd_weight[lambda meta: (cdiv(V, meta["BLOCK_V"]) * cdiv(H, meta["BLOCK_HO"]),)](
            *inputs, grad_weight, grad_bias32, B, S, V, H, *strides, s_bucket, b_bucket, NEED_BIAS=need_bias, **common
        )
        record_launch("splade_sum_bwd_weight_kernel")
        grad_bias = grad_bias32.to(bias.dtype) if need_bias else None
        grad_weight = grad_weight if need_weight else None
    return grad_hidden, grad_weight, grad_bias


def launch_splade_backward(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    argmax: torch.Tensor,
    slope: torch.Tensor,
    pooling: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """grad [B, V] -> (grad_hidden [B, S, H] | None, grad_weight [V, H] | None, grad_bias [V] | None); argmax and
    slope [B, V] are the forward's saved aux for max pooling (recomputed when empty). H must be > 0 (the kernels tile
    the hidden dimension); need_bias implies a bias."""
    B, S, _ = hidden.shape
    V = weight.shape[0]
    if B * S * V == 0 or not (need_hidden or need_weight or need_bias):
        return (
            hidden.new_zeros(hidden.shape) if need_hidden else None,
            weight.new_zeros(weight.shape) if need_weight else None,
            bias.new_zeros(bias.shape) if need_bias else None,
        )
    hidden, weight, bias = _kernel_layout(hidden, weight, bias)
    if pooling == "max":
        return _max_backward(grad, hidden, weight, bias, mask, argmax, slope, need_hidden, need_weight, need_bias)
    return _sum_backward(grad, hidden, weight, bias, mask, need_hidden, need_weight, need_bias)
