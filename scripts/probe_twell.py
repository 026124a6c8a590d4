"""Probe: where the TwELL FFN time goes (issue 5), at the paper's 1.5B shape (M=8192, K=2048, N=5632, bf16, ~32
non-zeros per token). Prints one line per variant: median us (triton.testing.do_bench) and what it isolates.

Gate (kernel 1): cuBLAS ``x @ W_gate^T`` vs the repo kernel under explicit configs, and a probe-local copy of the
same mainloop whose epilogue is (1) a dense ReLU store, (2) the counts only, (3) the full TwELL epilogue -- so the
mainloop's own rate and the epilogue's cost are separated.

Up/down (kernel 2): the repo kernel under explicit (BLOCK_NZ, warps, BLOCK_K) on heavy-tailed synthetic sparsity
and on a uniform pattern (exactly the mean per token: no tail, no overflow), in natural and heavy-first token order,
plus probe-local variants. Usage: python scripts/probe_twell.py [--quick]"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from sparsefuse._schedule import grouped_tile_coords
from sparsefuse.ffn import twell as tw
from sparsefuse.ffn.synthetic import gate_statistics, synthetic_ffn
from sparsefuse.sparse import TwELL

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def bench(fn, name, extra=""):
    try:
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, warmup=10, rep=60)
        log(f"{name:<58s} {ms * 1e3:9.1f} us  {extra}")
        return ms * 1e3
    except Exception as e:  # noqa: BLE001
        log(f"{name:<58s} FAILED {type(e).__name__}: {str(e)[:160]}")
        return float("nan")


@triton.jit
def gate_probe_kernel(x_ptr, w_ptr, dense_ptr, values_ptr, indices_ptr, counts_ptr, M, K, N, n_tiles,
                      TILE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    # The repo gate kernel's mainloop (x [M, K], w [N, K] row-major) with MODE: 1 dense relu store, 2 counts only,
    # 3 TwELL epilogue (cumsum ranks), 4 TwELL epilogue without the clear of unused slots.
    pid = tl.program_id(0)
    pid_m, tile = grouped_tile_coords(pid, tl.cdiv(M, BLOCK_M), n_tiles, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * TILE + tl.arange(0, TILE)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, TILE], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + k[None, :], mask=row_mask[:, None], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k[:, None], mask=col_mask[None, :], other=0.0)
        acc += tl.dot(x, w)
    if MODE == 1:
        tl.store(dense_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], tl.maximum(acc, 0.0).to(tl.bfloat16),
                 mask=row_mask[:, None] & col_mask[None, :])  # fmt: skip
    else:
        fired = (acc > 0) & row_mask[:, None] & col_mask[None, :]
        fired_i = fired.to(tl.int32)
        width = n_tiles * SLOTS
        if MODE == 3 or MODE == 4:
            rank = tl.cumsum(fired_i, axis=1) - 1
            row_base = rows.to(tl.int64) * (n_tiles * SLOTS) + tile * SLOTS
            if MODE == 3:
                slot = tl.arange(0, SLOTS)
                clear_ptr = row_base[:, None] + slot[None, :]
                tl.store(values_ptr + clear_ptr, tl.zeros([BLOCK_M, SLOTS], dtype=tl.bfloat16), mask=row_mask[:, None])
                tl.store(indices_ptr + clear_ptr, tl.zeros([BLOCK_M, SLOTS], dtype=tl.int32), mask=row_mask[:, None])
                tl.debug_barrier()
            keep = fired & (rank < SLOTS)
            dst = row_base[:, None] + rank
            tl.store(values_ptr + dst, acc.to(tl.bfloat16), mask=keep)
            tl.store(indices_ptr + dst, cols[None, :] + tl.zeros_like(rank), mask=keep)
        if MODE == 5:  # cumsum ranks, int32 offsets from one scalar base pointer per program
            rank = tl.cumsum(fired_i, axis=1) - 1
            keep = fired & (rank < SLOTS)
            off = tl.arange(0, BLOCK_M)[:, None] * width + rank
            base = (pid_m * BLOCK_M).to(tl.int64) * width + tile * SLOTS
            tl.store(values_ptr + base + off, acc.to(tl.bfloat16), mask=keep)
            tl.store(indices_ptr + base + off, cols[None, :] + tl.zeros_like(rank), mask=keep)
        if MODE == 6:  # iterative extraction: the r-th fired column of every row by a min-reduction, r < max count
            cand = tl.where(fired, tl.arange(0, TILE)[None, :], TILE)
            n_max = tl.minimum(tl.max(tl.sum(fired_i, axis=1), axis=0), SLOTS)
            base = rows.to(tl.int64) * width + tile * SLOTS
            for r in range(0, n_max):
                nxt = tl.min(cand, axis=1)
                hit = cand == nxt[:, None]
                val = tl.sum(tl.where(hit, acc, 0.0), axis=1)
                ok = (nxt < TILE) & row_mask
                tl.store(values_ptr + base + r, val.to(tl.bfloat16), mask=ok)
                tl.store(indices_ptr + base + r, tile * TILE + nxt, mask=ok)
                cand = tl.where(hit, TILE, cand)
        if MODE == 7:  # slots from atomics on the (zeroed) counts: column order not kept (non-deterministic)
            cnt_ptrs = counts_ptr + rows[:, None].to(tl.int64) * n_tiles + tile + tl.zeros_like(fired_i)
            slot = tl.atomic_add(cnt_ptrs, 1, mask=fired, sem="relaxed")
            keep = fired & (slot < SLOTS)
            off = tl.arange(0, BLOCK_M)[:, None] * width + slot
            base = (pid_m * BLOCK_M).to(tl.int64) * width + tile * SLOTS
            tl.store(values_ptr + base + off, acc.to(tl.bfloat16), mask=keep)
            tl.store(indices_ptr + base + off, cols[None, :] + tl.zeros_like(slot), mask=keep)
        if MODE != 7:
            tl.store(counts_ptr + rows.to(tl.int64) * n_tiles + tile, tl.sum(fired_i, axis=1), mask=row_mask)


@triton.jit
def up_down_tiles_kernel(values_ptr, indices_ptr, counts_ptr, order_ptr, x_ptr, wu_ptr, wd_ptr, y_ptr, K, n_tiles,
                         SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
                         HAS_ORDER: tl.constexpr):  # fmt: skip
    # Probe variant: x row resident, scalar loop over tiles, UNROLL entries of a tile per step as [UNROLL, K] tiles.
    p = tl.program_id(0)
    if HAS_ORDER:
        row = tl.load(order_ptr + p).to(tl.int64)
    else:
        row = p.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < K
    xv = tl.load(x_ptr + row * K + d, mask=dm, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = row * (n_tiles * SLOTS)
    for t in range(0, n_tiles):
        c = tl.load(counts_ptr + row * n_tiles + t)
        c = tl.where(c > SLOTS, 0, c)
        for s0 in range(0, c, UNROLL):
            s = s0 + tl.arange(0, UNROLL)
            sm = s < c
            n = tl.load(indices_ptr + base + t * SLOTS + s, mask=sm, other=0).to(tl.int64)
            h = tl.load(values_ptr + base + t * SLOTS + s, mask=sm, other=0.0).to(tl.float32)
            wu = tl.load(wu_ptr + n[:, None] * K + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
            wd = tl.load(wd_ptr + n[:, None] * K + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
            u = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
            acc += tl.sum((h * u)[:, None] * wd.to(tl.float32), axis=0)
    tl.store(y_ptr + row * K + d, acc.to(y_ptr.dtype.element_ty), mask=dm)


@triton.jit
def up_down_flat_kernel(values_ptr, indices_ptr, counts_ptr, order_ptr, x_ptr, wu_ptr, wd_ptr, y_ptr, K, n_tiles,
                        SLOTS: tl.constexpr, BLOCK_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_J: tl.constexpr, HAS_ORDER: tl.constexpr):  # fmt: skip
    # Probe variant: x row resident, the row's stored entries as one sequence, BLOCK_J per step ([BLOCK_J, K]).
    p = tl.program_id(0)
    if HAS_ORDER:
        row = tl.load(order_ptr + p).to(tl.int64)
    else:
        row = p.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < K
    xv = tl.load(x_ptr + row * K + d, mask=dm, other=0.0).to(tl.float32)
    tiles = tl.arange(0, BLOCK_TILES)
    counts = tl.load(counts_ptr + row * n_tiles + tiles, mask=tiles < n_tiles, other=0)
    stored = tl.where(counts > SLOTS, 0, counts)
    ends = tl.cumsum(stored, axis=0)
    starts = ends - stored
    total = tl.sum(stored, axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = row * (n_tiles * SLOTS)
    for j0 in range(0, total, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        jm = j < total
        tile_of_j = tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), axis=1)
        first = tl.sum(tl.where(tiles[None, :] == tile_of_j[:, None], starts[None, :], 0), axis=1)
        slot = base + tile_of_j * SLOTS + (j - first)
        n = tl.load(indices_ptr + slot, mask=jm, other=0).to(tl.int64)
        h = tl.load(values_ptr + slot, mask=jm, other=0.0).to(tl.float32)
        wu = tl.load(wu_ptr + n[:, None] * K + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        wd = tl.load(wd_ptr + n[:, None] * K + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        u = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
        acc += tl.sum((h * u)[:, None] * wd.to(tl.float32), axis=0)
    tl.store(y_ptr + row * K + d, acc.to(y_ptr.dtype.element_ty), mask=dm)


def uniform_twell(M, N, nnz, tile, compression, dtype):
    """TwELL with exactly nnz random columns per token (no tail, no overflow at these sizes)."""
    cols = torch.rand(M, N, device="cuda").argsort(dim=1)[:, :nnz]
    dense = torch.zeros(M, N, device="cuda", dtype=dtype).scatter_(1, cols, torch.rand(M, nnz, device="cuda", dtype=dtype) + 0.1)
    return TwELL.from_dense(dense, tile, compression)


def main():
    quick = "--quick" in sys.argv
    props = torch.cuda.get_device_properties(0)
    log(torch.cuda.get_device_name(), "SMs", props.multi_processor_count, "L2 MiB", props.L2_cache_size >> 20,
        "torch", torch.__version__, "triton", triton.__version__)
    K, N, M, dtype = 2048, 5632, 8192, torch.bfloat16
    ffn = synthetic_ffn(K, N, dtype=dtype, device="cuda")
    x = ffn.make_input(M, 32.0)
    wg, wu, wd_t = ffn.w_gate, ffn.w_up, ffn.w_down.t()  # wd_t [N, K] contiguous rows
    tile, comp = 256, 8
    slots, n_tiles = tile // comp, triton.cdiv(N, tile)

    # ---- dense references
    bench(lambda: F.linear(x, wg), "cuBLAS gate x @ W_gate^T")
    bench(lambda: F.linear(torch.relu(F.linear(x, wg)) * F.linear(x, wu), ffn.w_down), "dense eager FFN")
    bench(lambda: tw.twell_mlp(x, wg, wu, ffn.w_down, method="twell"), "repo twell_mlp(method=twell) autotuned")

    # ---- gate
    t = tw.twell_gate(x, wg, tile=tile, compression=comp)
    log("gate stats", {k: round(v, 1) for k, v in gate_statistics(t.counts).items()},
        "overflowed tiles", int(t.overflowed().sum()))
    try:
        log("repo gate best config", tw._twell_gate_kernel.best_config)
    except Exception as e:  # noqa: BLE001
        log("no best_config", e)
    values = torch.empty(M, n_tiles * slots, device="cuda", dtype=dtype)
    indices = torch.empty(M, n_tiles * slots, device="cuda", dtype=torch.int32)
    counts = torch.empty(M, n_tiles, device="cuda", dtype=torch.int32)
    dense = torch.empty(M, N, device="cuda", dtype=dtype)
    modes = {2: "counts only", 3: "cumsum int64 (repo)", 5: "cumsum int32 offsets", 6: "iterative min", 7: "atomic slots"}
    for bm, tl_, w, st in ([] if "--gate" not in sys.argv else [(128, 256, 8, 3), (64, 256, 8, 3), (64, 256, 8, 4), (128, 128, 8, 3), (128, 128, 4, 3),
                           (64, 128, 4, 4)]):
        nt = triton.cdiv(N, tl_)
        sl = tl_ // comp
        v_ = torch.empty(M, nt * sl, device="cuda", dtype=dtype)
        i_ = torch.empty(M, nt * sl, device="cuda", dtype=torch.int32)
        c_ = torch.zeros(M, nt, device="cuda", dtype=torch.int32)
        grid = (triton.cdiv(M, bm) * nt,)
        for mode, label in modes.items():
            def call(mode=mode):
                if mode == 7:
                    c_.zero_()
                gate_probe_kernel[grid](x, wg, dense, v_, i_, c_, M, K, N, nt, TILE=tl_, SLOTS=sl, BLOCK_M=bm,
                                        BLOCK_K=64, GROUP_M=8, MODE=mode, num_warps=w, num_stages=st)
            bench(call, f"gate {label} BM={bm} TILE={tl_} w={w} s={st}")
            if mode in (5, 6):  # same TwELL as the reference (first slots in column order, exact counts)
                ref = TwELL.from_dense(torch.relu(F.linear(x, wg)), tl_, comp)
                got = TwELL(v_, i_, c_, N, tl_, comp)
                okc = torch.equal(got.counts, ref.counts)
                m = ref._stored_mask()
                oki = torch.equal(got.indices[m], ref.indices[m])
                log(f"   mode {mode}: counts equal {okc}, stored indices equal {oki}")
    # ---- up/down: the repo's kernel 2 as launched now, and the probe's variants for reference
    heavy = t
    uni = uniform_twell(M, N, 32, tile, comp, dtype)
    y = torch.empty(M, K, device="cuda", dtype=dtype)
    bench(lambda: tw._heavy_first_order(heavy.counts, slots, 4), "repo heavy-first order kernel")
    for label, tt in (("heavy-tail", heavy), ("uniform32", uni)):
        bench(lambda: tw._launch_up_down(tt.values, tt.indices, tt.counts, x, wg, None, wu, None, wd_t, None, tile,
                                         comp), f"repo up/down [{label}]")  # fmt: skip
    order = tw._heavy_first_order(heavy.counts, slots, 4)
    for label, tt in (("heavy-tail", heavy), ("uniform32", uni)):
        for bc, bk, ordered in [(8, 1024, True), (4, 512, True), (4, 256, True), (2, 256, True), (4, 512, False)]:
            bench(lambda: tw.twell_up_down_fwd_kernel[(M, 1)](
                tt.values, tt.indices, tt.counts, order, x, wg, x, wu, x, wd_t, x, y, y, y, y, K, N, n_tiles, n_tiles, 1,
                x.stride(0), wg.stride(0), wg.stride(1), wu.stride(0), wd_t.stride(0), y.stride(0), TILE=tile,
                SLOTS=slots, BLOCK_TILES=32, BLOCK_J=4, BLOCK_D=2048, BLOCK_C=bc, BLOCK_K=bk, REDUCE_SPLITS=1,
                HAS_ORDER=ordered, HAS_B_GATE=False, HAS_B_UP=False, HAS_B_DOWN=False, num_warps=4),
                f"repo kernel 2 BLOCK_C={bc} BLOCK_K={bk} ordered={ordered} [{label}]")  # fmt: skip
    for has_order in (False, True):
        bench(lambda: up_down_flat_kernel[(M,)](heavy.values, heavy.indices, heavy.counts, order, x, wu, wd_t, y, K,
                                                n_tiles, SLOTS=slots, BLOCK_TILES=32, BLOCK_D=2048, BLOCK_J=4,
                                                HAS_ORDER=has_order, num_warps=4),
              f"probe flat BLOCK_J=4 w=4 order={has_order} [heavy-tail]")  # fmt: skip
    # correctness of the repo path on the heaviest tokens (overflowed tiles included)
    out = tw.twell_mlp(x, wg, wu, ffn.w_down, method="twell")
    heavy_rows = torch.argsort(heavy.counts.sum(1), descending=True)[:48]
    ref = tw.torch_twell_mlp(x[heavy_rows], wg, wu, ffn.w_down)
    err = (out[heavy_rows].double() - ref).abs().max().item()
    log(f"repo twell_mlp on the 48 heaviest tokens (overflowed: {int(heavy.overflowed()[heavy_rows].any(1).sum())}): "
        f"max abs err {err:.3e}, ref max {ref.abs().max().item():.2e}")
    # ---- the whole block across batch sizes
    for m2 in (1, 16, 256, 2048, 8192):
        x2 = ffn.make_input(m2, 32.0)
        e = bench(lambda: F.linear(torch.relu(F.linear(x2, wg)) * F.linear(x2, wu), ffn.w_down), f"M={m2} dense eager")
        g = bench(lambda: F.linear(x2, wg), f"M={m2} cuBLAS gate")
        tt = bench(lambda: tw.twell_mlp(x2, wg, wu, ffn.w_down, method="twell"), f"M={m2} twell_mlp(twell)")
        for tile_ in ((16, 32, 64, 128) if m2 <= 256 else (128, 256)):
            bench(lambda: tw.twell_mlp(x2, wg, wu, ffn.w_down, method="twell", tile=tile_),
                  f"M={m2} twell_mlp(twell, tile={tile_})")  # fmt: skip
        t2 = tw.twell_gate(x2, wg, tile=tw._auto_tile(m2, N, comp), compression=comp)
        k1 = bench(lambda: tw.twell_gate(x2, wg, tile=tw._auto_tile(m2, N, comp), compression=comp), f"M={m2} gate kernel")
        k2 = bench(lambda: tw._launch_up_down(t2.values, t2.indices, t2.counts, x2, wg, None, wu, None, wd_t, None,
                                              t2.tile, comp), f"M={m2} kernel 2")  # fmt: skip
        log(f"   M={m2}: twell/dense {e / tt:.2f}x, gate kernel/cuBLAS {k1 / g:.2f}, kernel 2 {k2:.1f} us")
    log("done")


if __name__ == "__main__":
    main()
