"""Probe: how fast could the FFN block path (issue 5) be? Ceilings for its two products at the headline shape
(M=8192, K=2048, N=5632, bf16, ~30 heavy-tailed non-zeros per token), all measured in one run.

The block path costs gate (cuBLAS) + pattern + up product + down product. The gate is the dense gate matmul, so
``eager / (gate + pattern + up + down)`` can reach 2.0x only if the two products and the pattern together take under
``eager / 2 - gate``. This probe times, beside the library's stages:

* ``bmm64``: cuBLAS doing the products' work with no gather at all -- a batched matmul of 64-row blocks against one
  shared weight slice of the mean union's width (stride-0 batch, so the slice stays in L2). The same block height,
  the same flops, the best cuBLAS does with them: a ceiling for any kernel that keeps 64-row blocks.
* ``gemm``: the same flops as one tall matmul (8192 rows): the ceiling for the flops alone.
* ``gather``: a Triton kernel that walks the down product's column lists and reads the gathered weight tiles exactly
  as ``block_ell_matmul_kernel`` does, with the matmul replaced by a column sum: the cost of the gathers alone.

Run from scripts/ with PYTHONPATH=..:. on a GPU."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from probe_decode import time_graph
from sparsefuse.ffn import twell
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sparse import compact, sddmm, spmm


@triton.jit
def gather_only_kernel(indices_ptr, counts_ptr, w_ptr, out_ptr, width, stride_w, n_out,
                       BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    # The down product's loads without its matmul: program (db, blk) reads [BLOCK_J, BLOCK_D] tiles of the gathered
    # weight rows of its block's column list and sums them (so the loads are not dead code).
    d_block = tl.program_id(0)
    block = tl.program_id(1)
    count = tl.load(counts_ptr + block)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < n_out
    acc = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    for j0 in range(0, count, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_mask = j < count
        cols = tl.load(indices_ptr + block.to(tl.int64) * width + j, mask=j_mask, other=0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + d[None, :], mask=j_mask[:, None] & d_mask[None, :],
                    other=0.0)  # fmt: skip
        acc += w.to(tl.float32)
    tl.store(out_ptr + block.to(tl.int64) * n_out + d, tl.sum(acc, axis=0), mask=d_mask)


def graph_us(fn, reps: int = 10) -> float:
    """Median µs per call of ``fn``: ``reps`` calls replayed from one CUDA graph (probe_decode's timer)."""
    return time_graph(lambda: fn(), [()] * reps)


@triton.jit
def stream_read_kernel(w_ptr, out_ptr, n_rows, n_cols, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
                       PASSES: tl.constexpr):  # fmt: skip
    # Contiguous reads of an L2-resident [n_rows, n_cols] matrix, PASSES times (the L2 streaming ceiling).
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    tiles_d = n_cols // BLOCK_D
    for p in range(PASSES):
        for t in range(pid, (n_rows // BLOCK_J) * tiles_d, n_progs):
            j = (t // tiles_d) * BLOCK_J + tl.arange(0, BLOCK_J)
            dd = (t % tiles_d) * BLOCK_D + d
            acc += tl.load(w_ptr + j[:, None].to(tl.int64) * n_cols + dd[None, :]).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK_D + d, tl.sum(acc, axis=0))


def headline_case():
    """The issue's headline case on the GPU: (synthetic FFN, x [M, K], w_down_t [N, K], gate pre-activations); prints
    the device, versions and the commit (SPARSEFUSE_COMMIT) the probe runs at."""
    torch.manual_seed(0)
    M, K, N, nnz = 8192, 2048, 5632, 30.0
    f = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda")
    x = f.make_input(M, nnz)
    w_down_t = f.w_down.t()  # [N, K] rows contiguous, as the library passes it
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "commit",
          os.environ.get("SPARSEFUSE_COMMIT", "unknown"), flush=True)
    return f, x, w_down_t, F.linear(x, f.w_gate)


def main() -> None:
    f, x, w_down_t, pre = headline_case()
    (M, K), N = x.shape, pre.shape[1]
    plan = twell.BLOCK_PLAN
    t = {}
    t["eager"] = graph_us(lambda: F.linear(F.relu(F.linear(x, f.w_gate)) * F.linear(x, f.w_up), f.w_down))
    t["gate"] = graph_us(lambda: F.linear(x, f.w_gate))
    t["block path"] = graph_us(lambda: twell.twell_mlp(x, f.w_gate, f.w_up, f.w_down, method="block"))
    budget = t["eager"] / 2 - t["gate"]
    print(f"eager {t['eager']:.1f} us, gate (cuBLAS) {t['gate']:.1f} us, library block path {t['block path']:.1f} us "
          f"= {t['eager'] / t['block path']:.2f}x; 2.0x leaves pattern + up + down {budget:.1f} us", flush=True)

    out = torch.empty(352 * 256, device="cuda", dtype=torch.float32)
    passes = 8
    stream = graph_us(lambda: stream_read_kernel[(352,)](w_down_t, out, N, K, BLOCK_J=64, BLOCK_D=256,
                                                         PASSES=passes, num_warps=8))  # fmt: skip
    l2_rate = passes * w_down_t.numel() * 2 / stream / 1e6
    print(f"L2 streaming read of the {w_down_t.numel() * 2 / 2**20:.0f} MiB down weight, {passes} passes: "
          f"{l2_rate:.2f} TB/s", flush=True)

    for rows in (64, 128):
        pattern = compact.dense_to_row_block_pattern(pre, plan.tile, rows, relu=True, sort_rows=True,
                                                     sort_sample=plan.sort_sample(N))  # fmt: skip
        h = sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True)
        unions = pattern.union_sizes().double()
        n_blocks = unions.numel()
        U = int(round(float(unions.mean()) / 64) * 64)
        work = 2 * rows * K * float(unions.sum())  # flops of one product
        weight_bytes = work / rows  # each block reads its union's weight rows once: 2 bytes * K per column
        scale = work / (2 * M * K * U)  # ceilings run at the rounded mean union; scaled to the real sum
        print(f"\n{rows}-row blocks, sorted: {n_blocks} blocks, unions mean {unions.mean():.0f} ({unions.mean() / N:.1%}"
              f" of N, max {int(unions.max())}); one product {work / 1e9:.1f} GFLOP, {weight_bytes / 1e6:.0f} MB of "
              f"gathered weight rows; ceilings at U={U} scaled by {scale:.3f}", flush=True)
        s = {}
        s["pattern"] = graph_us(lambda: compact.dense_to_row_block_pattern(
            pre, plan.tile, rows, relu=True, sort_rows=True, sort_sample=plan.sort_sample(N)))  # fmt: skip
        s["up (library)"] = graph_us(lambda: sddmm.block_sddmm(pattern, pre, x, f.w_up, relu=True))
        s["down (library)"] = graph_us(lambda: spmm.block_sparse_matmul(h, w_down_t, out_dtype=x.dtype))
        xb = x.view(n_blocks, rows, K)
        hb = torch.randn(n_blocks, rows, U, device="cuda", dtype=x.dtype)
        up_slice = f.w_up[:U].t().unsqueeze(0).expand(n_blocks, K, U)  # shared [K, U], stride-0 batch: in L2
        down_slice = w_down_t[:U].unsqueeze(0).expand(n_blocks, U, K)
        s["up bmm"] = graph_us(lambda: torch.bmm(xb, up_slice)) * scale
        s["down bmm"] = graph_us(lambda: torch.bmm(hb, down_slice)) * scale
        s["up gemm"] = graph_us(lambda: x @ f.w_up[:U].t()) * scale
        s["down gemm"] = graph_us(lambda: hb.view(M, U) @ w_down_t[:U]) * scale
        gathers = {}
        sums = torch.empty(n_blocks, K, device="cuda", dtype=torch.float32)
        for block_j, block_d, warps, stages in [(64, 256, 8, 3), (64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4),
                                                (128, 128, 8, 3), (64, 64, 4, 4)]:  # fmt: skip
            grid = (triton.cdiv(K, block_d), n_blocks)
            gathers[(block_j, block_d, warps, stages)] = graph_us(lambda: gather_only_kernel[grid](
                h.indices, h.counts, w_down_t, sums, h.indices.shape[1], w_down_t.stride(0), K,
                BLOCK_J=block_j, BLOCK_D=block_d, num_warps=warps, num_stages=stages))  # fmt: skip
        best = min(gathers, key=gathers.get)
        s["gather only"] = gathers[best]
        for name, v in s.items():
            rate = "" if name == "pattern" else f"  {work / v / 1e6:6.0f} TFLOP/s  {weight_bytes / v / 1e6:5.2f} TB/s"
            print(f"{name:>16s} {v:8.1f} us{rate}")
        print("  gathers (J, D, warps, stages): " + ", ".join(f"{k}: {v:.1f}" for k, v in gathers.items()))
        for label, up, down in [("library", s["up (library)"], s["down (library)"]),
                                ("cuBLAS blocks, gathers free", s["up bmm"], s["down bmm"]),
                                ("tall GEMM, gathers free", s["up gemm"], s["down gemm"]),
                                ("max(cuBLAS blocks, gathers)", max(s["up bmm"], s["gather only"]),
                                 max(s["down bmm"], s["gather only"]))]:  # fmt: skip
            total = t["gate"] + s["pattern"] + up + down
            print(f"  {label:>30s}: gate {t['gate']:.0f} + pattern {s['pattern']:.0f} + up {up:.0f} + down {down:.0f}"
                  f" = {total:.0f} us -> {t['eager'] / total:.2f}x eager")


if __name__ == "__main__":
    main()
