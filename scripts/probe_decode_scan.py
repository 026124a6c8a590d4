"""Probe: where the skip-zeros decode scan's time goes, and three alternatives to its per-chunk picking. A
stripped copy of the scan loop (one program per (row, split), partials written out, no split reduction) run in
stages: read (sum the activations), rank (count the non-zeros; the unused ranks are compiled away), pick (rank and
pick the non-zeros, no W rows loaded), full (gather their W rows: the library's loop). Alternatives:
pick2/full2 take each chunk's two first non-zeros and the count from one 5-operand tl.reduce instead of a cumsum
and [GROUP, BLOCK_F] select-sums; scatter writes each chunk's non-zeros to a per-program list in global memory
without waiting and gathers their W rows after the scan, 16 at a time. x = programs per SM, w = warps per program.
Median us under a CUDA graph over rotated inputs. Usage: python scripts/probe_decode_scan.py"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse.spmm import accumulate_rows, matmul_skip_zeros, pick_nonzeros, rank_nonzeros

READ, RANK, PICK, FULL, PICK2, FULL2, SCATTER = 0, 1, 2, 3, 4, 5, 6
NO_FEATURE = 2**31 - 1


@triton.jit
def _two_smallest(f1, a1, g1, b1, n1, f2, a2, g2, b2, n2):
    """Combine of (smallest f, its a, second smallest f, its a, count) states."""
    take1 = f1 < f2
    first_f = tl.where(take1, f1, f2)
    first_a = tl.where(take1, a1, a2)
    lose_f = tl.where(take1, f2, f1)
    lose_a = tl.where(take1, a2, a1)
    win2_f = tl.where(take1, g1, g2)
    win2_a = tl.where(take1, b1, b2)
    t2 = lose_f < win2_f
    return first_f, first_a, tl.where(t2, lose_f, win2_f), tl.where(t2, lose_a, win2_a), n1 + n2


@triton.jit
def _take(acc, coef, rows, mask, w_ptr, stride_w, d, d_mask, GATHER: tl.constexpr):
    """Gather the picked rows (GATHER), or only consume the picks so that the picking is not compiled away."""
    if GATHER:
        return accumulate_rows(acc, coef, rows, mask, w_ptr, stride_w, d, d_mask)
    return acc + tl.sum(coef + rows.to(tl.float32), axis=0)


@triton.jit
def _pick_groups(acc, a, f, rank, n, first, w_ptr, stride_w, d, d_mask, GROUP: tl.constexpr, GATHER: tl.constexpr):
    for g0 in range(first, n, GROUP):
        j = g0 + tl.arange(0, GROUP)
        idx, val = pick_nonzeros(a, f, rank, j)
        acc = _take(acc, val, idx, j < n, w_ptr, stride_w, d, d_mask, GATHER)
    return acc


@triton.jit
def _chunk(a, f, acc, w_ptr, stride_w, d, d_mask, GROUP: tl.constexpr, STAGE: tl.constexpr):
    if STAGE == 0:
        acc += tl.sum(a, axis=0)
    elif STAGE >= 4:
        nz = a != 0
        none = tl.full(f.shape, 2**31 - 1, tl.int32)
        f1, a1, f2, a2, n = tl.reduce((tl.where(nz, f, none), a, none, tl.zeros_like(a), nz.to(tl.int32)), 0,
                                      _two_smallest)
        if n > 0:
            two = tl.arange(0, 2)
            acc = _take(acc, tl.where(two == 0, a1, a2), tl.where(two == 0, f1, f2), two < n, w_ptr, stride_w, d,
                        d_mask, STAGE == 5)
            if n > 2:
                _, rank = rank_nonzeros(a)
                acc = _pick_groups(acc, a, f, rank, n, 2, w_ptr, stride_w, d, d_mask, GROUP, STAGE == 5)
    else:
        n, rank = rank_nonzeros(a)
        if STAGE == 1:
            acc += n.to(tl.float32)
        elif n > 0:
            acc = _pick_groups(acc, a, f, rank, n, 0, w_ptr, stride_w, d, d_mask, GROUP, STAGE == 3)
    return acc


@triton.jit
def _split_setup(a_ptr, n_in, stride_a, chunks_per_split, n_splits, BLOCK_F: tl.constexpr):
    """(row pointer, first chunk, end chunk, end feature) of this program's (row, split)."""
    row = (tl.program_id(0) // n_splits).to(tl.int64)
    c_begin = (tl.program_id(0) % n_splits) * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, tl.cdiv(n_in, BLOCK_F))
    return a_ptr + row * stride_a, c_begin, c_end, tl.minimum(n_in, c_end * BLOCK_F)


@triton.jit
def scan_probe_kernel(a_ptr, w_ptr, out_ptr, n_in, n_out, stride_a, stride_w, chunks_per_split, n_splits,
                      BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, GROUP: tl.constexpr, STAGE: tl.constexpr,
                      AHEAD: tl.constexpr):
    row_ptr, c_begin, c_end, f_end = _split_setup(a_ptr, n_in, stride_a, chunks_per_split, n_splits, BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < n_out
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    f0 = c_begin * BLOCK_F + tl.arange(0, BLOCK_F)
    a0 = tl.load(row_ptr + f0, mask=f0 < f_end, other=0.0)
    a1 = a0
    a2 = a0
    if AHEAD >= 2:
        a1 = tl.load(row_ptr + f0 + BLOCK_F, mask=f0 + BLOCK_F < f_end, other=0.0)
    if AHEAD >= 3:
        a2 = tl.load(row_ptr + f0 + 2 * BLOCK_F, mask=f0 + 2 * BLOCK_F < f_end, other=0.0)
    for c in range(c_begin, c_end):
        f = c * BLOCK_F + tl.arange(0, BLOCK_F)
        a = a0.to(tl.float32)
        f_new = f + AHEAD * BLOCK_F
        a_new = tl.load(row_ptr + f_new, mask=f_new < f_end, other=0.0)
        if AHEAD == 1:
            a0 = a_new
        elif AHEAD == 2:
            a0 = a1
            a1 = a_new
        else:
            a0 = a1
            a1 = a2
            a2 = a_new
        acc = _chunk(a, f, acc, w_ptr, stride_w, d, d_mask, GROUP, STAGE)
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * n_out + d, acc, mask=d_mask)


@triton.jit
def scatter_probe_kernel(a_ptr, w_ptr, out_ptr, list_f_ptr, list_a_ptr, n_in, n_out, stride_a, stride_w,
                         chunks_per_split, n_splits, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                         CAP: tl.constexpr, KB: tl.constexpr):
    """Each chunk's non-zeros are written (rank order) to this program's list in global memory, without waiting;
    after the scan, one barrier, then the list is read back and its W rows gathered KB at a time."""
    pid = tl.program_id(0)
    row_ptr, c_begin, c_end, f_end = _split_setup(a_ptr, n_in, stride_a, chunks_per_split, n_splits, BLOCK_F)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < n_out
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = pid.to(tl.int64) * CAP
    f0 = c_begin * BLOCK_F + tl.arange(0, BLOCK_F)
    a0 = tl.load(row_ptr + f0, mask=f0 < f_end, other=0.0)
    total = tl.zeros([], dtype=tl.int32)
    for c in range(c_begin, c_end):
        f = c * BLOCK_F + tl.arange(0, BLOCK_F)
        a = a0.to(tl.float32)
        f_new = f + BLOCK_F
        a0 = tl.load(row_ptr + f_new, mask=f_new < f_end, other=0.0)
        n, rank = rank_nonzeros(a)
        pos = total + rank
        keep = (rank >= 0) & (pos < CAP)
        tl.store(list_f_ptr + base + pos, f, mask=keep)
        tl.store(list_a_ptr + base + pos, a, mask=keep)
        total += n
    tl.debug_barrier()
    kept = tl.minimum(total, CAP)
    for k0 in range(0, kept, KB):
        k = k0 + tl.arange(0, KB)
        idx = tl.load(list_f_ptr + base + k, mask=k < kept, other=0)
        val = tl.load(list_a_ptr + base + k, mask=k < kept, other=0.0)
        acc = accumulate_rows(acc, val, idx, k < kept, w_ptr, stride_w, d, d_mask)
    tl.store(out_ptr + pid.to(tl.int64) * n_out + d, acc, mask=d_mask)


LISTS = {}


def run(a, w, out, mult, stage, ahead, block_f=1024, group=2, warps=None):
    B, F = a.shape
    D = w.shape[1]
    block_d = triton.next_power_of_2(D)
    n_chunks = triton.cdiv(F, block_f)
    programs = mult * torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else mult * 132
    n_splits = max(1, min(n_chunks, triton.cdiv(programs, B)))
    cps = triton.cdiv(n_chunks, n_splits)
    n_splits = triton.cdiv(n_chunks, cps)
    warps = warps or max(1, min(4, block_d * w.element_size() // 512))
    if stage == SCATTER:
        cap = 256
        key = (B * n_splits, cap)
        if key not in LISTS:
            LISTS[key] = (torch.empty(B * n_splits * cap, dtype=torch.int32, device=a.device),
                          torch.empty(B * n_splits * cap, dtype=torch.float32, device=a.device))
        lf, la = LISTS[key]
        scatter_probe_kernel[(B * n_splits,)](a, w, out, lf, la, F, D, a.stride(0), w.stride(0), cps, n_splits,
                                              BLOCK_D=block_d, BLOCK_F=block_f, CAP=cap,
                                              KB=max(2, min(32, 8192 // block_d)), num_warps=warps)
        return n_splits
    scan_probe_kernel[(B * n_splits,)](a, w, out, F, D, a.stride(0), w.stride(0), cps, n_splits, BLOCK_D=block_d,
                                       BLOCK_F=block_f, GROUP=group, STAGE=stage, AHEAD=ahead, num_warps=warps)
    return n_splits


def main():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name())
    shapes = [(32, 131072, 512, 128), (256, 65536, 768, 64), (32, 65536, 768, 64)]
    for (B, F, D, l0), dtype in itertools.product(shapes, [torch.float32, torch.bfloat16]):
        per_set = B * F * dtype.itemsize + F * D * dtype.itemsize
        n_sets = max(2, min(16, (3 * l2) // per_set + 1))
        sets = [(acts_with_l0(B, F, l0, dtype), torch.randn(F, D, device="cuda", dtype=dtype) / 16)
                for _ in range(n_sets)]
        out = torch.empty(2048, D, device="cuda")
        copy = time_graph(lambda a, w: a.clone(), sets)
        csr = time_graph(lambda c, w: torch.sparse.mm(c, w), [(a.to_sparse_csr(), w) for a, w in sets])
        lib = time_graph(matmul_skip_zeros, sets)
        print(f"B={B} F={F} D={D} L0={l0} {dtype}: acts clone {copy:.2f} us, cuSPARSE prebuilt {csr:.2f} us, "
              f"library scan (split partials summed) {lib:.2f} us")
        names = ["read", "rank", "pick", "full", "pick2", "full2", "scatter"]
        for stage, mult, warps in itertools.product(range(7), [4, 8, 16], [1, 2, 4]):
            t = time_graph(lambda a, w: run(a, w, out, mult, stage, 1, warps=warps), sets)
            print(f"  {names[stage]:7s} x{mult:<2d} w{warps} {t:8.2f} us", flush=True)
        for ahead, mult in itertools.product([2, 3], [4, 8]):
            t = time_graph(lambda a, w: run(a, w, out, mult, FULL, ahead), sets)
            print(f"  full    x{mult:<2d} loads {ahead} chunks ahead {t:8.2f} us", flush=True)
        ref = sets[0][0].double() @ sets[0][1].double()
        for stage in [FULL, SCATTER]:
            out.zero_()
            n_splits = run(*sets[0], out, 4, stage, 1)
            total = out[:B * n_splits].double().view(B, n_splits, D).sum(1)
            print("  err", stage, float((total - ref).abs().max() / ref.abs().max()))

if __name__ == "__main__":
    main()
