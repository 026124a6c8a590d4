"""Probe: dense -> ELL through a bitmask (issue 3). The decode's cost at large batches is the conversion from dense
activations, not the gather (scripts/probe_decode_sliced.py). The library's compaction now streams the activations
once into a bitmask of their non-zeros (row_bits_kernel) and ranks words, not columns (bits_to_sparse_kernel); the
previous one read them twice (a count pass, then a scatter pass that ranked every column). This times, per shape:
cuSPARSE on a prebuilt CSR, the scan, the previous and the new dense_to_ell, the bits pass and the bits -> ELL pass
alone (a few launch configurations each), the ELL gather alone, and the new fixed decode (compaction + gather with
the dense fallback). The previous compaction is loaded from scripts/_compact_0d0c288.py when present (written from
git before a run: ``git show 0d0c288:sparsefuse/sparse/compact.py``, imports made absolute).
Usage: cd scripts && python probe_decode_bits.py"""

from __future__ import annotations

import importlib.util

import torch
import triton

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import compact, dense_to_ell, matmul_skip_zeros, sparse_matmul

SHAPES = [(256, 65536, 768, 64), (4096, 65536, 2304, 72), (1024, 262144, 2304, 100), (1024, 131072, 3584, 72),
          (1024, 32768, 2048, 100), (32, 65536, 768, 64)]  # fmt: skip


def _old_compaction():
    try:
        return importlib.import_module("_compact_0d0c288")
    except ImportError:
        return None


def bits_pass(a, rows, block_c, warps):
    M, N = a.shape
    bits = torch.empty(M, triton.cdiv(N, 32), dtype=torch.int32, device=a.device)
    compact.row_bits_kernel[(triton.cdiv(N, block_c), min(triton.cdiv(M, rows), 65535))](
        a, bits, M, N, bits.shape[1], a.stride(0), ROWS=rows, BLOCK_C=block_c, RELU=False, num_warps=warps)
    return bits


def to_ell(bits, a, width, block_w, warps):
    M = a.shape[0]
    values = torch.zeros(M, width, dtype=a.dtype, device=a.device)
    indices = torch.zeros(M, width, dtype=torch.int32, device=a.device)
    counts = torch.empty(M, dtype=torch.int32, device=a.device)
    compact.bits_to_sparse_kernel[(M,)](bits, a, counts, bits, values, indices, bits.shape[1], a.stride(0), width,
                                        BLOCK_W=block_w, MODE=1, num_warps=warps)  # fmt: skip


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "L2", l2 >> 20, "MiB", flush=True)
    old = _old_compaction()
    for (B, F, D, l0), dtype in [(s, d) for s in SHAPES for d in (torch.bfloat16, torch.float32)]:
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), (torch.randn(F, D, device="cuda") / 16).to(dtype))
                for _ in range(n_sets)]  # fmt: skip
        width = 2 * l0  # the benchmark's fixed method
        ells = [(dense_to_ell(a, width), w) for a, w in sets]
        ref = sets[0][0].double() @ sets[0][1].double()
        got = sparse_matmul(dense_to_ell(sets[0][0], width), sets[0][1], dense=sets[0][0]).double()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        t = {"cuSPARSE prebuilt": time_graph(lambda c, w: torch.sparse.mm(c, w),
                                             [(a.to_sparse_csr(), w) for a, w in sets]),
             "read acts (clone / 2)": time_graph(lambda a, w: a.clone(), sets) / 2,
             "scan": time_graph(matmul_skip_zeros, sets)}  # fmt: skip
        if old is not None:
            t["dense_to_ell before"] = time_graph(lambda a, w: old.dense_to_ell(a, width), sets)
        t["dense_to_ell now"] = time_graph(lambda a, w: dense_to_ell(a, width), sets)
        t["ELL gather (ready ELL)"] = time_graph(sparse_matmul, ells)
        t["fixed now (compact + gather)"] = time_graph(
            lambda a, w: sparse_matmul(dense_to_ell(a, width), w, dense=a), sets)  # fmt: skip
        csr = t["cuSPARSE prebuilt"]
        print(f"\nB={B} F={F} D={D} L0={l0} {str(dtype)[6:]} ({n_sets} sets; fixed max rel err {err:.1e})", flush=True)
        for name, us in t.items():
            print(f"  {name:>30s} {us:8.1f} us  {csr / us:5.2f}x cuSPARSE", flush=True)
        act_gb = B * F * dtype.itemsize / 1e9
        bits_cfg = {}
        for rows, block_c, warps in [(8, 512, 4), (16, 512, 4), (4, 1024, 4), (32, 256, 4), (16, 1024, 8),
                                     (8, 1024, 4), (2, 4096, 8)]:  # fmt: skip
            bits_cfg[(rows, block_c, warps)] = time_graph(lambda a, w, c=(rows, block_c, warps): bits_pass(a, *c), sets)
        print("  bits pass rows x cols/warps: " + ", ".join(
            f"{r}x{c}/{w} {us:.1f} ({act_gb / us * 1e6 / 1e3:.2f} TB/s)" for (r, c, w), us in bits_cfg.items()),
            flush=True)  # fmt: skip
        bits = [(compact._row_bits(a, False), a) for a, _ in sets]
        to_ell_cfg = {}
        for block_w, warps in [(256, 4), (512, 4), (1024, 4), (2048, 4), (1024, 8), (2048, 8)]:
            to_ell_cfg[(block_w, warps)] = time_graph(lambda b, a, c=(block_w, warps): to_ell(b, a, width, *c), bits)
        print("  bits -> ELL words/warps: " + ", ".join(f"{bw}/{w} {us:.1f}" for (bw, w), us in to_ell_cfg.items()),
              flush=True)  # fmt: skip
        del sets, ells, bits


if __name__ == "__main__":
    main()
