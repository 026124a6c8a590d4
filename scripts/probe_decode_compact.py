"""Probe: can SAE decode beat cuSPARSE on a prebuilt CSR at larger batches by compacting first (issue 3)?

At B=256 the scan (pick each chunk's non-zeros, gather their W rows, serially per program) runs at 0.41x
``torch.sparse.mm`` on a prebuilt CSR, while reading the activations alone takes about a third of cuSPARSE's time.
The ``fixed`` path (ELL then gather) pays four launches and two reads of the activations for its compaction. This
probe times a one-pass compaction -- one program per row walks the row in order, so slots need no count pass, no
prefix sum and no atomics, and the ELL comes out in column order (deterministic) -- then the library's ELL gather.
Timed as CUDA-graph replays over rotated inputs (together over twice the L2). Run from scripts/ with PYTHONPATH=..:."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import ELL, dense_to_ell, matmul_skip_zeros, sparse_matmul


@triton.jit
def row_compact_kernel(dense_ptr, values_ptr, indices_ptr, counts_ptr, n_cols, stride_row, width,
                       BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = dense_ptr + row * stride_row
    out = row * width
    count = tl.zeros([], dtype=tl.int32)
    f_next = tl.arange(0, BLOCK)
    a_next = tl.load(row_ptr + f_next, mask=f_next < n_cols, other=0.0)
    for _ in range(0, n_cols, BLOCK):
        f, a = f_next, a_next
        f_next = f + BLOCK
        a_next = tl.load(row_ptr + f_next, mask=f_next < n_cols, other=0.0)
        nonzero = a != 0
        slot = count + tl.cumsum(nonzero.to(tl.int32), axis=0) - 1
        keep = nonzero & (slot < width)
        tl.store(values_ptr + out + slot, a, mask=keep)
        tl.store(indices_ptr + out + slot, f, mask=keep)
        count += tl.sum(nonzero.to(tl.int32), axis=0)
    tl.store(counts_ptr + row, count)


def row_compact(dense: torch.Tensor, width: int, block: int, warps: int) -> ELL:
    M, N = dense.shape
    values = torch.empty(M, width, dtype=dense.dtype, device=dense.device)
    indices = torch.empty(M, width, dtype=torch.int32, device=dense.device)
    counts = torch.empty(M, dtype=torch.int32, device=dense.device)
    row_compact_kernel[(M,)](dense, values, indices, counts, N, dense.stride(0), width, BLOCK=block, num_warps=warps)
    return ELL(values, indices, counts, N)


def decode_cases(shapes: list[tuple[int, int, int, int]]):
    """Yield (B, F, D, L0, dtype, input sets): each set (activations with exactly L0 non-zeros per row, W_dec, the
    activations' prebuilt CSR), enough sets to exceed twice the L2; fp32 is skipped at the largest shapes."""
    for B, F, D, l0 in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            if B * F * D > 2**37 and dtype == torch.float32:
                continue
            e = dtype.itemsize
            n_sets = max(2, min(16, int(2 * 2 * 63e6 // (B * F * e + F * D * e)) + 1))
            sets = []
            for _ in range(n_sets):
                a = acts_with_l0(B, F, l0, dtype)
                sets.append((a, torch.randn(F, D, device="cuda", dtype=dtype) / 16, a.to_sparse_csr()))
            yield B, F, D, l0, dtype, sets


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    shapes = [(32, 65536, 768, 64), (32, 131072, 512, 128), (128, 65536, 768, 64), (256, 65536, 768, 64),
              (1024, 65536, 768, 64), (4096, 65536, 2304, 72), (1024, 262144, 2304, 100), (1024, 131072, 3584, 72),
              (1024, 32768, 2048, 100)]  # fmt: skip
    for B, F, D, l0, dtype, sets in decode_cases(shapes):
        width = 2 * l0
        ref = sets[0][0].double() @ sets[0][1].double()
        t = {"read acts (clone / 2)": time_graph(lambda a, w, c: a.clone(), sets) / 2,
             "cuSPARSE prebuilt": time_graph(lambda a, w, c: torch.sparse.mm(c, w), sets),
             "scan": time_graph(lambda a, w, c: matmul_skip_zeros(a, w), sets),
             "fixed (library)": time_graph(lambda a, w, c: sparse_matmul(dense_to_ell(a, width), w, dense=a), sets),
             "compact (library)": time_graph(lambda a, w, c: dense_to_ell(a, width), sets)}  # fmt: skip
        best = None
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                key = f"row compact B{block} w{warps}"
                t[key] = time_graph(lambda a, w, c: row_compact(a, width, block, warps), sets)
                if best is None or t[key] < t[best]:
                    best = key
        block, warps = (int(s[1:]) for s in best.split()[2:])
        ell = row_compact(sets[0][0], width, block, warps)
        ref_ell = dense_to_ell(sets[0][0], width)
        used = torch.arange(width, device="cuda")[None, :] < ell.counts.clamp(max=width)[:, None]
        same = bool(torch.equal(ell.counts, ref_ell.counts) and torch.equal(ell.values[used], ref_ell.values[used])
                    and torch.equal(ell.indices[used], ref_ell.indices[used]))  # fmt: skip
        got = sparse_matmul(ell, sets[0][1], dense=sets[0][0]).double()
        err = float((got - ref).abs().max() / ref.abs().max())
        t["gather (library, on the ELL)"] = time_graph(
            lambda a, w, c, e_=ell: sparse_matmul(e_, w, dense=a), [(s[0], s[1], ell) for s in sets])
        t["row compact + gather"] = time_graph(
            lambda a, w, c: sparse_matmul(row_compact(a, width, block, warps), w, dense=a), sets)
        cus = t["cuSPARSE prebuilt"]
        print(f"\nB={B} F={F} D={D} L0={l0} {str(dtype)[6:]} ({len(sets)} input sets; row compact == library ELL: "
              f"{same}, max rel err {err:.1e})")
        for k, v in t.items():
            if k.startswith("row compact B") and k != best:
                continue
            print(f"  {k:>30s} {v:8.1f} us  {cus / v:5.2f}x cuSPARSE")
        print("  row compact configs: " + ", ".join(f"{k.split(' ', 2)[2]} {v:.1f}" for k, v in t.items()
                                                    if k.startswith("row compact B")), flush=True)


if __name__ == "__main__":
    main()
