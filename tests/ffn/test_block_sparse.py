"""Row-block unions (RowBlockPattern), the tensor-core block SDDMM and block gather product of the shared sparse
core, and the gated FFN's ``method="block"`` built on them. Interpreter: fp16/fp32 (bf16 tl.dot is wrong there);
GPU tests add bf16 and the real shapes. Every kernel output is NaN-poisoned before launch (conftest)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.ffn import torch_twell_mlp, twell_mlp
from sparsefuse.ffn.synthetic import synthetic_ffn
from sparsefuse.ffn.twell.block import block_plan
from sparsefuse.sparse import (
    BlockELL,
    RowBlockPattern,
    block_sddmm,
    block_sparse_matmul,
    dense_to_row_block_pattern,
    torch_block_sddmm,
)
from sparsefuse.sparse.block_spmm import heavy_first_schedule, heavy_first_schedule_and_offsets
from sparsefuse.sparse.compact import count_order, torch_count_order
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference

MATMUL_DTYPES = [torch.float32, torch.float16]  # interpreted tl.dot on bf16 is wrong (triton#11584)


def sparse_pre(M, N, device, dtype=torch.float32, seed=0):
    """Pre-activations with ~15% positives, a NaN, an all-negative row and a fully positive row."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(M, N, generator=g) - 1.0
    if M > 3:
        pre[1] = -1.0
        pre[2] = 1.0
        pre[3, 5] = float("nan")
    return pre.to(device=device, dtype=dtype)


def used_slots(pattern: RowBlockPattern) -> torch.Tensor:
    slot = torch.arange(pattern.tile, device=pattern.counts.device)
    return (slot[None, None, :] < pattern.counts[:, :, None]).flatten(1)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("sort_rows", [False, True])
@pytest.mark.parametrize(
    "M, N, tile, block_rows", [(37, 70, 32, 16), (16, 64, 64, 16), (1, 20, 16, 16), (101, 70, 32, 64)]
)  # 64: the kernel walks 16 rows at a time
def test_row_block_pattern_matches_reference(M, N, tile, block_rows, sort_rows, relu, device):
    pre = sparse_pre(M, N, device)
    if block_rows > 16:
        pre -= 1.5  # ~0.6% fire: a 64-row union is then about a third of a tile, and depends on every row
    dense = torch.relu(pre).nan_to_num(nan=1.0) if not relu else pre
    with track_launches() as launched:
        pattern = dense_to_row_block_pattern(dense, tile, block_rows, relu=relu, sort_rows=sort_rows)
    assert_backend(dense)
    assert launched["row_bits_kernel"] == 1 and launched["row_block_union_kernel"] == 1
    fired = (pre > 0) | pre.isnan()
    ref = RowBlockPattern.from_dense(fired.to(torch.uint8), tile, block_rows, pattern.row_order)
    assert torch.equal(pattern.counts, ref.counts)
    used = used_slots(pattern)
    assert torch.equal(pattern.indices[used], ref.indices[used])
    assert torch.equal(pattern.to_mask() & fired, fired)  # every non-zero is inside its block's union
    if sort_rows:
        assert torch.equal(pattern.row_order, torch_count_order(fired))
    else:
        assert pattern.row_order is None


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("sample", [None, 24])
@pytest.mark.parametrize("group", [1024, 16, 24])
@pytest.mark.parametrize("M", [1, 37, 600])
def test_count_order_matches_reference(M, group, sample, relu, device):
    g = torch.Generator().manual_seed(M)
    fire_rate = torch.rand(M, 1, generator=g) ** 3  # counts from 0 to ~N: many keys, many ties
    pre = torch.where(torch.rand(M, 70, generator=g) < fire_rate, 1.0, -1.0)
    if M > 3:
        pre[3, 0] = float("nan")  # counts as fired
    dense = pre if relu else torch.relu(pre).nan_to_num(nan=1.0)
    dense = dense.to(device)
    with track_launches() as launched:
        order = count_order(dense, 70 if sample is None else sample, relu=relu, group=group)
    assert_backend(dense)
    assert launched["row_bits_kernel"] == launched["row_keys_kernel"] == launched["group_rank_kernel"] == 1
    fired = ((pre > 0) | pre.isnan())[:, :sample].to(device)
    assert torch.equal(order, torch_count_order(fired, group))
    for g0 in range(0, M, group):  # each group is a permutation of its own rows, heaviest first
        part = order[g0 : g0 + group].long()
        assert torch.equal(torch.sort(part).values, torch.arange(g0, min(M, g0 + group), device=device))
        counts = fired.sum(dim=1)[part]
        assert bool((counts[:-1] * 4 >= counts[1:] * 3 - 3).all())  # decreasing up to a quarter octave


def test_row_bits_programs_loop_past_the_grid_limit(plan, device):
    # Past max_grid_y row chunks each bits program takes several; shrink the limit so a small batch exercises that.
    pre = sparse_pre(53, 70, device)
    ref = dense_to_row_block_pattern(pre, 32, 16, relu=True, sort_rows=True)
    plan(sparse_core={"max_grid_y": 3})
    looped = dense_to_row_block_pattern(pre, 32, 16, relu=True, sort_rows=True)
    assert_backend(pre)
    assert torch.equal(looped.row_order, ref.row_order) and torch.equal(looped.counts, ref.counts)
    used = used_slots(ref)
    assert torch.equal(looped.indices[used], ref.indices[used])


def test_count_order_key_buckets():
    fired = torch.zeros(9, 40, dtype=torch.bool)
    for r, c in enumerate([0, 1, 2, 3, 4, 5, 6, 7, 39]):
        fired[r, :c] = True
    # counts + 1 = 1..8, 40: keys 0, 4, 6, 8, 9, 10, 11, 12, 21 (four per octave); ties keep row order
    assert torch_count_order(fired).tolist() == [8, 7, 6, 5, 4, 3, 2, 1, 0]
    fired[2, :] = False
    fired[2, :1] = True  # rows 1 and 2 both count 1: row 1 first
    assert torch_count_order(fired).tolist()[-3:] == [1, 2, 0]
    assert torch_count_order(fired, group=4).tolist() == [3, 1, 2, 0, 7, 6, 5, 4, 8]  # sorted within 4-row groups
    empty = dense_to_row_block_pattern(torch.zeros(0, 40), 16, 16, sort_rows=True)  # no rows: nothing to sort
    assert empty.row_order.numel() == 0 and empty.counts.numel() == 0


@pytest.mark.parametrize("n", [1, 5, 16, 17, 300])
def test_heavy_first_schedule_orders_by_decreasing_count(n, device):
    counts = torch.randint(0, 6, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int32)  # many ties
    with track_launches() as launched:
        schedule = heavy_first_schedule(counts.to(device))
    assert_backend(counts.to(device))
    assert launched["heavy_first_schedule_kernel"] == 1
    expected = torch.sort(counts, descending=True, stable=True).indices.to(torch.int32)  # ties in index order
    assert torch.equal(schedule.cpu(), expected)


@pytest.mark.parametrize("n", [0, 1, 5, 17, 300])
@pytest.mark.parametrize("n_parts", [None, 1, 3, 44])
def test_heavy_first_schedule_and_offsets_in_one_launch(n, n_parts, device):
    # the training step's blocks: their launch order (by union size) and where each block's (each chunk's, with
    # parts) kept pairs start when packed end to end
    generator = torch.Generator().manual_seed(n)
    counts = torch.randint(0, 6, (n,), generator=generator, dtype=torch.int32)
    parts = torch.randint(0, 300, (n, n_parts or 1), generator=generator, dtype=torch.int32)
    sizes = parts.sum(1, dtype=torch.int32)
    with track_launches() as launched:
        schedule, offsets = heavy_first_schedule_and_offsets(
            counts.to(device), sizes.to(device), parts.to(device) if n_parts else None
        )
    assert launched["heavy_first_schedule_kernel"] == (1 if n else 0)
    assert torch.equal(schedule.cpu(), torch.sort(counts, descending=True, stable=True).indices.to(torch.int32))
    expected = torch.cat([torch.zeros(1, dtype=torch.int64), parts.reshape(-1).to(torch.int64).cumsum(0)])
    assert torch.equal(offsets.cpu(), expected)


@pytest.mark.parametrize("n_cols, group", [(1, 16), (16, 16), (37, 16), (300, 16), (300, 32)])
def test_heavy_first_schedule_of_column_groups_from_offsets(n_cols, group, device):
    # a CSC's offsets [n_cols + 1]: the groups of `group` columns (the last one partial) ordered by their entries
    per_column = torch.randint(0, 4, (n_cols,), generator=torch.Generator().manual_seed(n_cols), dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), per_column.cumsum(0)])
    with track_launches() as launched:
        schedule = heavy_first_schedule(offsets.to(device), group=group)
    assert launched["heavy_first_schedule_kernel"] == 1
    groups = torch.nn.functional.pad(per_column, (0, -n_cols % group)).reshape(-1, group).sum(1)
    expected = torch.sort(groups, descending=True, stable=True).indices.to(torch.int32)
    assert torch.equal(schedule.cpu(), expected)


@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
@pytest.mark.parametrize("sort_rows", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_block_sddmm_and_block_matmul_match_float64(bias, sort_rows, dtype, device):
    M, N, D, tile = 37, 70, 40, 32  # no multiple of any block; D spans two dot steps
    pre = sparse_pre(M, N, device, dtype)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(M, D, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(N, D, generator=g) / D**0.5).to(device=device, dtype=dtype)
    bias_up = (torch.randn(N, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    w = (torch.randn(N, 24, generator=g) / N**0.5).to(device=device, dtype=dtype)
    bias_out = (torch.randn(24, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    pattern = dense_to_row_block_pattern(pre, tile, 16, relu=True, sort_rows=sort_rows)
    with track_launches() as launched:
        h = block_sddmm(pattern, pre, a, b, bias_up, relu=True)
        y = block_sparse_matmul(h, w, bias=bias_out)
    assert_backend(a)
    assert launched["block_sddmm_kernel"] == 1 and launched["block_ell_matmul_kernel"] == 1
    assert launched["heavy_first_schedule_kernel"] == 1  # 3 row blocks: launched longest first
    assert torch.equal(h.counts, pattern.union_sizes())
    in_block_order = block_sparse_matmul(h, w, bias=bias_out, heavy_first=False)
    assert torch.equal(y.isnan(), in_block_order.isnan()) and torch.equal(y.nan_to_num(), in_block_order.nan_to_num())
    ref_h = torch_block_sddmm(pattern, pre, a, b, bias_up, relu=True)
    clean = lambda t: t.nan_to_num(nan=0.0)  # noqa: E731  (row 3 carries a NaN pre-activation: compared apart)
    lowp_h = torch.relu(pre.float()).to(dtype) * (
        F.linear(a.float(), b.float(), None if bias_up is None else bias_up.float())
    ).to(dtype)
    rows = torch.arange(M, device=device) != 3
    assert_close_to_reference(clean(h.to_dense())[rows], clean(ref_h)[rows], clean(lowp_h * pattern.to_mask())[rows])
    assert bool(h.to_dense()[3].isnan().any())  # NaN propagates
    ref_y = ref_h.double() @ w.double() + (bias_out.double() if bias else 0.0)
    lowp_y = F.linear(lowp_h.float(), w.float().t(), None if bias_out is None else bias_out.float()).to(dtype)
    # h's fp32 sums run in another order than torch's: allow for it (two correct kernels differ by this much)
    up_allowance = accumulation_allowance(a, b.t()) * clean(pre.double()).clamp(min=0)
    allowance = accumulation_allowance(clean(ref_h), w) + up_allowance @ w.double().abs()
    assert_close_to_reference(y[rows], ref_y[rows], lowp_y[rows], extra_abs=allowance[rows])
    assert bool(y[3].isnan().all())


def test_block_formats_roundtrip_and_validation(device):
    dense = torch.relu(torch.randn(20, 50, device=device)) * (torch.rand(20, 50, device=device) < 0.2)
    ell = BlockELL.from_dense(dense, 16)
    assert torch.equal(ell.to_dense(), dense)
    order = torch.randperm(20, device=device).to(torch.int32)
    pattern = RowBlockPattern.from_dense(dense, 16, 16, order)
    assert torch.equal(pattern.to_mask() & (dense != 0), dense != 0)
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        BlockELL.from_dense(dense, 24)
    with pytest.raises(ValueError, match="row_order must be None or int32"):
        RowBlockPattern.from_dense(dense, 16, 16, order.long())
    with pytest.raises(ValueError, match="weight must be"):
        block_sparse_matmul(ell, torch.randn(49, 8, device=device))


@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
@pytest.mark.parametrize("M, bias", [(37, False), (70, True), (1, False), (0, False)])
def test_twell_mlp_block_method_matches_float64(M, bias, dtype, device):
    K, N = 48, 100
    ffn = synthetic_ffn(K, N, dtype=dtype, device=device, seed=3)
    x = ffn.make_input(M, 8.0)
    g = torch.Generator().manual_seed(4)
    b = [(torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None for n in (N, N, K)]
    with track_launches() as launched:
        y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, b_gate=b[0], b_up=b[1], b_down=b[2], method="block")
    assert y.shape == (M, K)
    if M == 0:
        return
    assert_backend(x)
    assert launched["block_sddmm_kernel"] == 1 and launched["block_ell_matmul_kernel"] == 1, launched
    assert launched.get("group_rank_kernel", 0) == block_plan(N).sorts(M)  # interpreted plan: from 64 tokens
    ref = torch_twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, *b)
    lowp = F.linear(torch.relu(F.linear(x, ffn.w_gate, b[0])) * F.linear(x, ffn.w_up, b[1]), ffn.w_down, b[2])
    assert_close_to_reference(y, ref, lowp)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "M, K, N, mean_nnz",
    [(3001, 2048, 5632, 30.0), (8219, 2048, 5632, 30.0), (1031, 4096, 14336, 60.0), (2048, 2048, 5632, 600.0)],
)
def test_block_method_real_shapes_gpu(M, K, N, mean_nnz, dtype, device):
    ffn = synthetic_ffn(K, N, dtype=dtype, device=device, seed=21)
    x = ffn.make_input(M, mean_nnz)
    with track_launches() as launched:
        y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, method="block")
    assert launched["block_ell_matmul_kernel"] == 1
    assert launched.get("group_rank_kernel", 0) == (M >= 8192)  # sorted tokens (8219: a partial rank group)
    rows = torch.arange(M, device=device)[:: max(1, M // 512)]  # float64 reference on a sample of tokens
    ref = torch_twell_mlp(x[rows], ffn.w_gate, ffn.w_up, ffn.w_down)
    lowp = F.linear(torch.relu(F.linear(x[rows], ffn.w_gate)) * F.linear(x[rows], ffn.w_up), ffn.w_down)
    assert_close_to_reference(y[rows], ref, lowp)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_block_sddmm_takes_fatrelu_and_drelu_gates(dtype, device):
    """``threshold``: the unions and the kept gate are the entries above it (FATReLU's, unshifted), as the float64
    reference has them; ``up_relu``: the product is relu'd before it multiplies the gate (dReLU), NaN kept."""
    M, N, D, tile, threshold = 37, 70, 40, 32, 0.5
    pre = sparse_pre(M, N, device, dtype)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(M, D, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(N, D, generator=g) / D**0.5).to(device=device, dtype=dtype)
    fat = dense_to_row_block_pattern(pre, tile, 16, relu=True, threshold=threshold, sort_rows=True)
    relu = dense_to_row_block_pattern(pre, tile, 16, relu=True, sort_rows=True)
    fired = (pre > threshold) | pre.isnan()
    assert bool((fat.to_mask().bool() | ~fired).all())  # every pair above the threshold lies in its block's union
    assert fat.union_sizes().sum() < relu.union_sizes().sum()  # FATReLU's unions are smaller than ReLU's
    for up_relu in (False, True):
        h = block_sddmm(fat, pre, a, b, relu=True, threshold=threshold, up_relu=up_relu)
        ref = torch_block_sddmm(fat, pre, a, b, relu=True, threshold=threshold, up_relu=up_relu)
        up = F.linear(a.float(), b.float())
        lowp = torch.where(fired, pre.float(), 0.0).to(dtype) * (up.relu() if up_relu else up).to(dtype)
        rows = torch.arange(M, device=device) != 3  # row 3's NaN: compared apart
        clean = lambda t: t.nan_to_num(nan=0.0)  # noqa: E731
        assert_close_to_reference(clean(h.to_dense())[rows], clean(ref)[rows], clean(lowp * fat.to_mask())[rows])
        assert bool(h.to_dense()[3].isnan().any())
        assert bool((h.to_dense()[rows] < 0).any()) != up_relu  # the gate is positive: h's sign is up's


def test_an_off_grid_threshold_fires_alike_on_both_backends(device, monkeypatch):
    """A FATReLU threshold between two bf16 values (0.3): the kernels compare in fp32, torch's fallback rounds the
    float to bf16 first (0.30078125); the core takes the threshold onto the dtype's grid, so both fire exactly where
    the value exceeds 0.3."""
    from sparsefuse.sparse import compact

    above, below = 0.30078125, 0.298828125  # bf16's neighbours of 0.3
    pre = torch.full((20, 40), -1.0)
    pre[::3, ::4], pre[1::3, 1::4] = above, below  # columns apart: a union column is an "above" one
    pre = pre.to(device=device, dtype=torch.bfloat16)
    kernels = dense_to_row_block_pattern(pre, 32, 16, relu=True, threshold=0.3)
    assert_backend(pre)
    monkeypatch.setattr(compact, "backend_for", lambda *tensors: compact.Backend.TORCH)
    reference = dense_to_row_block_pattern(pre, 32, 16, relu=True, threshold=0.3)
    fired = (pre.float() > 0.3).cpu()
    for pattern in (kernels, reference):
        mask = pattern.to_mask().bool().cpu()
        assert bool((mask | ~fired).all()) and not bool((mask & (pre.float() == below).cpu()).any()), pattern
    assert torch.equal(kernels.union_sizes().cpu(), reference.union_sizes().cpu())
