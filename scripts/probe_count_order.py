"""Probe: the token sort of the gated FFN's block path (``sparsefuse.sparse.compact.count_order``: a count/key
kernel over the first eighth of the columns, then a counting sort within groups of rows) and whether sorting pays,
on the synthetic 1.5B layer (K=2048, N=5632, bf16) at M = 2048..16384 and 8/30/128 non-zeros per token, and the 8B
layer at M=8192. Reading the sampled columns is 2.9-23 MB, 1-6 us at DRAM rate; the products shrink with the
unions (22% -> 14% of N at 30 non-zeros), but heavy blocks' long column lists can leave the down product's grid
with a tail when the batch has few blocks.

Usage: python scripts/probe_count_order.py"""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench

from sparsefuse.ffn import twell as tw
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.sparse import compact


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    us = lambda fn: do_bench(fn, warmup=10, rep=100) * 1e3  # noqa: E731
    unsorted, sorted_plan = tw.BlockPlan(64, 256, False), tw.BlockPlan(64, 256, True, 0.125, 0)
    for K, N, cases in [(2048, 5632, [(M, 30.0) for M in (2048, 4096, 8192, 16384)] + [(8192, 8.0), (8192, 128.0)]),
                        (4096, 14336, [(8192, 30.0), (2048, 30.0)])]:
        f = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda")
        w_down_t = f.w_down.t()
        for M, nnz in cases:
            x = f.make_input(M, nnz)
            pre = torch.nn.functional.linear(x, f.w_gate)
            sample = sorted_plan.sort_sample(N)
            groups = [512, 1024, 2048] if (M, nnz, K) == (8192, 30.0, 2048) else [compact.SORT_GROUP]
            dense = us(lambda: tw._dense_mlp(x, f.w_gate, None, f.w_up, None, f.w_down, None))
            t0 = us(lambda: tw._launch_block_mlp(x, f.w_gate, None, f.w_up, None, w_down_t, None, unsorted))
            line = f"K={K} N={N} M={M:5d} nnz={nnz:3.0f}: dense {dense:7.1f} us, block in token order {t0:7.1f} us " \
                   f"({dense / t0:.2f}x)"
            for group in groups:
                compact.count_order.__defaults__ = (False, group)
                order_us = us(lambda: compact.count_order(pre, sample, relu=True))
                p = compact.dense_to_row_block_pattern(pre, 256, 64, relu=True, sort_rows=True, sort_sample=sample)
                union = float(p.union_sizes().double().mean()) / N
                t1 = us(lambda: tw._launch_block_mlp(x, f.w_gate, None, f.w_up, None, w_down_t, None, sorted_plan))
                line += f"; sorted in groups of {group}: count_order {order_us:.1f} us, unions {union:.1%} of N, " \
                        f"block {t1:7.1f} us ({dense / t1:.2f}x)"
            compact.count_order.__defaults__ = (False, compact.SORT_GROUP)
            print(line, flush=True)


if __name__ == "__main__":
    main()
