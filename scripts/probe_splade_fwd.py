"""Probe: faster designs for the fused SPLADE max-pooling forward (splade_fwd_kernel in sparsefuse/splade/head.py).

Times, at B=32 S=256 H=768 V=30522 bf16 (then B=64 S=512 and V=250002 while the time budget lasts):

* ``current``      sparsefuse.splade_pool (splade_fwd_kernel with its config rule), inference and with requires_grad inputs
                   (SAVE_AUX: argmax + slope), and the autotuner's chosen config;
  (the kernel this probe first compared against -- a program per (batch row, vocabulary tile) walking the
  sequence -- was replaced by the gemm design below; its ``old:*`` variants went with it, their times are in
  benchmarks/results/probe-splade-fwd-NVIDIA-H200.log)
* ``gemm:*``       a GEMM-shaped kernel over the flattened [B*S, H] x [H, V] whose tiles never cross a batch row
                   (BLOCK_M rows of one batch row; rows past S are masked), with grouped program order (all M tiles
                   whose hidden rows fit in 16 MiB of L2 sweep a vocabulary tile together), epilogue = per-column max
                   (+ first argmax) of the tile written as partials [B, cdiv(S, BM), V], then a tiny combine kernel;
                   when BM >= S the epilogue writes out/argmax/slope directly (single pass). Knobs:
                   ``np``   one program per output tile (skips fully padded tiles),
                   ``p``    persistent (grid = #SMs) with ``tl.range(flatten=True)`` so the pipeline runs across tiles,
                   ``tma``  tl.make_tensor_descriptor (TMA) loads, ``ws`` warp_specialize=True, ``ks`` K loop fully
                   unrolled (tl.static_range over H/BK), ``am1`` (aux only) one-pass (value, index) column argmax
                   ``tl.max(return_indices=True)`` instead of max + "first row equal to the max".

Each variant is checked against sparsefuse.splade.torch_splade_pool on fp32 copies of the inputs (output tolerance
2^-7 |ref| + 1e-3, i.e. twice bf16 rounding) and, with aux, that the stored argmax points at a maximal logit and the
slope is 1/(1+max). Times are do_bench medians with an L2 flush between calls (weights are never L2-hot), reported as
us, TFLOP/s (2*B*S*H*V) and % of torch.matmul's bf16 8192^3 rate measured here.

Usage: python3 scripts/probe_splade_fwd.py [--budget 170] [--pad]
       TRITON_INTERPRET=1 python3 scripts/probe_splade_fwd.py --cpu-check   (tiny correctness checks on the CPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl
import triton.testing

import sparsefuse
from sparsefuse.splade import head as _head
from sparsefuse.splade import torch_splade_pool
from sparsefuse._schedule import grouped_tile_coords
from sparsefuse.splade.head import _column_max, _log1p_nonneg

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off")
_L2_BUDGET_BYTES = 16 << 20

# ----------------------------------------------------------------------------------------------------------------
# Kernels (own code; the small jit helpers are the library's, from sparsefuse.splade.head)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _finish(best, best_s, b, v, v_ok, V, bias_ptr, out_ptr, argmax_ptr, slope_ptr, HAS_BIAS: tl.constexpr,
            SAVE_AUX: tl.constexpr):  # fmt: skip
    """best [BN] = max raw logit (no bias) of column v in batch row b -> out, argmax, slope."""
    if HAS_BIAS:
        best = best + tl.load(bias_ptr + tl.minimum(v, V - 1)).to(tl.float32)
    y = _log1p_nonneg(tl.maximum(best, 0.0, propagate_nan=tl.PropagateNan.ALL))
    offs = b.to(tl.int64) * V + v
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=v_ok)
    if SAVE_AUX:
        tl.store(argmax_ptr + offs, best_s, mask=v_ok)
        tl.store(slope_ptr + offs, tl.where(best > 0, 1.0 / (1.0 + best), 0.0), mask=v_ok)


@triton.jit
def gemm_pool_kernel(hidden_ptr, weight_ptr, bias_ptr, mask_ptr, out_ptr, argmax_ptr, slope_ptr, part_max_ptr,
                     part_arg_ptr, B, S, V, stride_hb, stride_hs, stride_wv, stride_mb, stride_ms, NJ, GROUP_M,
                     num_programs, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_AUX: tl.constexpr, SINGLE: tl.constexpr,
                     SKIP_PAD: tl.constexpr, FLATTEN: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
                     K_STATIC: tl.constexpr, ONE_PASS_ARGMAX: tl.constexpr,
                     NATIVE_NAN_MAX: tl.constexpr):  # fmt: skip
    # M tile pid_m = b * NJ + j covers rows s = j*BM .. j*BM+BM-1 of batch row b (s >= S masked); N tile = BN vocab.
    # Each program walks tiles pid, pid + num_programs, ... (num_programs = #tiles: one tile per program).
    K_TILES: tl.constexpr = H // BK
    num_pid_m = B * NJ
    num_pid_n = tl.cdiv(V, BN)
    num_tiles = num_pid_m * num_pid_n
    if USE_TMA:  # hidden must be contiguous [B*S, H]; rows spilling into the next batch row are masked below
        a_desc = tl.make_tensor_descriptor(hidden_ptr, shape=[B * S, H], strides=[H, 1], block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(weight_ptr, shape=[V, H], strides=[stride_wv, 1], block_shape=[BN, BK])
    for tile_id in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = grouped_tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        b = pid_m // NJ
        j = pid_m % NJ
        s = j * BM + tl.arange(0, BM)  # [BM]
        v = pid_n * BN + tl.arange(0, BN)  # [BN]
        v_ok = v < V
        keep = s < S
        if HAS_MASK:
            mk = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + s.to(tl.int64) * stride_ms, mask=keep, other=0)
            keep = keep & (mk != 0)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        run = True
        if SKIP_PAD:
            run = tl.max(keep.to(tl.int32), axis=0) > 0
        if run:
            if USE_TMA:
                row0 = b * S + j * BM
                if K_STATIC:
                    for ki in tl.static_range(K_TILES):
                        a = a_desc.load([row0, ki * BK])
                        w = w_desc.load([pid_n * BN, ki * BK])
                        acc = tl.dot(a, tl.trans(w), acc)
                else:
                    for ki in range(K_TILES):
                        a = a_desc.load([row0, ki * BK])
                        w = w_desc.load([pid_n * BN, ki * BK])
                        acc = tl.dot(a, tl.trans(w), acc)
            else:
                k = tl.arange(0, BK)
                s_load = tl.minimum(s, S - 1)
                v_load = tl.minimum(v, V - 1)
                a_ptrs = hidden_ptr + b.to(tl.int64) * stride_hb + s_load[:, None].to(tl.int64) * stride_hs + k[None, :]
                w_ptrs = weight_ptr + v_load[None, :].to(tl.int64) * stride_wv + k[:, None]  # [BK, BN]
                if K_STATIC:
                    for ki in tl.static_range(K_TILES):
                        acc = tl.dot(tl.load(a_ptrs + ki * BK), tl.load(w_ptrs + ki * BK), acc)
                else:
                    for ki in range(K_TILES):
                        acc = tl.dot(tl.load(a_ptrs + ki * BK), tl.load(w_ptrs + ki * BK), acc)
        logits = tl.where(keep[:, None], acc, float("-inf"))
        if SAVE_AUX and ONE_PASS_ARGMAX:  # (value, index) reduction, first index on ties; NaN not propagated
            best, idx = tl.max(logits, axis=0, return_indices=True, return_indices_tie_break_left=True)
            best_s = tl.minimum(j * BM + idx, S - 1)
        elif SAVE_AUX:  # max (NaN-propagating), then the first row equal to it
            best = _column_max(logits, NATIVE_NAN_MAX)  # [BN]
            best_s = tl.min(tl.where(logits == best[None, :], s[:, None], 2147483647), axis=0)
            best_s = tl.minimum(best_s, S - 1)
        else:
            best = _column_max(logits, NATIVE_NAN_MAX)  # [BN]
            best_s = tl.zeros([BN], dtype=tl.int32)
        if SINGLE:
            _finish(best, best_s, b, v, v_ok, V, bias_ptr, out_ptr, argmax_ptr, slope_ptr, HAS_BIAS, SAVE_AUX)
        else:
            offs = pid_m.to(tl.int64) * V + v
            tl.store(part_max_ptr + offs, best, mask=v_ok)
            if SAVE_AUX:
                tl.store(part_arg_ptr + offs, best_s, mask=v_ok)


@triton.jit
def combine_kernel(part_max_ptr, part_arg_ptr, bias_ptr, out_ptr, argmax_ptr, slope_ptr, V, NJ,
                   BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE_AUX: tl.constexpr):  # fmt: skip
    b = tl.program_id(1)
    v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v_ok = v < V
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_s = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(NJ):
        offs = (b.to(tl.int64) * NJ + j) * V + v
        x = tl.load(part_max_ptr + offs, mask=v_ok, other=float("-inf"))
        better = (x > best) | ((x != x) & (best == best))  # strict: earlier partial wins ties (first argmax)
        best = tl.where(better, x, best)
        if SAVE_AUX:
            best_s = tl.where(better, tl.load(part_arg_ptr + offs, mask=v_ok, other=0), best_s)
    _finish(best, best_s, b, v, v_ok, V, bias_ptr, out_ptr, argmax_ptr, slope_ptr, HAS_BIAS, SAVE_AUX)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------

_SM_COUNT = None


def _sm_count(device) -> int:
    global _SM_COUNT
    if _SM_COUNT is None:
        _SM_COUNT = 4 if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT


_ALLOCATOR_SET = False


def _ensure_allocator():
    """Device-side tensor descriptors need a global scratch allocator."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET and hasattr(triton, "set_allocator"):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    _ALLOCATOR_SET = True


def gemm_pool(hidden, weight, bias, mask, save_aux, cfg):
    """cfg: BM BN BK warps stages [persistent ctas flatten tma ws kstatic group_m]."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    assert H % BK == 0 and weight.stride(1) == 1 and hidden.stride(2) == 1
    tma = cfg.get("tma", False)
    if tma:
        hidden = hidden.contiguous()
        if hidden.is_cuda:
            _ensure_allocator()
    NJ = triton.cdiv(S, BM)
    single = NJ == 1
    dev = hidden.device
    out = torch.empty(B, V, dtype=hidden.dtype, device=dev)
    argmax = torch.empty(B, V, dtype=torch.int32, device=dev) if save_aux else out
    slope = torch.empty(B, V, dtype=torch.float32, device=dev) if save_aux else out
    part_max = out if single else torch.empty(B * NJ, V, dtype=torch.float32, device=dev)
    part_arg = out if single or not save_aux else torch.empty(B * NJ, V, dtype=torch.int32, device=dev)
    num_tiles = B * NJ * triton.cdiv(V, BN)
    persistent = cfg.get("persistent", False)
    n_prog = min(num_tiles, _sm_count(dev) * cfg.get("ctas", 1)) if persistent else num_tiles
    flatten = cfg.get("flatten", persistent)
    group_m = cfg.get("group_m") or max(1, min(B * NJ, _L2_BUDGET_BYTES // (BM * H * hidden.element_size())))
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    gemm_pool_kernel[(n_prog,)](
        hidden, weight, bias if bias is not None else out, mask if mask is not None else out, out, argmax, slope,
        part_max, part_arg, B, S, V, hidden.stride(0), hidden.stride(1), weight.stride(0),
        mask.stride(0) if mask is not None else 0, mask.stride(1) if mask is not None else 0, NJ, group_m, n_prog,
        H=H, BM=BM, BN=BN, BK=BK, HAS_MASK=mask is not None, HAS_BIAS=bias is not None, SAVE_AUX=save_aux,
        SINGLE=single, SKIP_PAD=mask is not None and not flatten, FLATTEN=flatten, USE_TMA=tma,
        WARP_SPEC=cfg.get("ws", False), K_STATIC=cfg.get("kstatic", False),
        ONE_PASS_ARGMAX=cfg.get("am1", False), NATIVE_NAN_MAX=not INTERPRET,
        num_warps=cfg["warps"], num_stages=cfg["stages"],
    )  # fmt: skip
    if not single:
        blk = 1024 if not INTERPRET else 128
        combine_kernel[(triton.cdiv(V, blk), B)](part_max, part_arg, bias if bias is not None else out, out, argmax,
                                                 slope, V, NJ, BLOCK=blk, HAS_BIAS=bias is not None,
                                                 SAVE_AUX=save_aux, num_warps=4)  # fmt: skip
    return (out, argmax, slope) if save_aux else (out, None, None)


def current(hidden, weight, bias, mask, save_aux, cfg=None):
    """The library as a user calls it; with save_aux the inputs require grad (forward only)."""
    if not save_aux:
        with torch.no_grad():
            return sparsefuse.splade_pool(hidden, weight, bias, mask, pooling="max"), None, None
    with torch.enable_grad():
        out = sparsefuse.splade_pool(hidden.detach().requires_grad_(), weight.detach().requires_grad_(), bias, mask,
                                     pooling="max")  # fmt: skip
    return out, None, None


def current_aux(hidden, weight, bias, mask):
    """What the op computes when gradients are needed (for checking argmax/slope)."""
    return _head._splade_forward(hidden, weight, bias, mask, "max", True)


# ----------------------------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------------------------


def _g(name, **cfg):
    return (f"gemm:{name}", gemm_pool, cfg)


def gpu_variants():
    w8 = dict(warps=8)
    # most promising first: the main shape stops adding variants when its share of the time budget is spent
    return [
        _g("np 128x256x64 w8s3", BM=128, BN=256, BK=64, stages=3, **w8),
        _g("tma p 128x256x64 w8s3", BM=128, BN=256, BK=64, stages=3, tma=True, persistent=True, **w8),
        _g("p 128x256x64 w8s3", BM=128, BN=256, BK=64, stages=3, persistent=True, **w8),
        _g("np 128x256x64 w8s3 am1", BM=128, BN=256, BK=64, stages=3, am1=True, **w8),
        _g("tma p 128x256x64 w8s3 am1", BM=128, BN=256, BK=64, stages=3, tma=True, persistent=True, am1=True, **w8),
        _g("tma np 128x256x64 w8s3", BM=128, BN=256, BK=64, stages=3, tma=True, **w8),
        _g("np 256x128x64 w8s3", BM=256, BN=128, BK=64, stages=3, **w8),
        _g("tma p 128x256x64 w8s4", BM=128, BN=256, BK=64, stages=4, tma=True, persistent=True, **w8),
        _g("tma p 128x256x64 w8s3 ws", BM=128, BN=256, BK=64, stages=3, tma=True, persistent=True, ws=True, **w8),
        _g("np 128x128x64 w4s3", BM=128, BN=128, BK=64, warps=4, stages=3),
        _g("p 128x128x64 w4s3 2cta", BM=128, BN=128, BK=64, warps=4, stages=3, persistent=True, ctas=2),
        _g("tma p 128x128x64 w8s4", BM=128, BN=128, BK=64, stages=4, tma=True, persistent=True, **w8),
        _g("tma np 256x128x64 w8s3", BM=256, BN=128, BK=64, stages=3, tma=True, **w8),
        _g("np 128x256x128 w8s2", BM=128, BN=256, BK=128, stages=2, **w8),
        _g("np 128x128x64 w8s4", BM=128, BN=128, BK=64, stages=4, **w8),
        _g("p 128x128x64 w8s4", BM=128, BN=128, BK=64, stages=4, persistent=True, **w8),
        _g("tma p 128x128x64 w4s4 ws", BM=128, BN=128, BK=64, warps=4, stages=4, tma=True, persistent=True,
           ws=True),
        _g("np 128x256x64 w8s3 ks", BM=128, BN=256, BK=64, stages=3, kstatic=True, **w8),
    ]


def cpu_variants():
    return [
        _g("np 16x32x16 (combine)", BM=16, BN=32, BK=16, warps=4, stages=1),
        _g("np 64x32x32 (single, crosses rows)", BM=64, BN=32, BK=32, warps=4, stages=1),
        _g("np 16x64x16 ks", BM=16, BN=64, BK=16, warps=4, stages=1, kstatic=True),
        _g("p 16x32x16 flat", BM=16, BN=32, BK=16, warps=4, stages=1, persistent=True),
        _g("p 16x32x16 am1", BM=16, BN=32, BK=16, warps=4, stages=1, persistent=True, am1=True),
        _g("tma np 16x32x16", BM=16, BN=32, BK=16, warps=4, stages=1, tma=True),
        _g("tma p 64x32x16 ws", BM=64, BN=32, BK=16, warps=4, stages=1, tma=True, persistent=True, ws=True),
        _g("tma p 16x32x32 ks", BM=16, BN=32, BK=32, warps=4, stages=1, tma=True, persistent=True, kstatic=True),
    ]


# ----------------------------------------------------------------------------------------------------------------
# Reference and checks
# ----------------------------------------------------------------------------------------------------------------


def make_inputs(B, S, H, V, dtype, device, pad=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(V, H, generator=g) * 0.05).to(device=device, dtype=dtype)
    bias = (torch.randn(V, generator=g) * 0.1).to(device=device, dtype=dtype)
    mask = torch.ones(B, S, dtype=torch.int64)
    if pad:
        lengths = torch.randint(S // 4, S + 1, (B,), generator=g)
        lengths[0] = S
        mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
        mask[-1, S // 3] = 0  # a hole
    return hidden, weight, bias, mask.to(device)


def reference(hidden, weight, bias, mask):
    """fp32: (out [B, V] from torch_splade_pool, masked max logit incl. bias [B, V]), chunked over batch rows."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    w, bb = weight.float(), bias.float() if bias is not None else None
    rows = max(1, min(B, (1 << 28) // max(1, S * V)))  # ~1 GiB of fp32 logits per chunk
    outs, tops = [], []
    for b0 in range(0, B, rows):
        h = hidden[b0:b0 + rows].float()
        m = mask[b0:b0 + rows] if mask is not None else None
        outs.append(torch_splade_pool(h, w, bb, m, "max"))
        logits = h @ w.t()
        if bb is not None:
            logits += bb
        if m is not None:
            logits.masked_fill_(m.unsqueeze(-1) == 0, float("-inf"))
        tops.append(logits.amax(dim=1))
        del logits
    return torch.cat(outs), torch.cat(tops)


def logit_at(hidden, weight, bias, idx):
    """fp32 logits[b, idx[b, v], v] without materialising [B, S, V]."""
    B, S, H = hidden.shape
    V = weight.shape[0]
    w, res = weight.float(), []
    rows = max(1, min(B, (1 << 28) // max(1, S * V)))
    for b0 in range(0, B, rows):
        logits = hidden[b0:b0 + rows].float() @ w.t()
        res.append(torch.gather(logits, 1, idx[b0:b0 + rows].long().unsqueeze(1)).squeeze(1))
        del logits
    x = torch.cat(res)
    return x + bias.float() if bias is not None else x


def check(result, ref, inputs, save_aux):
    """(max abs err of out, ok, note)."""
    out, argmax, slope = result
    ref_out, ref_top = ref
    d = (out.float() - ref_out).abs()
    err = d.max().item()
    ok = bool((d <= ref_out.abs() * 2.0**-7 + 1e-3).all())
    note = ""
    if save_aux and argmax is not None:
        hidden, weight, bias, mask = inputs
        live = ref_top > 0  # elsewhere the slope is 0 and the argmax carries no gradient
        at = logit_at(hidden, weight, bias, argmax)
        tol = 1e-3 * ref_top.abs().clamp_min(1.0)
        arg_ok = bool(((ref_top - at <= tol) | ~live).all())
        if mask is not None:
            in_mask = torch.gather(mask, 1, argmax.long()) != 0
            arg_ok = arg_ok and bool((in_mask | ~live).all())
        ref_slope = torch.where(live, 1.0 / (1.0 + ref_top.clamp_min(0)), 0.0)
        slope_err = (slope - ref_slope).abs().max().item()
        ok = ok and arg_ok and slope_err <= 1e-3
        note = f"argmax {'ok' if arg_ok else 'BAD'}, slope err {slope_err:.1e}"
    return err, ok, note


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------


def bench(fn, rep_ms=60):
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3  # us


ROWS = []
ALL_AUX = False  # --all-aux


def record(shape, name, aux, err, ok, us, flops, mm_rate, note=""):
    tf = flops / (us * 1e-6) / 1e12 if us else float("nan")
    row = (shape, name, "aux" if aux else "inf", err, ok, us, tf, 100 * tf / mm_rate if mm_rate else float("nan"), note)
    ROWS.append(row)
    print(_fmt(row), flush=True)


def _fmt(r):
    shape, name, aux, err, ok, us, tf, pct, note = r
    e = f"{err:.2e}" if isinstance(err, float) else str(err)
    okay = {True: "OK", False: "FAIL", None: "-"}[ok]
    u = f"{us:9.1f}" if isinstance(us, float) else f"{'-':>9}"
    return f"{shape:<24} {name:<34} {aux:<3} {e:>9} {okay:<4} {u} {tf:7.1f} {pct:6.1f}%  {note}"


def run_variant(shape, name, fn, cfg, inputs, sets, ref, save_aux, flops, mm_rate):
    try:
        res = fn(*inputs, save_aux, cfg)
        if save_aux and fn is current:
            res = current_aux(*inputs)
        err, ok, note = check(res, ref, inputs, save_aux)
        if fn is current:
            best = getattr(_head.splade_fwd_kernel, "best_config", None)
            note = (note + "; " if note else "") + f"best_config: {best}"
        del res
        i = [0]

        def call():
            i[0] += 1
            h, w, b, m = sets[i[0] % len(sets)]
            fn(h, w, b, m, save_aux, cfg)

        us = bench(call)
        record(shape, name, save_aux, err, ok, us, flops, mm_rate, note)
        return us if ok else None
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150] if str(e).strip() else ''}"
        record(shape, name, save_aux, "-", False, None, flops, mm_rate, "ERROR " + msg)
        if os.environ.get("PROBE_TRACEBACK"):
            traceback.print_exc()
        return None


def run_shape(B, S, H, V, variants, mm_rate, pad, deadline, with_aux=True, n_sets=2, device="cuda",
              dtype=torch.bfloat16):
    shape = f"B{B} S{S} H{H} V{V}"
    dev = torch.device(device)
    sets = [make_inputs(B, S, H, V, dtype, dev, pad, seed=k) for k in range(n_sets)]
    inputs = sets[0]
    flops = 2.0 * B * S * H * V
    ref = reference(*inputs)
    print(f"--- {shape} ({flops / 1e9:.0f} GFLOP)", flush=True)
    try:
        h2 = inputs[0].reshape(-1, H)
        us = bench(lambda: torch.matmul(h2, inputs[1].t()))
        record(shape, "cublas logits only (h @ W.T)", False, "-", None, us, flops, mm_rate)
    except Exception as e:  # noqa: BLE001
        print("cublas same shape failed:", e)
    times = {}
    for name, fn, cfg in [("current (autotuned)", current, None)] + variants:
        if time.time() > deadline:
            print(f"  (time budget reached; skipping {name} and later variants)")
            break
        aux_only = bool(cfg and cfg.get("am1"))  # its inference kernel is the variant without am1
        t = None if aux_only else run_variant(shape, name, fn, cfg, inputs, sets, ref, False, flops, mm_rate)
        if t is not None:
            times[name] = t
        # aux (training forward) only where the inference time is within 10% of the current kernel's
        ref_us = times.get("current (autotuned)", float("inf"))
        worth_aux = fn is current or ALL_AUX or aux_only or (t is not None and t <= 1.1 * ref_us)
        if with_aux and worth_aux and time.time() < deadline:
            run_variant(shape, name, fn, cfg, inputs, sets, ref, True, flops, mm_rate)
    del sets, inputs, ref
    torch.cuda.empty_cache()
    return times


def main_gpu(args):
    t0 = time.time()
    deadline = t0 + args.budget
    p = torch.cuda.get_device_properties(0)
    print(f"{torch.cuda.get_device_name()} SMs {p.multi_processor_count} L2 {p.L2_cache_size >> 20} MiB | "
          f"torch {torch.__version__} triton {triton.__version__}", flush=True)  # fmt: skip
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = bench(lambda: torch.matmul(a, b), rep_ms=200)
    mm_rate = 2 * 8192**3 / (mm_us * 1e-6) / 1e12
    del a, b
    print(f"torch.matmul bf16 8192^3: {mm_us:.1f} us = {mm_rate:.0f} TFLOP/s (the % column is relative to this)")
    hdr = f"{'shape':<24} {'variant':<34} {'':<3} {'max_err':>9} {'ok':<4} {'us':>9} {'TFLOP/s':>7} {'%mm':>7}  note"
    print(hdr, flush=True)
    variants = gpu_variants()
    if args.only:
        variants = [v for v in variants if any(o in v[0] for o in args.only.split(","))]
    # the main shape gets ~65% of the budget; the larger shapes get the current kernel + the best few variants
    times = run_shape(32, 256, 768, 30522, variants, mm_rate, args.pad, t0 + 0.65 * args.budget)
    best = sorted((t, n) for n, t in times.items() if not n.startswith("current"))[: args.top]
    chosen = [v for v in variants if v[0] in {n for _, n in best}]
    print("best on the main shape:", ", ".join(f"{n} {t:.0f} us" for t, n in best), flush=True)
    for B, S, V in [(64, 512, 30522), (32, 256, 250002)]:
        if time.time() > deadline - 20:
            print(f"(time budget reached; skipping B{B} S{S} V{V})")
            continue
        try:
            run_shape(B, S, 768, V, chosen, mm_rate, args.pad, deadline)
        except Exception as e:  # noqa: BLE001
            print(f"shape B{B} S{S} V{V} failed: {type(e).__name__}: {e}")
    print(f"\n=== summary ({time.time() - t0:.0f} s; bf16, max pooling, bias + mask"
          f"{' with padding' if args.pad else ' all ones'}) ===")  # fmt: skip
    print(hdr)
    for r in ROWS:
        print(_fmt(r))


def main_cpu_check():
    if not INTERPRET:
        sys.exit("--cpu-check needs TRITON_INTERPRET=1 set before launch")
    dev = torch.device("cpu")
    n_fail = 0
    for dtype in (torch.float16, torch.float32):
        for B, S, H, V, pad, with_bias in [(2, 40, 64, 300, True, True), (3, 33, 32, 97, False, False)]:
            inputs = make_inputs(B, S, H, V, dtype, dev, pad, seed=1)
            if not with_bias:
                inputs = (inputs[0], inputs[1], None, None)
            ref = reference(*inputs)
            shape = f"{str(dtype)[6:]} B{B} S{S} H{H} V{V}{' pad' if pad else ''}{'' if with_bias else ' nobias/mask'}"
            for name, fn, cfg in [("current", current, None)] + cpu_variants():
                for aux in (False, True):
                    try:
                        res = current_aux(*inputs) if (fn is current and aux) else fn(*inputs, aux, cfg)
                        err, ok, note = check(res, ref, inputs, aux)
                    except Exception as e:  # noqa: BLE001
                        err, ok, note = "-", False, f"ERROR {type(e).__name__}: {str(e)[:200]}"
                        traceback.print_exc()
                    n_fail += not ok
                    e = f"{err:.2e}" if isinstance(err, float) else err
                    print(f"{shape:<36} {name:<36} {'aux' if aux else 'inf'} err {e:>9} {'OK' if ok else 'FAIL'} "
                          f"{note}", flush=True)  # fmt: skip
    print(f"cpu check: {n_fail} failure(s)")
    sys.exit(1 if n_fail else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-check", action="store_true", help="tiny correctness checks under TRITON_INTERPRET=1")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for the whole GPU probe (soft)")
    ap.add_argument("--pad", action="store_true", help="random padding in the attention mask (default: all ones)")
    ap.add_argument("--top", type=int, default=3, help="variants carried to the larger shapes")
    ap.add_argument("--all-aux", action="store_true", help="time SAVE_AUX for every variant (default: only those "
                    "within 10%% of the current kernel's inference time)")  # fmt: skip
    ap.add_argument("--only", default="", help="comma-separated substrings: run only matching variants")
    args = ap.parse_args()
    global ALL_AUX
    ALL_AUX = args.all_aux
    if args.cpu_check:
        main_cpu_check()
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --cpu-check with TRITON_INTERPRET=1)")
        main_gpu(args)


if __name__ == "__main__":
    main()
