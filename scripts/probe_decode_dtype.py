"""Probe: why the skip-zeros decode in bf16 at B=32, F=131072, D=512, L0=128 takes twice its fp32 time. Times
matmul_skip_zeros with the activations' and the weight's dtypes varied separately, and at neighbouring shapes.
Also the warp count: the chosen one (spmm._scan_warps) against the previous fixed 4.
Usage: cd scripts && python probe_decode_dtype.py"""

from __future__ import annotations

import itertools
import sys

import torch

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import spmm
from sparsefuse.sparse.spmm import matmul_skip_zeros


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name())
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for (B, F, D, l0) in [(32, 131072, 512, 128), (32, 65536, 512, 128), (32, 131072, 768, 128), (32, 65536, 768, 64),
                          (1, 65536, 2304, 72), (256, 65536, 768, 64), (1024, 32768, 2048, 100)]:
        for a_dtype, w_dtype in [(f32, f32), (bf16, bf16), (f16, f16), (bf16, f32), (f32, bf16)]:
            per_set = B * F * a_dtype.itemsize + F * D * w_dtype.itemsize
            n_sets = max(2, min(16, (3 * l2) // per_set + 1))
            sets = [(acts_with_l0(B, F, l0, a_dtype), (torch.randn(F, D, device="cuda") / 16).to(w_dtype))
                    for _ in range(n_sets)]  # fmt: skip
            t = time_graph(matmul_skip_zeros, sets)
            t_one = time_graph(matmul_skip_zeros, sets[:1] * 2)  # the same set twice: W rows hit in L2
            chosen = spmm._scan_warps
            spmm._scan_warps = lambda *_: 4  # the previous fixed count
            t_four = time_graph(matmul_skip_zeros, sets)
            spmm._scan_warps = chosen
            print(f"B={B} F={F} D={D} L0={l0} acts {str(a_dtype)[6:]:8s} W {str(w_dtype)[6:]:8s} "
                  f"{t:7.2f} us (rotated)  {t_one:7.2f} us (one set, L2-warm)  {t_four:7.2f} us (4 warps)")
            del sets


def configs() -> None:
    """The seed's small-batch shapes: launch configurations of the scan against cuSPARSE on a prebuilt CSR."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    default_programs, default_config = spmm._device_programs, spmm._launch_config
    for (B, F, D, l0), dtype in itertools.product([(32, 131072, 512, 128), (32, 65536, 768, 64)],
                                                  [torch.float32, torch.bfloat16]):  # fmt: skip
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        csr = time_graph(lambda c, w: torch.sparse.mm(c, w), [(a.to_sparse_csr(), w) for a, w in sets])
        print(f"B={B} F={F} D={D} L0={l0} {dtype}: cuSPARSE prebuilt {csr:.2f} us, "
              f"default scan {time_graph(matmul_skip_zeros, sets):.2f} us")
        for mult, block_f, group in itertools.product([2, 4, 8, 16], [512, 1024, 2048], [2, 4]):
            base = default_config(D)
            cfg = spmm._LaunchConfig(block_d=base.block_d, block_f=block_f, block_k=32, group=group, num_warps=4)
            spmm._launch_config = lambda n_out, cfg=cfg: cfg
            spmm._device_programs = lambda dev, mult=mult, **_: mult * n_sm
            t = time_graph(matmul_skip_zeros, sets)
            print(f"  x{mult:<2d} f{block_f:<4d} g{group}  {t:7.2f} us  {csr / t:5.2f}x cuSPARSE")
        spmm._launch_config, spmm._device_programs = default_config, default_programs
        del sets


if __name__ == "__main__":
    configs() if "--configs" in sys.argv else main()
