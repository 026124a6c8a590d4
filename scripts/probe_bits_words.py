"""Probe: why the bits -> ELL pass (bits_to_sparse_kernel) takes 55 us at the Gemma 2B decode shape for 33 MB of
bits, and two variants of it. Its cost tracks the size of its cumsum (the previous scatter kernel's 4096-wide cumsums
cost about the same per element), so: ``grouped`` loads a chunk of words as [G, 32] and ranks them with a cumsum
along the 32 (within a warp) plus a cumsum over the G group totals; ``rows`` gives a program R rows as a
[R, BLOCK_W] tile ranked along axis 1. Same output as the library's kernel (checked). CUDA graphs over rotated inputs.
``--stages``: where the library kernel's time goes: its copy with the value loads dropped, with the placement rounds
dropped (popcount, cumsum and counts only), and with the next chunk's words loaded ahead.
Usage: cd scripts && python probe_bits_words.py [--stages]"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from probe_decode import acts_with_l0, time_graph
from sparsefuse.sparse import compact
from sparsefuse.sparse.compact import _lowest_bit, _popcount


@triton.jit
def grouped_kernel(bits_ptr, dense_ptr, counts_ptr, values_ptr, indices_ptr, n_words, stride_dense, width,
                   G: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = row * width
    filled = tl.zeros([], dtype=tl.int32)
    for w0 in range(0, n_words, G * 32):
        w = w0 + tl.arange(0, G)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
        word = tl.load(bits_ptr + row * n_words + w, mask=w < n_words, other=0).to(tl.uint32, bitcast=True)
        pc = _popcount(word)
        total = tl.sum(pc, axis=1)  # [G]
        slot = filled + (tl.cumsum(total, axis=0) - total)[:, None] + tl.cumsum(pc, axis=1) - pc
        rest = word
        for _ in range(tl.max(tl.max(pc, axis=1), axis=0)):
            live = rest != 0
            col = w * 32 + _lowest_bit(rest)
            keep = live & (slot < width)
            v = tl.load(dense_ptr + row * stride_dense + col, mask=keep, other=0.0)
            tl.store(values_ptr + base + slot, v, mask=keep)
            tl.store(indices_ptr + base + slot, col, mask=keep)
            slot += live.to(tl.int32)
            rest = rest & (rest - 1)
        filled += tl.sum(total, axis=0)
    tl.store(counts_ptr + row, filled)


@triton.jit
def rows_kernel(bits_ptr, dense_ptr, counts_ptr, values_ptr, indices_ptr, M, n_words, stride_dense, width,
                R: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    base = rows64 * width
    filled = tl.zeros([R], dtype=tl.int32)
    for w0 in range(0, n_words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)[None, :]
        word = tl.load(bits_ptr + rows64[:, None] * n_words + w, mask=row_mask[:, None] & (w < n_words),
                       other=0).to(tl.uint32, bitcast=True)  # fmt: skip
        pc = _popcount(word)
        slot = filled[:, None] + tl.cumsum(pc, axis=1) - pc
        rest = word
        for _ in range(tl.max(tl.max(pc, axis=1), axis=0)):
            live = rest != 0
            col = w * 32 + _lowest_bit(rest)
            keep = live & (slot < width)
            v = tl.load(dense_ptr + rows64[:, None] * stride_dense + col, mask=keep, other=0.0)
            tl.store(values_ptr + base[:, None] + slot, v, mask=keep)
            tl.store(indices_ptr + base[:, None] + slot, col, mask=keep)
            slot += live.to(tl.int32)
            rest = rest & (rest - 1)
        filled += tl.sum(pc, axis=1)
    tl.store(counts_ptr + rows, filled, mask=row_mask)


@triton.jit
def staged_kernel(bits_ptr, dense_ptr, counts_ptr, values_ptr, indices_ptr, n_words, stride_dense, width,
                  BLOCK_W: tl.constexpr, VALUES: tl.constexpr, ROUNDS: tl.constexpr, AHEAD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = row * width
    filled = tl.zeros([], dtype=tl.int32)
    w_next = tl.arange(0, BLOCK_W)
    word_next = tl.load(bits_ptr + row * n_words + w_next, mask=w_next < n_words, other=0)
    for w0 in range(0, n_words, BLOCK_W):
        if AHEAD:
            w, word = w_next, word_next.to(tl.uint32, bitcast=True)
            w_next = w + BLOCK_W
            word_next = tl.load(bits_ptr + row * n_words + w_next, mask=w_next < n_words, other=0)
        else:
            w = w0 + tl.arange(0, BLOCK_W)
            word = tl.load(bits_ptr + row * n_words + w, mask=w < n_words, other=0).to(tl.uint32, bitcast=True)
        pc = _popcount(word)
        if ROUNDS:
            slot = filled + tl.cumsum(pc, axis=0) - pc
            rest = word
            for _ in range(tl.max(pc, axis=0)):
                live = rest != 0
                col = w * 32 + _lowest_bit(rest)
                keep = live & (slot < width)
                if VALUES:
                    v = tl.load(dense_ptr + row * stride_dense + col, mask=keep, other=0.0)
                else:
                    v = tl.zeros(col.shape, dtype=values_ptr.dtype.element_ty)
                tl.store(values_ptr + base + slot, v, mask=keep)
                tl.store(indices_ptr + base + slot, col, mask=keep)
                slot += live.to(tl.int32)
                rest = rest & (rest - 1)
        filled += tl.sum(pc, axis=0)
    tl.store(counts_ptr + row, filled)


def staged(bits, a, width, values, rounds, ahead):
    v, i, c = outputs(a, width)
    staged_kernel[(a.shape[0],)](bits, a, c, v, i, bits.shape[1], a.stride(0), width, BLOCK_W=1024, VALUES=values,
                                 ROUNDS=rounds, AHEAD=ahead, num_warps=4)  # fmt: skip
    return v, i, c


def outputs(a, width):
    M = a.shape[0]
    return (torch.zeros(M, width, dtype=a.dtype, device=a.device),
            torch.zeros(M, width, dtype=torch.int32, device=a.device),
            torch.empty(M, dtype=torch.int32, device=a.device))  # fmt: skip


def library(bits, a, width, block_w, warps):
    v, i, c = outputs(a, width)
    compact.bits_to_sparse_kernel[(a.shape[0],)](bits, a, c, bits, v, i, bits.shape[1], a.stride(0), width,
                                                 BLOCK_W=block_w, MODE=1, num_warps=warps)  # fmt: skip
    return v, i, c


def grouped(bits, a, width, g, warps):
    v, i, c = outputs(a, width)
    grouped_kernel[(a.shape[0],)](bits, a, c, v, i, bits.shape[1], a.stride(0), width, G=g, num_warps=warps)
    return v, i, c


def by_rows(bits, a, width, r, block_w, warps):
    v, i, c = outputs(a, width)
    rows_kernel[(triton.cdiv(a.shape[0], r),)](bits, a, c, v, i, a.shape[0], bits.shape[1], a.stride(0), width,
                                               R=r, BLOCK_W=block_w, num_warps=warps)  # fmt: skip
    return v, i, c


def main(stages: bool = False) -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for B, F, l0, dtype in [(4096, 65536, 72, torch.bfloat16), (1024, 262144, 100, torch.bfloat16),
                            (1024, 131072, 72, torch.bfloat16), (1024, 32768, 100, torch.bfloat16),
                            (256, 65536, 64, torch.bfloat16)]:  # fmt: skip
        width = 2 * l0
        sets = []
        for _ in range(3):
            a = acts_with_l0(B, F, l0, dtype)
            sets.append((compact._row_bits(a, False), a))
        ref = library(*sets[0], width, 1024, 4)
        variants = {"library 1024/4w": lambda b, a: library(b, a, width, 1024, 4)}
        if stages:
            variants |= {"no value loads": lambda b, a: staged(b, a, width, False, True, False),
                         "no rounds (count only)": lambda b, a: staged(b, a, width, False, False, False),
                         "words loaded ahead": lambda b, a: staged(b, a, width, True, True, True),
                         "bits read (torch sum)": lambda b, a: b.sum(dtype=torch.int32)}  # fmt: skip
        for g, warps in [] if stages else [(8, 4), (16, 4), (32, 4), (16, 2), (32, 8)]:
            variants[f"grouped {g}x32/{warps}w"] = lambda b, a, g=g, w=warps: grouped(b, a, width, g, w)
        for r, bw, warps in [] if stages else [(2, 512, 4), (4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 128, 4), (4, 1024, 8)]:
            variants[f"rows {r}x{bw}/{warps}w"] = lambda b, a, r=r, bw=bw, w=warps: by_rows(b, a, width, r, bw, w)
        line = []
        for name, fn in variants.items():
            got = fn(*sets[0])
            same = not isinstance(got, tuple) or all(torch.equal(x, y) for x, y in zip(got, ref)) or name.startswith("no ")
            line.append(f"{name} {time_graph(fn, sets):.1f}{'' if same else ' (DIFFERS)'}")
        print(f"B={B} F={F} L0={l0} {str(dtype)[6:]} bits {B * F / 8e6:.1f} MB: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    import sys

    main(stages="--stages" in sys.argv)
