"""Packed storage of a row-block layer's factors (:mod:`sparsefuse.sparse.block_pack`): only the fired pairs are
kept, grouped by (block, chunk); the round trip is exact for every block that fits (zeros where the gate did
not fire), blocks past the capacity are recomputed from the input and weights (float64 reference), the per-column
firing counts come back for every block, and the spill counter counts the recomputed ones. Interpreter: fp32/fp16."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.sparse import block_sddmm, dense_to_row_block_pattern
from sparsefuse.sparse.block_pack import pack_block_factors, spilled_blocks, unpack_block_factors
from sparsefuse.testing import assert_close_to_reference


def _layer(M, K, N, dtype, device, bias, seed=0, block_rows=16, tile=64):
    g = torch.Generator().manual_seed(seed)
    x, wg, wu = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((M, K), (N, K), (N, K)))
    wg, wu = wg / K**0.5, wu / K**0.5
    bg = torch.full((N,), -0.6, dtype=torch.float64) if bias else None
    bu = torch.randn(N, generator=g, dtype=torch.float64) if bias else None
    x, wg, wu = (t.to(device=device, dtype=dtype) for t in (x, wg, wu))
    bg, bu = (t.to(device=device, dtype=dtype) if t is not None else None for t in (bg, bu))
    pre = F.linear(x, wg, bg)
    pattern = dense_to_row_block_pattern(pre, tile, block_rows, relu=True, sort_rows=M >= 64)
    f = block_sddmm(pattern, pre, x, wu, bu, relu=True, out_dtype=dtype, factors=True)
    return x, wg, bg, wu, bu, f


def _filled(values, f, M):
    """The [M, width] values on each block's first counts[b] slots (what the products read), others zeroed."""
    width = values.shape[1]
    slot = torch.arange(width, device=values.device)[None, :]
    block = torch.arange(M, device=values.device) // f.gate.block_rows
    return torch.where(slot < f.gate.counts[block].long()[:, None], values, 0)


def _expected_offsets(f):
    """[n_blocks * n_chunks + 1]: the running sum of the non-zeros per (block, chunk)."""
    flat = f.chunk_nnz.cpu().reshape(-1).to(torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), flat.cumsum(0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("given_offsets", [False, True])
@pytest.mark.parametrize(
    "M, fit_blocks, bias", [(40, None, True), (40, 1, True), (40, 0, False), (70, 2, True), (1, 0, True)]
)
def test_round_trip_and_recompute(M, fit_blocks, bias, given_offsets, dtype, device):
    x, wg, bg, wu, bu, f = _layer(M, 24, 96, dtype, device, bias=bias, seed=M)
    assert_backend(x)
    counts, rows = f.gate.counts, f.gate.block_rows
    n_blocks, n_chunks = f.chunk_nnz.shape
    offsets = _expected_offsets(f)
    block_ends = offsets[n_chunks::n_chunks]  # [n_blocks]
    assert torch.equal(f.block_nnz.cpu().to(torch.int64), block_ends - offsets[:-1:n_chunks])
    capacity = int(offsets[-1]) if fit_blocks is None else int(block_ends[fit_blocks - 1]) if fit_blocks else 0
    given = offsets.to(device) if given_offsets else None  # as the training step's schedule launch writes them
    spilled_before = int(spilled_blocks(device))
    with track_launches() as launched:
        packed = pack_block_factors(f, capacity, given)
        gate, up, table = unpack_block_factors(
            packed, f.gate.indices, counts, f.gate.row_order, rows, f.chunk, x, wg, bg, wu, bu
        )
    assert launched == {"block_pack_kernel": 1, "block_unpack_kernel": 1}, launched
    assert packed.gate.shape == (capacity,) and packed.slots.dtype == torch.int16
    assert torch.equal(packed.offsets.cpu(), offsets) and (given is None or packed.offsets is given)
    fits = (block_ends <= capacity).cpu()
    expected_spills = int((~fits & (f.block_nnz.cpu() > 0)).sum())
    assert int(spilled_blocks(device)) - spilled_before == expected_spills
    block_of_row = torch.arange(M) // rows
    copied = fits[block_of_row]
    g_ref, u_ref = _filled(f.gate.values, f, M).cpu(), _filled(f.up.values, f, M).cpu()
    u_ref = torch.where(g_ref != 0, u_ref, 0)  # up is kept where the gate fired: the backward reads no other
    g_out, u_out = _filled(gate, f, M).cpu(), _filled(up, f, M).cpu()
    assert torch.equal(g_out[copied], g_ref[copied]) and torch.equal(u_out[copied], u_ref[copied])
    # what is kept: the fitting blocks' non-zeros, chunk by chunk (in any order within a chunk)
    width, chunk = g_ref.shape[1], f.chunk
    for b in range(n_blocks):
        if not fits[b]:
            continue
        for c in range(n_chunks):
            lo, hi = int(offsets[b * n_chunks + c]), int(offsets[b * n_chunks + c + 1])
            tile = g_ref[b * rows : (b + 1) * rows, c * chunk : min((c + 1) * chunk, width)]
            kept = packed.gate[lo:hi].cpu().nan_to_num(7.0).sort().values
            assert torch.equal(kept, tile[tile != 0].nan_to_num(7.0).sort().values)
    if (~copied).any():  # recomputed: the float64 products on the same slots
        order = f.gate.row_order.long().cpu() if f.gate.row_order is not None else torch.arange(M)
        x64 = x.double().cpu()[order]
        listed = _filled(torch.ones_like(gate), f, M).cpu().bool()
        cols = torch.where(listed, f.gate.indices.long().cpu()[block_of_row], 0)  # [M, width]; unread slots -> 0
        pre64 = (x64[:, None, :] * wg.double().cpu()[cols]).sum(-1)
        up64 = (x64[:, None, :] * wu.double().cpu()[cols]).sum(-1)
        if bias:
            pre64, up64 = pre64 + bg.double().cpu()[cols], up64 + bu.double().cpu()[cols]
        live = listed & ~copied[:, None]
        assert_close_to_reference(g_out[live], torch.relu(pre64)[live], dtype=dtype, name="recomputed gate")
        assert_close_to_reference(u_out[live], up64[live], dtype=dtype, name="recomputed up")
        assert not torch.isnan(g_out[live]).any()
    # the column counts (block b in row b + 1, the transpose's table) agree with the gate the backward reads,
    # recomputed blocks included, and with the forward's counts where the block was copied
    assert table.shape == (n_blocks + 1, 96) and table.dtype == torch.int64 and not table[0].any()
    assert torch.equal(table[1:][fits.to(table.device)].cpu(), f.column_counts[fits.to(table.device)].cpu().long())
    for b in range(n_blocks):
        c = int(counts[b])
        fired = (gate[b * rows : (b + 1) * rows, :c] != 0).sum(0).cpu()
        listed = f.gate.indices[b, :c].long()
        assert torch.equal(table[b + 1, listed].cpu(), fired.to(torch.int64))
        unlisted = torch.ones(96, dtype=torch.bool, device=table.device)
        unlisted[listed] = False
        assert not table[b + 1, unlisted].any()


def test_empty_batch(device):
    x, wg, bg, wu, bu, f = _layer(0, 8, 32, torch.float32, device, bias=True)
    packed = pack_block_factors(f, 0)
    gate, up, table = unpack_block_factors(packed, f.gate.indices, f.gate.counts, None, 16, f.chunk, x, wg, bg, wu, bu)
    assert gate.shape == (0, f.gate.values.shape[1]) and up.shape == gate.shape and table.shape == (1, 32)


def test_counts_follow_the_stored_gate_when_out_dtype_is_narrower(device):
    """fp32 pre-activations kept as fp16: a tiny positive gate rounds to 0 when stored, so it must not be counted --
    the pack places exactly the stored non-zeros (else the unpack would read codes it never wrote)."""
    x, wg, bg, wu, bu, _ = _layer(40, 24, 96, torch.float32, device, bias=True, seed=9)
    pre = F.linear(x, wg, bg)
    pre = torch.where(pre > 0.3, torch.full_like(pre, 1e-9), pre)  # below fp16's smallest subnormal
    pattern = dense_to_row_block_pattern(pre, 64, 16, relu=True)
    f = block_sddmm(pattern, pre, x, wu, bu, relu=True, out_dtype=torch.float16, factors=True)
    stored = int((_filled(f.gate.values, f, 40) != 0).sum())
    assert int(f.chunk_nnz.sum()) == int(f.block_nnz.sum()) == int(f.row_counts.sum()) == stored
    packed = pack_block_factors(f, stored)
    gate, up, table = unpack_block_factors(
        packed, f.gate.indices, f.gate.counts, f.gate.row_order, 16, f.chunk, x, wg, bg, wu, bu
    )
    assert torch.equal(_filled(gate, f, 40), _filled(f.gate.values, f, 40))
    assert int(table.sum()) == stored


def test_bad_layouts_are_refused(device):
    x, wg, bg, wu, bu, f = _layer(40, 24, 96, torch.float32, device, bias=True, seed=3)
    n_blocks, n_chunks = f.chunk_nnz.shape
    with pytest.raises(ValueError, match=r"offsets must be \[\d+\] int64"):
        pack_block_factors(f, 100, torch.zeros(n_blocks * n_chunks, dtype=torch.int64, device=device))
    packed = pack_block_factors(f, 100)
    with pytest.raises(ValueError, match="chunks the pairs were packed in do not match"):  # another chunk size
        unpack_block_factors(packed, f.gate.indices, f.gate.counts, None, 16, 2 * f.chunk, x, wg, bg, wu, bu)
    with pytest.raises(ValueError, match="entries do not match"):  # offsets of another layout
        unpack_block_factors(
            packed._replace(offsets=packed.offsets[1:]),
            f.gate.indices,
            f.gate.counts,
            None,
            16,
            f.chunk,
            x,
            wg,
            bg,
            wu,
            bu,
        )
    with pytest.raises(ValueError, match="int16 codes"):
        unpack_block_factors(packed, f.gate.indices, f.gate.counts, None, 512, 128, x, wg, bg, wu, bu)


def test_capacity_inside_a_block_spills_that_block(device):
    """A capacity that ends inside a block's pairs: that block and the ones after it are recomputed, the ones
    before it copied."""
    x, wg, bg, wu, bu, f = _layer(70, 24, 96, torch.float32, device, bias=True, seed=11)
    n_blocks, n_chunks = f.chunk_nnz.shape
    ends = _expected_offsets(f)[n_chunks::n_chunks]
    capacity = int(ends[0]) + max(1, int(ends[1] - ends[0]) // 2)  # half of block 1
    before = int(spilled_blocks(device))
    packed = pack_block_factors(f, capacity)
    gate, _, _ = unpack_block_factors(
        packed, f.gate.indices, f.gate.counts, f.gate.row_order, 16, f.chunk, x, wg, bg, wu, bu
    )
    live = f.block_nnz.cpu() > 0
    assert int(spilled_blocks(device)) - before == int(live[1:].sum())
    rows = f.gate.block_rows
    assert torch.equal(_filled(gate, f, 70)[:rows].cpu(), _filled(f.gate.values, f, 70)[:rows].cpu())


def test_nan_gates_are_kept_as_fired(device):
    """A NaN pre-activation fires (as torch.relu keeps NaN): it is counted, packed and laid out again as NaN."""
    x, wg, bg, wu, bu, _ = _layer(40, 24, 96, torch.float32, device, bias=True, seed=12)
    pre = F.linear(x, wg, bg)
    pre[3, 5] = pre[17, 40] = pre[39, 95] = float("nan")
    pattern = dense_to_row_block_pattern(pre, 64, 16, relu=True)
    f = block_sddmm(pattern, pre, x, wu, bu, relu=True, out_dtype=torch.float32, factors=True)
    stored = int((_filled(f.gate.values, f, 40) != 0).sum())  # NaN != 0
    assert int(f.chunk_nnz.sum()) == stored
    packed = pack_block_factors(f, stored)
    gate, _, table = unpack_block_factors(
        packed, f.gate.indices, f.gate.counts, f.gate.row_order, 16, f.chunk, x, wg, bg, wu, bu
    )
    ours, ref = _filled(gate, f, 40).cpu(), _filled(f.gate.values, f, 40).cpu()
    assert int(ours.isnan().sum()) == 3 and torch.equal(ours.nan_to_num(7.0), ref.nan_to_num(7.0))
    assert int(table.sum()) == stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recompute_takes_the_forwards_fatrelu_and_drelu_gate(dtype, device):
    """A block recomputed past the capacity comes back with the gate the forward kept: FATReLU's values above the
    threshold alone (and counted so), dReLU's up relu'd -- as the copied blocks have them."""
    M, K, N, threshold = 40, 24, 96, 0.25
    g = torch.Generator().manual_seed(21)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    wg, wu = ((torch.randn(N, K, generator=g) / K**0.5).to(device=device, dtype=dtype) for _ in range(2))
    pre = F.linear(x, wg)
    pattern = dense_to_row_block_pattern(pre, 64, 16, relu=True, threshold=threshold)
    f = block_sddmm(
        pattern, pre, x, wu, relu=True, threshold=threshold, up_relu=True, out_dtype=dtype, factors=True,
        column_counts=True,
    )  # fmt: skip
    kept = _filled(f.gate.values, f, M).cpu()
    assert bool((kept == 0).logical_or(kept > threshold).all()) and bool((kept > threshold).any())
    unpacked = []
    for capacity in (int(f.block_nnz.sum()), 0):  # every block copied, then every block recomputed
        packed = pack_block_factors(f, capacity)
        gate, up, table = unpack_block_factors(
            packed, f.gate.indices, f.gate.counts, f.gate.row_order, 16, f.chunk, x, wg, None, wu, None,
            threshold=threshold, up_relu=True,
        )  # fmt: skip
        unpacked.append((_filled(gate, f, M).cpu(), _filled(up, f, M).cpu(), table.cpu()))
    (g_copy, u_copy, t_copy), (g_re, u_re, t_re) = unpacked
    assert torch.equal(g_re != 0, g_copy != 0) and torch.equal(t_re, t_copy)
    assert torch.equal(t_copy[1:], f.column_counts.cpu().long())
    torch.testing.assert_close(g_re, g_copy, rtol=1e-3, atol=1e-3)
    fired = g_copy != 0
    assert bool((u_re[fired] >= 0).all()) and bool((u_re[fired] == 0).any())  # relu'd, some up <= 0
    torch.testing.assert_close(u_re[fired], u_copy[fired], rtol=1e-3, atol=1e-3)
