"""Packed storage of a row-block layer's factors (:mod:`sparsefuse.sparse.block_pack`): the round trip is exact for
every block that fits, blocks past the capacity are recomputed from the input and weights (float64 reference) with
their per-column firing counts, and the spill counter counts them. Interpreter: fp32/fp16."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.sparse import block_sddmm, dense_to_row_block_pattern
from sparsefuse.sparse.block_pack import block_offsets, pack_block_factors, spilled_blocks, unpack_block_factors
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "M, fit_blocks, bias", [(40, None, True), (40, 1, True), (40, 0, False), (70, 2, True), (1, 0, True)]
)
def test_round_trip_and_recompute(M, fit_blocks, bias, dtype, device):
    x, wg, bg, wu, bu, f = _layer(M, 24, 96, dtype, device, bias=bias, seed=M)
    assert_backend(x)
    counts, rows = f.gate.counts, f.gate.block_rows
    offsets = block_offsets(counts, rows)
    n_blocks = counts.shape[0]
    capacity = int(offsets[-1]) if fit_blocks is None else int(offsets[fit_blocks])
    spilled_before = int(spilled_blocks(device))
    with track_launches() as launched:
        packed = pack_block_factors(f.gate.values, f.up.values, counts, rows, capacity)
        forward_counts = f.column_counts.clone()
        gate, up, table = unpack_block_factors(
            packed, f.gate.indices, counts, f.gate.row_order, f.column_counts, rows, x, wg, bg, wu, bu
        )
    assert launched == {"block_pack_kernel": 1, "block_unpack_kernel": 1}, launched
    assert packed.gate.shape == (capacity,) and packed.offsets.dtype == torch.int64
    fits = (offsets[1:] <= capacity).cpu()
    expected_spills = int((~fits & (counts.cpu() > 0)).sum())
    assert int(spilled_blocks(device)) - spilled_before == expected_spills
    block_of_row = torch.arange(M) // rows
    copied = fits[block_of_row]
    g_ref, u_ref = _filled(f.gate.values, f, M).cpu(), _filled(f.up.values, f, M).cpu()
    g_out, u_out = _filled(gate, f, M).cpu(), _filled(up, f, M).cpu()
    assert torch.equal(g_out[copied], g_ref[copied]) and torch.equal(u_out[copied], u_ref[copied])
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
    # recomputed blocks included; the forward's counts are left as they were
    assert table.shape == (n_blocks + 1, 96) and table.dtype == torch.int64 and not table[0].any()
    assert torch.equal(f.column_counts, forward_counts)
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
    packed = pack_block_factors(f.gate.values, f.up.values, f.gate.counts, 16, 0)
    gate, up, table = unpack_block_factors(
        packed, f.gate.indices, f.gate.counts, None, f.column_counts, 16, x, wg, bg, wu, bu
    )
    assert gate.shape == (0, f.gate.values.shape[1]) and up.shape == gate.shape and table.shape == (1, 32)
