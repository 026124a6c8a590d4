"""Probe: variants of the gated FFN block path's two products (issue 5) at the headline shape (M=8192, K=2048,
N=5632, bf16, ~30 heavy-tailed non-zeros per token), each checked against the library kernel's output.

Nsight Compute on the library kernels (scripts/probe_block_ncu.py, 64-row blocks in token order) found both
products latency-bound rather than at a bandwidth ceiling: 25% occupancy (2 CTAs of 8 warps per SM), about a third
of the stall cycles on long scoreboard (global loads not covered by the cp.async pipeline), L2 at 43-60% of its
throughput. Candidate causes, one knob each:

* up (``block_sddmm``): every program first rebuilds its slice of the block's compacted column list from the
  per-tile unions (a chain of dependent loads before its first MMA), and gathers its ``relu(pre)`` scale only
  after the main loop. Variant: read a list compacted once per block, and issue the scale gather before the loop.
* down (``block_sparse_matmul``): the column indices of step j are loaded in step j, so the weight-row gather
  that depends on them waits an L2 round trip. Variant: load the next step's indices one step ahead.
* both: 128-row blocks (double the flops per weight byte, larger unions), and tokens sorted by count.

Usage: python scripts/probe_block_variants.py"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sparse import compact, sddmm, spmm


@triton.jit
def sddmm_listed_kernel(scale_ptr, cols_ptr, count_ptr, order_ptr, a_ptr, b_ptr, out_ptr, M, D, width,
                        stride_scale, stride_a, stride_b, BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_D: tl.constexpr, HAS_ORDER: tl.constexpr, EARLY_SCALE: tl.constexpr):
    chunk = tl.program_id(0)
    block = tl.program_id(1)
    total = tl.load(count_ptr + block)
    if chunk * BLOCK_C < total:
        p = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
        p_mask = p < total
        cols = tl.load(cols_ptr + block.to(tl.int64) * width + p, mask=p_mask, other=0)
        slots = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = slots < M
        rows = tl.load(order_ptr + slots, mask=row_mask, other=0) if HAS_ORDER else slots
        mask = row_mask[:, None] & p_mask[None, :]
        scale_ptrs = scale_ptr + rows[:, None].to(tl.int64) * stride_scale + cols[None, :]
        if EARLY_SCALE:
            scale = tl.load(scale_ptrs, mask=mask, other=0.0)
        a_rows_ptr = a_ptr + rows[:, None].to(tl.int64) * stride_a
        b_cols_ptr = b_ptr + cols[None, :].to(tl.int64) * stride_b
        acc = tl.zeros([BLOCK_ROWS, BLOCK_C], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            a = tl.load(a_rows_ptr + d[None, :], mask=row_mask[:, None], other=0.0)
            bt = tl.load(b_cols_ptr + d[:, None], mask=p_mask[None, :], other=0.0)
            acc = tl.dot(a, bt, acc)
        if not EARLY_SCALE:
            scale = tl.load(scale_ptrs, mask=mask, other=0.0)
        s = scale.to(tl.float32)
        s = tl.where((s > 0) | (s != s), s, 0.0)
        out_block_ptr = out_ptr + block.to(tl.int64) * BLOCK_ROWS * width
        tl.store(out_block_ptr + tl.arange(0, BLOCK_ROWS)[:, None] * width + p[None, :],
                 (s * acc).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def spmm_ahead_kernel(values_ptr, indices_ptr, counts_ptr, order_ptr, w_ptr, out_ptr, M, n_out, width, stride_w,
                      stride_out, BLOCK_ROWS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_ORDER: tl.constexpr, AHEAD: tl.constexpr):
    d_block = tl.program_id(0)
    block = tl.program_id(1)
    count = tl.load(counts_ptr + block)
    local_rows = tl.arange(0, BLOCK_ROWS)
    slots = block * BLOCK_ROWS + local_rows
    row_mask = slots < M
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    values_block_ptr = values_ptr + block.to(tl.int64) * BLOCK_ROWS * width + local_rows[:, None] * width
    indices_block_ptr = indices_ptr + block.to(tl.int64) * width
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    j = tl.arange(0, BLOCK_J)
    cols_next = tl.load(indices_block_ptr + j, mask=j < count, other=0)
    for j0 in range(0, count, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_mask = j < count
        if AHEAD:
            cols = cols_next
            cols_next = tl.load(indices_block_ptr + j + BLOCK_J, mask=j + BLOCK_J < count, other=0)
        else:
            cols = tl.load(indices_block_ptr + j, mask=j_mask, other=0)
        a = tl.load(values_block_ptr + j[None, :], mask=row_mask[:, None] & j_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + d[None, :], mask=j_mask[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
    rows = tl.load(order_ptr + slots, mask=row_mask, other=0) if HAS_ORDER else slots
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None])


def compare(out: torch.Tensor, ref: torch.Tensor) -> str:
    """'same' when bit-identical to the library's output, else the largest difference relative to its largest value."""
    if torch.equal(out, ref):
        return "same"
    return f"max diff {float((out.float() - ref.float()).abs().max() / ref.float().abs().max()):.1e} of max |ref|"


def main() -> None:
    torch.manual_seed(0)
    M, K, N, nnz = (int(v) for v in os.environ.get("PROBE_SHAPE", "8192,2048,5632,30").split(","))
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    print(torch.cuda.get_device_name() if dev == "cuda" else dev, torch.__version__, triton.__version__)
    f = synthetic_ffn(K, N, dtype=getattr(torch, os.environ.get("PROBE_DTYPE", "bfloat16")), device=dev)
    x = f.make_input(M, nnz)
    w_down_t = f.w_down.t()
    pre = F.linear(x, f.w_gate)
    us = lambda fn: do_bench(fn, warmup=10, rep=60) * 1e3  # noqa: E731
    for block_rows, sort in [(64, False), (64, True), (128, True)]:
        pattern = compact.dense_to_row_block_pattern(pre, 256, block_rows, relu=True, sort_rows=sort)
        h = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
        y = spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype)
        flops = 2 * block_rows * K * float(pattern.union_sizes().double().sum())
        order = pattern.row_order
        width = h.values.shape[1]
        tag = f"rows {block_rows} {'sorted' if sort else 'token order'} ({flops / (2 * M * K * N):.1%} of dense)"
        t = us(lambda: sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True))
        print(f"{tag} library up   {t:6.1f} us {flops / t / 1e6:4.0f} TFLOP/s", flush=True)
        valid = torch.arange(width, device=dev)[None, :] < h.counts.repeat_interleave(block_rows)[:M, None]
        for block_c, block_d, warps, stages, early in itertools.product([128, 256], [64], [4, 8], [2, 3, 4],
                                                                        [False, True]):
            if block_c * block_rows > 256 * 64 and warps == 4:
                continue
            out = torch.full_like(h.values, float("nan"))

            def up():
                sddmm_listed_kernel[(triton.cdiv(width, block_c), triton.cdiv(M, block_rows))](
                    pre, h.indices, h.counts, order if order is not None else h.counts, x, f.w_up, out, M, K,
                    width, pre.stride(0), x.stride(0), f.w_up.stride(0), BLOCK_ROWS=block_rows, BLOCK_C=block_c,
                    BLOCK_D=block_d, HAS_ORDER=order is not None, EARLY_SCALE=early, num_warps=warps,
                    num_stages=stages)
            try:
                up()
                same = compare(out[valid], h.values[valid])
                t = us(up)
                print(f"{tag} listed up  C={block_c} D={block_d} w={warps} s={stages} early={early:d}: {t:6.1f} us "
                      f"{flops / t / 1e6:4.0f} TFLOP/s {same}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{tag} listed up  C={block_c} w={warps} s={stages}: FAILED {type(e).__name__} {str(e)[:120]}")
        t = us(lambda: spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype))
        print(f"{tag} library down {t:6.1f} us {flops / t / 1e6:4.0f} TFLOP/s", flush=True)
        w = w_down_t  # [N, K], rows contiguous
        for block_j, block_d, warps, stages, ahead in itertools.product([32, 64], [128, 256], [4, 8], [3, 4],
                                                                        [False, True]):
            if block_d * block_rows > 128 * 64 and warps == 4:
                continue
            out = torch.full_like(y, float("nan"))

            def down():
                spmm_ahead_kernel[(triton.cdiv(K, block_d), triton.cdiv(M, block_rows))](
                    h.values, h.indices, h.counts, order if order is not None else h.counts, w, out, M, K, width,
                    w.stride(0), out.stride(0), BLOCK_ROWS=block_rows, BLOCK_J=block_j, BLOCK_D=block_d,
                    HAS_ORDER=order is not None, AHEAD=ahead, num_warps=warps, num_stages=stages)
            try:
                down()
                same = compare(out, y)
                t = us(down)
                print(f"{tag} ahead down J={block_j} D={block_d} w={warps} s={stages} ahead={ahead:d}: {t:6.1f} us "
                      f"{flops / t / 1e6:4.0f} TFLOP/s {same}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{tag} ahead down J={block_j} D={block_d} w={warps} s={stages}: FAILED {type(e).__name__} "
                      f"{str(e)[:120]}")


if __name__ == "__main__":
    main()
