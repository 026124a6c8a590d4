"""Probe: the skip-zeros decode with its split partials added by fp32 atomics instead of the ordered last-arriver
sum, against cuSPARSE on a prebuilt CSR, at the seed's shapes. With atomics a split costs no partial buffer, so more
programs per SM (shorter serial scans per program) may pay; the multiplier is varied.
Usage: cd scripts && python probe_decode_atomic.py"""

from __future__ import annotations

import itertools

import torch

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import spmm
from sparsefuse.sparse.spmm import matmul_skip_zeros


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    l2, n_sm = props.L2_cache_size, props.multi_processor_count
    print(torch.cuda.get_device_name(), torch.__version__)
    default_programs = spmm._device_programs
    shapes = [(32, 65536, 768, 64), (32, 131072, 512, 128), (256, 65536, 768, 64), (64, 65536, 2304, 72)]
    for (B, F, D, l0), dtype in itertools.product(shapes, [torch.float32, torch.bfloat16]):
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        ref = sets[0][0].double() @ sets[0][1].double()
        csr_sets = [(a.to_sparse_csr(), w) for a, w in sets]
        for rep in range(2):
            csr = time_graph(lambda c, w: torch.sparse.mm(c, w), csr_sets)
            det = time_graph(lambda a, w: matmul_skip_zeros(a, w, deterministic=True), sets)
            line = (f"B={B} F={F} D={D} L0={l0} {str(dtype)[6:]:8s} cuSPARSE {csr:6.2f}  "
                    f"ordered {det:6.2f} ({csr / det:4.2f}x)")
            for mult in [4, 8, 16, 32]:
                spmm._device_programs = lambda dev, mult=mult, **_: mult * n_sm
                t = time_graph(lambda a, w: matmul_skip_zeros(a, w, deterministic=False), sets)
                if rep == 0 and mult == 4:
                    err = (matmul_skip_zeros(*sets[0], deterministic=False).double() - ref).abs().max().item()
                    line += f"  [err {err:.1e}]"
                line += f"  atomic x{mult} {t:6.2f} ({csr / t:4.2f}x)"
            spmm._device_programs = default_programs
            print(line, flush=True)
        del sets, csr_sets


def configs() -> None:
    """The seed's F=131072 shape: chunk width, picks per step and programs per SM, with the atomic combine."""
    props = torch.cuda.get_device_properties(0)
    l2, n_sm = props.L2_cache_size, props.multi_processor_count
    default_programs, default_config = spmm._device_programs, spmm._launch_config
    B, F, D, l0 = 32, 131072, 512, 128
    for dtype in [torch.float32, torch.bfloat16]:
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        csr = time_graph(lambda c, w: torch.sparse.mm(c, w), [(a.to_sparse_csr(), w) for a, w in sets])
        print(f"B={B} F={F} D={D} L0={l0} {dtype}: cuSPARSE prebuilt {csr:.2f} us")
        for mult, block_f, group in itertools.product([8, 16, 32, 64], [256, 512, 1024, 2048], [1, 2, 4]):
            base = default_config(D)
            cfg = spmm._LaunchConfig(block_d=base.block_d, block_f=block_f, block_k=32, group=group, num_warps=4)
            spmm._launch_config = lambda n_out, cfg=cfg: cfg
            spmm._device_programs = lambda dev, mult=mult, **_: mult * n_sm
            t = time_graph(lambda a, w: matmul_skip_zeros(a, w, deterministic=False), sets)
            line = f"  x{mult:<2d} f{block_f:<4d} g{group}  {t:7.2f} us  {csr / t:5.2f}x cuSPARSE"
            if dtype != torch.float32:  # fp32 atomics into an fp32 output, then a separate cast
                t_cast = time_graph(lambda a, w: matmul_skip_zeros(a, w, out_dtype=torch.float32,
                                                                   deterministic=False).to(dtype), sets)  # fmt: skip
                line += f"   fp32 + cast {t_cast:7.2f} us  {csr / t_cast:5.2f}x"
            print(line, flush=True)
        spmm._launch_config, spmm._device_programs = default_config, default_programs
        del sets


def defaults() -> None:
    """The library's launch rule as shipped, ordered against atomic splits, three interleaved repeats per shape."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    shapes = [(32, 65536, 768, 64, torch.float32), (32, 65536, 768, 64, torch.bfloat16),
              (32, 131072, 512, 128, torch.float32), (32, 131072, 512, 128, torch.bfloat16),
              (256, 65536, 768, 64, torch.float32), (1, 65536, 2304, 72, torch.bfloat16),
              (8, 65536, 2304, 72, torch.bfloat16), (64, 65536, 2304, 72, torch.bfloat16),
              (512, 65536, 2304, 72, torch.bfloat16)]  # fmt: skip
    for B, F, D, l0, dtype in shapes:
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        csr_sets = [(a.to_sparse_csr(), w) for a, w in sets]
        line = f"B={B} F={F} D={D} L0={l0} {str(dtype)[6:]:8s}"
        for _ in range(3):
            csr = time_graph(lambda c, w: torch.sparse.mm(c, w), csr_sets)
            det = time_graph(lambda a, w: matmul_skip_zeros(a, w, deterministic=True), sets)
            atom = time_graph(lambda a, w: matmul_skip_zeros(a, w, deterministic=False), sets)
            line += f" | csr {csr:6.2f} ordered {det:6.2f} atomic {atom:6.2f} ({csr / atom:4.2f}x)"
        print(line, flush=True)
        del sets, csr_sets


if __name__ == "__main__":
    import sys

    configs() if "--configs" in sys.argv else defaults() if "--defaults" in sys.argv else main()
