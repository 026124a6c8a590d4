"""Probe: a cheaper way to pick a scanned chunk's non-zeros in the SAE decode scan (issue 3).

The library scan ranks every element of a chunk (a cumsum over BLOCK_F) and picks the non-zeros by select-and-sum
over the whole chunk. At SAE sparsity a chunk of 1024 holds about one non-zero, so nearly all of that work is on
zeros. The variant here loads the chunk as [BLOCK_F / G, G] groups, takes each group's first non-zero by a min over
its G elements (within a thread or a few lanes), and ranks and picks among the BLOCK_F / G group candidates only --
G times fewer elements; a group holding several non-zeros takes another round. Deterministic (the order of the
rounds is fixed by the data), not column order. Timed against the library scan and cuSPARSE on a prebuilt CSR, CUDA
graphs over rotated inputs. Run from scripts/ with PYTHONPATH=..:."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from probe_decode import time_graph
from probe_decode_compact import decode_cases
from sparsefuse.sparse import matmul_skip_zeros
from sparsefuse.sparse.spmm import accumulate_rows, sum_split_partials

_NONE = tl.constexpr(2**31 - 1)


@triton.jit
def accumulate_grouped(acc, a2, f2, w_ptr, stride_w, d, d_mask, PICK: tl.constexpr):
    """acc += sum of a2 * W[f2] over the non-zeros of a chunk held as groups a2/f2 [NG, G]."""
    nonzero = a2 != 0
    remaining = tl.sum(tl.sum(nonzero.to(tl.int32), axis=1), axis=0)
    while remaining > 0:
        first = tl.min(tl.where(nonzero, f2, _NONE), axis=1)  # [NG] each group's first non-zero column
        hit = f2 == first[:, None]  # at most one per group
        val = tl.sum(tl.where(hit, a2.to(tl.float32), 0.0), axis=1)  # [NG]
        nonzero = nonzero & (f2 != first[:, None])
        has = first != _NONE
        n = tl.sum(has.to(tl.int32), axis=0)
        rank = tl.where(has, tl.cumsum(has.to(tl.int32), axis=0) - 1, -1)
        for g0 in range(0, n, PICK):
            j = g0 + tl.arange(0, PICK)
            pick = rank[None, :] == j[:, None]  # [PICK, NG]
            idx = tl.sum(tl.where(pick, first[None, :], 0), axis=1)
            v = tl.sum(tl.where(pick, val[None, :], 0.0), axis=1)
            acc = accumulate_rows(acc, v, idx, j < n, w_ptr, stride_w, d, d_mask)
        remaining -= n
    return acc


@triton.jit
def scan_grouped_kernel(dense_ptr, w_ptr, out_ptr, partial_ptr, split_nnz_ptr, arrivals_ptr, n_out, n_in, stride_w,
                        stride_out, stride_dense, chunks_per_split, n_splits,
                        BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, G: tl.constexpr, PICK: tl.constexpr,
                        REDUCE_SPLITS: tl.constexpr):  # fmt: skip
    n_d_blocks = tl.cdiv(n_out, BLOCK_D)
    d_block = tl.program_id(0) % n_d_blocks
    row = (tl.program_id(0) // n_d_blocks).to(tl.int64)
    split = tl.program_id(1)
    d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < n_out
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    split_nnz = tl.zeros([], dtype=tl.int32)
    c_begin = split * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, tl.cdiv(n_in, BLOCK_F))
    row_ptr = dense_ptr + row * stride_dense
    f_end = tl.minimum(n_in, c_end * BLOCK_F)
    f_next = c_begin * BLOCK_F + tl.arange(0, BLOCK_F // G)[:, None] * G + tl.arange(0, G)[None, :]  # [NG, G]
    a_next = tl.load(row_ptr + f_next, mask=f_next < f_end, other=0.0)
    for c in range(c_begin, c_end):
        f2, a2 = f_next, a_next
        f_next = f2 + BLOCK_F
        a_next = tl.load(row_ptr + f_next, mask=f_next < f_end, other=0.0)
        split_nnz += tl.sum(tl.sum((a2 != 0).to(tl.int32), axis=1), axis=0)
        acc = accumulate_grouped(acc, a2, f2, w_ptr, stride_w, d, d_mask, PICK)
    if n_splits > 1:
        last, acc = sum_split_partials(acc, split_nnz > 0, partial_ptr, split_nnz_ptr, arrivals_ptr, row, split,
                                       n_splits, d_block, n_d_blocks, n_out, d, d_mask, REDUCE_SPLITS)  # fmt: skip
        if last:
            tl.store(out_ptr + row * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)
        return
    tl.store(out_ptr + row * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def scan_grouped(a, w, block_f: int, g: int, pick: int, programs: int, warps: int | None = None):
    (M, n_in), n_out = a.shape, w.shape[1]
    block_d = min(4096, max(32, triton.next_power_of_2(n_out)))
    n_chunks = triton.cdiv(n_in, block_f)

    def n_splits_for(bd):
        wanted = triton.cdiv(programs, M * triton.cdiv(n_out, bd))
        return triton.cdiv(n_chunks, triton.cdiv(n_chunks, max(1, min(wanted, n_chunks))))

    while block_d > 128 and n_splits_for(block_d) * block_d * 4 > 65536:
        block_d //= 2
    d_blocks, n_splits = triton.cdiv(n_out, block_d), n_splits_for(block_d)
    warps = warps or max(1, min(4, block_d * w.element_size() // 512))
    out = torch.empty(M, n_out, dtype=w.dtype, device=a.device)
    partial = torch.empty(M, n_splits, n_out, dtype=torch.float32, device=a.device)
    split_nnz = torch.empty(M, n_splits, dtype=torch.int32, device=a.device)
    arrivals = torch.zeros(M, d_blocks, dtype=torch.int32, device=a.device)
    scan_grouped_kernel[(d_blocks * M, n_splits)](
        a, w, out, partial, split_nnz, arrivals, n_out, n_in, w.stride(0), out.stride(0), a.stride(0),
        triton.cdiv(n_chunks, n_splits), n_splits, BLOCK_D=block_d, BLOCK_F=block_f, G=g, PICK=pick,
        REDUCE_SPLITS=max(1, min(triton.next_power_of_2(n_splits), 8192 // block_d)), num_warps=warps)  # fmt: skip
    return out


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(32, 65536, 768, 64), (32, 131072, 512, 128), (256, 65536, 768, 64), (1024, 65536, 768, 64),
              (4096, 65536, 2304, 72), (1024, 131072, 3584, 72), (1024, 32768, 2048, 100)]  # fmt: skip
    for B, F, D, l0, dtype, sets in decode_cases(shapes):
        ref = sets[0][0].double() @ sets[0][1].double()
        t = {"cuSPARSE prebuilt": time_graph(lambda a, w, c: torch.sparse.mm(c, w), sets),
             "library scan": time_graph(lambda a, w, c: matmul_skip_zeros(a, w), sets)}  # fmt: skip
        errs = {}
        for block_f in (1024, 2048, 4096):
            for g in (8, 16, 32):
                for pick, mult in ((2, 4), (4, 4), (2, 8)):
                    key = f"F{block_f} G{g} P{pick} x{mult}"
                    fn = lambda a, w, c, bf=block_f, g_=g, p=pick, m=mult: scan_grouped(a, w, bf, g_, p, m * sms)  # noqa: E731
                    got = fn(*sets[0]).double()
                    errs[key] = float((got - ref).abs().max() / ref.abs().max())
                    t[key] = time_graph(fn, sets)
        cus, lib = t["cuSPARSE prebuilt"], t["library scan"]
        ranked = sorted((k for k in t if k.startswith("F")), key=t.get)
        print(f"\nB={B} F={F} D={D} L0={l0} {str(dtype)[6:]}: cuSPARSE {cus:.1f} us, library scan {lib:.1f} us "
              f"({cus / lib:.2f}x cuSPARSE); worst rel err of the variants {max(errs.values()):.1e}")
        for k in ranked[:5]:
            print(f"  {k:>20s} {t[k]:8.1f} us  {cus / t[k]:5.2f}x cuSPARSE  {lib / t[k]:5.2f}x library scan")
        print("  all: " + ", ".join(f"{k} {t[k]:.1f}" for k in ranked), flush=True)


if __name__ == "__main__":
    main()
