"""The backward products of the shared sparse core on row-block unions (:mod:`sparsefuse.sparse.block_grad`) against
float64 references: the sampled product with the gated chain rule in its epilogue, the accumulated block product,
the column grouping of the fired slots and the transposed products. Interpreter: fp32/fp16 (interpreted bf16
tl.dot is wrong); the GPU test adds bf16 at the 1.5B layer's shape."""

import dataclasses

import pytest
import torch
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.sparse import (
    BlockELL,
    block_ell_sddmm,
    block_ell_transpose,
    block_sddmm,
    block_sparse_matmul,
    dense_to_row_block_pattern,
    transposed_matmul,
)
from sparsefuse.sparse.block_grad import column_count_table
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference


def _factors(M, K, N, dtype, device, sort_rows, block_rows=16, tile=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, wg, wu, wd = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((M, K), (N, K), (N, K), (N, K)))
    wg, wu, wd = wg / K**0.5, wu / K**0.5, wd / K**0.5
    bias = torch.randn(N, generator=g, dtype=torch.float64)
    pre = x @ wg.t() - 0.8
    if M > 2:
        pre[1] = 1.0  # a token firing every neuron
        pre[2] = -1.0  # one firing none
    x, wu, wd, bias, pre = (t.to(device=device, dtype=dtype) for t in (x, wu, wd, bias, pre))
    pattern = dense_to_row_block_pattern(pre, tile, block_rows, relu=True, sort_rows=sort_rows)
    return x, wu, wd, bias, pre, block_sddmm(pattern, pre, x, wu, bias, relu=True, out_dtype=dtype, factors=True)


def _dense(sparse: BlockELL, values: torch.Tensor) -> torch.Tensor:
    return BlockELL(
        values, sparse.indices, sparse.counts, sparse.n_cols, sparse.block_rows, sparse.row_order
    ).to_dense()


def _check(M, K, N, dtype, device, sort_rows, **kw):
    x, wu, wd, bias, pre, f = _factors(M, K, N, dtype, device, sort_rows, **kw)
    G = torch.relu(pre.double().cpu())
    fired = G != 0
    U = (x.double() @ wu.double().t() + bias.double()).cpu()
    # forward factors and their statistics
    assert_close_to_reference(_dense(f.gate, f.gate.values), G, name="gate")
    assert_close_to_reference(_dense(f.up, f.up.values).cpu() * fired, U * fired, name="up")
    assert torch.equal(f.row_counts.cpu(), fired.sum(1, dtype=torch.int32))
    assert torch.equal(f.column_counts.sum(0).cpu(), fired.sum(0))
    assert torch.equal(f.neuron_counts.cpu(), fired.sum(0, dtype=torch.int32))
    assert torch.equal(f.counts.cpu(), torch.cat([f.row_counts, f.neuron_counts]).cpu())
    assert_close_to_reference(f.gate_sum.reshape(1), G.sum().reshape(1), dtype=torch.float32, name="gate sum")
    # backward: dh on the slots with the chain rule, dx from two accumulated products
    dy = torch.randn(M, K, dtype=dtype, device=device)
    gate_grad = torch.tensor([0.25], device=device)
    d_up, d_pre = block_ell_sddmm(f.gate, dy, wd, gate=f.gate.values, up=f.up.values, gate_grad=gate_grad)
    DH = (dy.double() @ wd.double().t()).cpu()
    DU, DP = DH * G, (DH * U + 0.25) * fired
    assert_close_to_reference(_dense(f.gate, d_up).cpu(), DU, name="d_up")
    assert_close_to_reference(_dense(f.gate, d_pre).cpu(), DP, name="d_pre")
    # each later product is checked on the kernels' own rounded inputs, with the summation-order allowance
    DUk, DPk = _dense(f.gate, d_up).double().cpu(), _dense(f.gate, d_pre).double().cpu()
    wuc, wdc = wu.double().cpu(), wd.double().cpu()
    dx = block_sparse_matmul(BlockELL(d_up, f.gate.indices, f.gate.counts, N, f.gate.block_rows, f.gate.row_order), wu)
    dx = block_sparse_matmul(
        BlockELL(d_pre, f.gate.indices, f.gate.counts, N, f.gate.block_rows, f.gate.row_order), wd, accumulate=dx
    )
    slack = accumulation_allowance(DUk, wuc) + accumulation_allowance(DPk, wdc)
    if dtype != torch.float32:  # the first product is rounded to the output dtype before the second is added
        slack = slack + torch.finfo(dtype).eps * (DUk @ wuc).abs()
    assert_close_to_reference(dx, DUk @ wuc + DPk @ wdc, extra_abs=slack, name="dx")
    # the fired slots by column, and the weight gradients in one pass
    given = f.column_counts.clone()
    csc = block_ell_transpose(f.gate, f.column_counts)
    assert torch.equal(f.column_counts, given)  # only read
    recount = block_ell_transpose(f.gate)  # the counting pass gives the same grouping
    table = column_count_table(f.column_counts)  # ... and so does a table of the counts, taken over
    tabled = block_ell_transpose(f.gate, count_table=table)
    assert torch.equal(table, column_count_table(f.column_counts).cumsum(0))  # overwritten with its running sums
    with pytest.raises(ValueError, match="contiguous"):  # a strided table could not be overwritten in place
        block_ell_transpose(f.gate, count_table=column_count_table(f.column_counts).t().contiguous().t())
    nnz = int(fired.sum())
    assert int(csc.offsets[-1]) == nnz
    for other in (recount, tabled):
        assert torch.equal(csc.offsets, other.offsets) and torch.equal(csc.src[:nnz], other.src[:nnz])
    assert torch.equal(csc.to_dense(f.gate.values).cpu().double(), G.to(dtype).double())
    with track_launches() as launched:
        out, sums = transposed_matmul(
            csc, x, d_pre, d_up, mode="two", third=(dy, f.gate.values, f.up.values), bias=True
        )
    assert launched["transposed_matmul_kernel"] == 1
    H = _dense(f.gate, f.gate.values).double().cpu() * _dense(f.gate, f.up.values).double().cpu()
    xc, dyc = x.double().cpu(), dy.double().cpu()
    h_slack = accumulation_allowance(H.t(), dyc) + torch.finfo(dtype).eps * (H.abs().t() @ dyc.abs())  # h rounded
    ones = torch.ones(M, 1, dtype=torch.float64)
    assert_close_to_reference(out[0], DPk.t() @ xc, extra_abs=accumulation_allowance(DPk.t(), xc), name="dW_gate")
    assert_close_to_reference(out[1], DUk.t() @ xc, extra_abs=accumulation_allowance(DUk.t(), xc), name="dW_up")
    assert_close_to_reference(out[2], H.t() @ dyc, extra_abs=h_slack, name="dW_down")
    for name, ours, D in (("db_gate", sums[0], DPk), ("db_up", sums[1], DUk)):
        slack = accumulation_allowance(D.t(), ones).flatten()
        assert_close_to_reference(ours, D.sum(0), dtype=torch.float32, extra_abs=slack, name=name)
    (one,), _ = transposed_matmul(csc, dy, f.gate.values, f.up.values, mode="product")
    assert_close_to_reference(one, H.t() @ dyc, extra_abs=h_slack, name="dW_down alone")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sort_rows", [False, True])
def test_backward_products_match_float64(dtype, sort_rows, device):
    assert_backend(torch.empty(0, device=device))
    _check(40, 24, 100, dtype, device, sort_rows)  # N past a whole tile, M past whole blocks


def test_weight_gradients_do_not_depend_on_the_launch_order(device, plan):
    # past transposed_scheduled_groups column groups the groups launch in their natural order: the same sums, bit
    # for bit (each column's terms are added in one fixed order either way), and no schedule launch
    x, wu, wd, bias, pre, f = _factors(40, 24, 100, torch.float32, device, True)
    csc = block_ell_transpose(f.gate, f.column_counts)
    args = (csc, x, f.gate.values, f.up.values)
    with track_launches() as launched:
        scheduled, sums = transposed_matmul(*args, mode="two", bias=True)
    assert launched["heavy_first_schedule_kernel"] == 1
    plan(sparse_core={"transposed_scheduled_groups": 0})
    with track_launches() as launched:
        natural, natural_sums = transposed_matmul(*args, mode="two", bias=True)
    assert launched["heavy_first_schedule_kernel"] == 0 and launched["transposed_matmul_kernel"] == 1
    for a, b in zip((*scheduled, *sums), (*natural, *natural_sums)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("K", [24, 64])  # features past the interpreter's 32-wide tile: ragged, and whole tiles
def test_weight_gradients_take_every_row_path(K, device, plan):
    """The transposed products gather each entry's row from the transposition's stored matrix rows; a BlockCSC
    without them finds the row through the row order, and past 2**31 element offsets the gathers use 64-bit
    offsets: the same sums bit for bit (the same terms in the same order)."""
    x, wu, wd, bias, pre, f = _factors(40, K, 100, torch.float32, device, True)
    csc = block_ell_transpose(f.gate, f.column_counts)
    nnz = int(csc.offsets[-1])
    slot_rows = csc.src[:nnz].long() // csc.width
    assert torch.equal(csc.rows[:nnz].long(), f.gate.row_order[slot_rows].long())
    dy = torch.randn(40, K, device=device)
    kwargs = dict(mode="two", third=(dy, f.gate.values, f.up.values), bias=True)
    want, want_sums = transposed_matmul(csc, x, f.gate.values, f.up.values, **kwargs)
    looked_up, looked_up_sums = transposed_matmul(
        dataclasses.replace(csc, rows=None), x, f.gate.values, f.up.values, **kwargs
    )
    plan(sparse_core={"offsets_32_limit": 0})
    wide, wide_sums = transposed_matmul(csc, x, f.gate.values, f.up.values, **kwargs)
    for got, sums in ((looked_up, looked_up_sums), (wide, wide_sums)):
        for a, b in zip((*want, *want_sums), (*got, *sums)):
            assert torch.equal(a, b)


def test_sampled_products_take_both_offset_widths(device, plan):
    """The sampled products (the forward's up product with its statistics, the backward's dh with the chain rule)
    use 32-bit element offsets while every offset fits and 64-bit ones past 2**31: the same values bit for bit on
    every slot a block lists, and the same statistics."""

    def run():
        x, wu, wd, bias, pre, f = _factors(40, 40, 100, torch.float32, device, True)
        dy = torch.randn(40, 40, generator=torch.Generator().manual_seed(1)).to(device)
        d_up, d_gate = block_ell_sddmm(
            f.gate, dy, wd, gate=f.gate.values, up=f.up.values, gate_grad=torch.ones(1, device=device)
        )
        return f, (f.product.values, f.gate.values, f.up.values, d_up, d_gate)

    narrow, narrow_values = run()
    plan(sparse_core={"offsets_32_limit": 0})
    with track_launches() as launched:
        wide, wide_values = run()
    assert launched["block_sddmm_kernel"] == 1 and launched["block_ell_sddmm_kernel"] == 1
    listed = (
        torch.arange(narrow.gate.values.shape[1], device=device)[None, :]
        < narrow.gate.counts.repeat_interleave(narrow.gate.block_rows)[: narrow.gate.values.shape[0], None]
    )
    for a, b in zip(narrow_values, wide_values):
        assert torch.equal(a[listed], b[listed])
    for name in ("counts", "column_counts", "chunk_nnz", "block_nnz", "gate_sum"):
        assert torch.equal(getattr(narrow, name), getattr(wide, name)), name
    in_union = torch.arange(narrow.gate.indices.shape[1], device=device)[None, :] < narrow.gate.counts[:, None]
    assert torch.equal(narrow.gate.indices[in_union], wide.gate.indices[in_union])


def test_column_prefix_sums_match_torch(device):
    """The transposition's running sums down the [blocks + 1, N] count table, from int32 counts into a fresh table
    and in place over a table's own rows: torch's cumsum exactly, past one chunk of rows and one of columns."""
    from sparsefuse.sparse.block_grad import _column_prefix_sums

    counts = torch.randint(0, 2**20, (40, 37), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    counts = counts.to(device)
    want = column_count_table(counts).cumsum(0)
    table = torch.full((41, 37), -1, dtype=torch.int64, device=device)
    with track_launches() as launched:
        _column_prefix_sums(table, counts, row_zero=True)
    assert launched["column_prefix_sum_kernel"] == 1
    assert torch.equal(table, want)
    table = column_count_table(counts)
    table[0] = 5  # in place, from the first row as it is
    _column_prefix_sums(table, table[1:], row_zero=False)
    assert torch.equal(table, want + 5)


def test_products_write_into_given_outputs(device):
    """``out=``: block_sparse_matmul and transposed_matmul write the same products into the caller's tensors (the
    weight gradients in float32 from fp16 operands: each output's own dtype; contiguous, or transposed as a row-major
    weight's gradient is), and refuse a wrong shape or layout."""
    x, wu, wd, bias, pre, f = _factors(40, 24, 100, torch.float16, device, True)
    csc = block_ell_transpose(f.gate, f.column_counts)
    args = (csc, x, f.gate.values, f.up.values)
    want, _ = transposed_matmul(*args, mode="two", out_dtype=torch.float32)
    given = [torch.full((100, 24), float("nan"), device=device) for _ in range(2)]
    got, _ = transposed_matmul(*args, mode="two", out=given)
    assert all(g is o for g, o in zip(got, given))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="out must hold 2 tensors"):
        transposed_matmul(*args, mode="two", out=given[:1])
    with pytest.raises(ValueError, match=r"out must be a float \[100, 24\] tensor contiguous .* in float16"):
        transposed_matmul(*args, mode="two", out=given, out_dtype=torch.float16)
    # [100, 24] as the transpose of a contiguous [24, 100] (a row-major weight's gradient): written in place
    transposed = [torch.full((24, 100), float("nan"), device=device).t() for _ in range(2)]
    got, _ = transposed_matmul(*args, mode="two", out=transposed)
    assert all(g is o for g, o in zip(got, transposed))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    strided = torch.full((100, 48), float("nan"), device=device)[:, ::2]  # [100, 24], neither layout
    with pytest.raises(ValueError, match=r"out must be a float .* contiguous \(or the transpose of a contiguous"):
        transposed_matmul(*args, mode="two", out=[given[0], strided])
    product = BlockELL(f.up.values, f.gate.indices, f.gate.counts, 100, f.gate.block_rows, f.gate.row_order)
    want = block_sparse_matmul(product, wu)
    into = torch.full((40, 24), float("nan"), dtype=torch.float16, device=device)
    assert block_sparse_matmul(product, wu, out=into) is into and torch.equal(into, want)
    with pytest.raises(ValueError, match="out must be"):
        block_sparse_matmul(product, wu, out=into[:, :12])


def test_backward_products_on_an_empty_batch(device):
    x, wu, wd, bias, pre, f = _factors(0, 8, 20, torch.float32, device, False)
    csc = block_ell_transpose(f.gate, f.column_counts)
    out, sums = transposed_matmul(csc, x, f.gate.values, f.up.values, mode="two", bias=True)
    assert int(csc.offsets[-1]) == 0 and all(torch.equal(o, torch.zeros_like(o)) for o in out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_products_at_the_1p5b_layer_shape(dtype):
    _check(1024, 2048, 5632, dtype, torch.device("cuda"), True, block_rows=64, tile=256)
