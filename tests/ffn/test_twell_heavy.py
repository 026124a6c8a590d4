"""Heavy tokens of the TwELL up/down kernel: ordered first within the main launch, and from heavy_pass_min_tokens
tokens listed in token order and split over more programs by a second launch; overflowed tiles read from the gate
GEMM's pre-activations. Interpreter: fp16/fp32."""

import pytest
import torch
from test_twell import mlp_weights, torch_lowp_mlp

from sparsefuse import track_launches
from sparsefuse.ffn import torch_relu_mlp, torch_twell_mlp, twell_gate, twell_mlp, twell_relu_mlp
from sparsefuse.testing import accumulation_allowance, assert_close_to_reference


def test_heavy_first_order_is_a_permutation(device):
    from sparsefuse.ffn.twell.launch import heavy_first_order

    counts = torch.randint(0, 3, (70, 5), dtype=torch.int32)  # light: at most 10 entries
    counts[[3, 40, 66], 1] = 9  # overflowed tiles (4 slots) make a token heavy
    counts[[10, 50]] = 4  # 20 stored entries: heavy at 16 * block_j = 16
    order = heavy_first_order(counts.to(device), slots=4, block_j=1).cpu()
    assert sorted(order.tolist()) == list(range(70))
    assert set(order[:5].tolist()) == {3, 10, 40, 50, 66}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cap_bytes", [64 << 20, 1])  # every heavy token split further; one only (cap 1)
def test_heavy_tokens_split_by_a_second_launch(cap_bytes, dtype, device, plan):
    """From heavy_pass_min_tokens tokens the heavy ones (many entries or an overflowed tile) leave the main launch
    for a second one that splits each over more programs; past the cap they stay in the main launch."""
    from sparsefuse.ffn.twell import launch

    plan(twell_mlp={"heavy_pass_min_tokens": 8, "heavy_splits": 3, "heavy_partial_bytes": cap_bytes})
    M, K, N, tile, compression = 21, 40, 70, 32, 4
    w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_weights(K, N, dtype, device, bias=True)
    x = (torch.randn(M, K) * 0.5).to(device=device, dtype=dtype)
    x[:, 0] = 2.0  # most tokens fire little ...
    x[[2, 9, 17], 0] = -3.0  # ... three fire nearly everything: heavy, with overflowed tiles
    x[5, 0] = 50.0  # and one fires nothing
    with track_launches() as launched:
        y = twell_mlp(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, tile=tile,
                      compression=compression, method="twell")  # fmt: skip
    assert launched["twell_up_down_fwd_kernel"] == 2 and launched["heavy_tokens_kernel"] == 1
    twell = twell_gate(x, w_gate, b_gate, tile=tile, compression=compression)
    cap = 1 if cap_bytes == 1 else M
    heavy_rows, heavy_count, taken = launch.heavy_tokens(twell.counts, twell.slots, 4, cap)
    # those with an overflowed tile first, then the rest, each in token order, whatever the programs' timing: the
    # same tokens every run
    counts = twell.counts.cpu()
    overflowed = (counts.amax(dim=1) > twell.slots).nonzero().flatten().tolist()
    heavy = ((counts.amax(dim=1) <= twell.slots) & (counts.sum(dim=1) >= 16 * 4)).nonzero().flatten().tolist()
    assert overflowed[:1] == [2] and len(overflowed) >= 3
    n_taken, n_overflowed = heavy_count.tolist()
    assert heavy_rows[:n_taken].tolist() == (overflowed + heavy)[:cap]
    assert n_taken == int(taken.sum()) == min(cap, len(overflowed + heavy))
    assert n_overflowed == min(cap, len(overflowed))
    assert taken.cpu().nonzero().flatten().tolist() == sorted((overflowed + heavy)[:cap])
    assert twell_gate(x, w_gate, b_gate, tile=tile, compression=compression).overflowed().any()
    ref = torch_twell_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    assert_close_to_reference(y, ref, torch_lowp_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down))
    assert torch.equal(y, twell_mlp(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, tile=tile,
                                    compression=compression, method="twell"))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gate", ["gemm", "fused"])
def test_overflowed_tiles_read_from_the_gate_pre_activations(gate, dtype, device, plan):
    """Where the gate runs as a GEMM and a packing pass, its dense pre-activations stay for the up/down kernel, whose
    overflowed tiles read them instead of a GEMV over the gate; the fused gate kernel keeps none (the GEMV)."""
    from sparsefuse.ffn.twell import launch

    plan(twell_mlp={"gate_gemm_min_tokens": 1 if gate == "gemm" else 1 << 30})
    M, K, N, tile, compression = 19, 40, 90, 32, 4  # tiles of 32, 32 and 26 columns, 8 slots each
    w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_weights(K, N, dtype, device, bias=True)
    x = (torch.randn(M, K) * 0.5).to(device=device, dtype=dtype)
    x[[1, 7, 12, 18], 0] = -3.0  # four tokens fire nearly everything: 3 overflowed tiles each, the short one too
    x2, w_down_t = x, w_down.t().contiguous()
    with track_launches() as launched:
        values, indices, counts, pre = launch.launch_gate(x2, w_gate, b_gate, tile, compression)
    over = counts > tile // compression
    assert int(over.sum()) >= 12 and bool(over[[1, 7, 12, 18], -1].all())
    if gate == "fused":
        assert pre is None and launched["twell_gate_fwd_kernel"] == 1
        return
    assert launched["twell_pack_kernel"] == 1 and pre.shape == (M, N)
    pre64 = torch.nn.functional.linear(x2.double(), w_gate.double(), b_gate.double())
    assert_close_to_reference(pre, pre64, torch.nn.functional.linear(x2, w_gate, b_gate))
    args = (x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression)
    y = launch.launch_up_down(values, indices, counts, *args, pre)
    recomputed = launch.launch_up_down(values, indices, counts, *args)
    ref = torch_twell_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    # the pre-activations come from torch's GEMM or the GEMV (other summation orders than float64's, bounded by
    # Higham's gamma_K), carried through h * u into the down projection
    u64 = torch.nn.functional.linear(x.double(), w_up.double(), b_up.double())
    h64 = torch.relu(pre64) * u64
    pre_err = accumulation_allowance(x, w_gate.t())  # [M, N]
    allowance = accumulation_allowance(h64, w_down.t().double()) + (pre_err * u64.abs()) @ w_down.t().double().abs()
    lowp = torch_lowp_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    for out in (y, recomputed):
        assert_close_to_reference(out, ref, lowp, extra_abs=allowance)
    pre.zero_()  # read from pre, not recomputed: emptied, the overflowed tiles contribute nothing
    assert not torch.equal(launch.launch_up_down(values, indices, counts, *args, pre), y)


@pytest.mark.parametrize("seed", range(16))
def test_heavy_launch_and_gate_paths_fuzz(seed, device, plan):
    """Seeded random batches through the heavy launch and both gate paths (the fused kernel, or a GEMM whose
    pre-activations the overflowed tiles read) at interpreter sizes: per-token firing from none to every column
    (tiles over their slots, whole rows firing), random split counts and list caps, biases or not; every output
    element of the gated and the non-gated block against the float64 reference."""

    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=g))]

    plan(
        twell_mlp={
            "heavy_pass_min_tokens": pick([1, 4, 16]),
            "heavy_splits": pick([1, 2, 3, 5]),
            "heavy_splits_tokens": pick([1, 8, 1024]),
            "heavy_partial_bytes": pick([1, 4096, 64 << 20]),
            "gate_gemm_min_tokens": pick([1, 4, 1 << 30]),
        }
    )
    dtype = pick([torch.float32, torch.float16])
    M, K, N = int(torch.randint(1, 41, (), generator=g)), pick([8, 40, 72]), pick([16, 70, 130])
    tile, compression = pick([16, 32]), pick([2, 4, 8])
    w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_weights(K, N, dtype, device, bias=pick([True, False]), seed=seed)
    x = torch.randn(M, K, generator=g) * 0.5
    # column 0 of x steers each token's firing through W_gate's column 0 (-1, see mlp_weights): from none to all
    x[:, 0] = torch.tensor([pick([50.0, 2.0, 0.5, -0.5, -3.0, -50.0]) for _ in range(M)])
    x = x.to(device=device, dtype=dtype)
    y = twell_mlp(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, tile=tile,
                  compression=compression, method="twell")  # fmt: skip
    ref = torch_twell_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    lowp = torch_lowp_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    # the gate's dot and the GEMV sum in other orders than float64's; a gate within that of 0 may fire or not
    bg64 = b_gate.double() if b_gate is not None else None
    bu64 = b_up.double() if b_up is not None else None
    u64 = torch.nn.functional.linear(x.double(), w_up.double(), bu64)
    h64 = torch.relu(torch.nn.functional.linear(x.double(), w_gate.double(), bg64)) * u64
    kink = accumulation_allowance(x, w_gate.t()) * u64.abs()
    extra = accumulation_allowance(h64, w_down.t().double()) + (kink + h64.abs() * 2**-10) @ w_down.t().double().abs()
    assert_close_to_reference(y, ref, lowp, extra_abs=extra)
    assert torch.equal(y, twell_mlp(x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, tile=tile,
                                    compression=compression, method="twell"))  # fmt: skip
    # the non-gated block on the same batch (W_gate as its W_up): ReLU's kink as above, without the up factor
    y = twell_relu_mlp(x, w_gate, w_down, b_up=b_gate, b_down=b_down, tile=tile, compression=compression)
    ref = torch_relu_mlp(x, w_gate, w_down, b_gate, b_down)
    lowp = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w_gate, b_gate)), w_down, b_down)
    h64 = torch.relu(torch.nn.functional.linear(x.double(), w_gate.double(), bg64))
    kink = accumulation_allowance(x, w_gate.t())
    extra = accumulation_allowance(h64, w_down.t().double()) + (kink + h64.abs() * 2**-10) @ w_down.t().double().abs()
    assert_close_to_reference(y, ref, lowp, extra_abs=extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_gate_keeps_the_overflowed_tiles_pre_activations(dtype, device):
    """Below gate_gemm_min_tokens the fused gate kernel writes the pre-activations of its overflowed (token, tile)
    pairs, and of nothing else (the buffer stays poisoned there), and the up/down kernel reads those instead of a
    GEMV over the gate: a token of many non-zeros among few no longer costs a serial GEMV per overflowed tile."""
    from sparsefuse.ffn.twell.auto import PLANNER
    from sparsefuse.ffn.twell.launch import launch_gate

    M, K, N, tile, compression = 5, 40, 70, 32, 4
    assert M < PLANNER.knobs.gate_gemm_min_tokens
    w_gate, w_up, w_down, b_gate, b_up, b_down = mlp_weights(K, N, dtype, device, bias=True)
    x = (torch.randn(M, K) * 0.5).to(device=device, dtype=dtype)
    x[:, 0] = 2.0  # most tokens fire little ...
    x[3, 0] = -3.0  # ... one fires nearly everything: every tile overflowed
    _, _, counts, pre = launch_gate(x, w_gate, b_gate, tile, compression, keep_pre=True)
    over = (counts > tile // compression).repeat_interleave(tile, dim=1)[:, :N]
    assert over[3, :64].all() and not over[[0, 1, 2, 4]].any()  # (the last tile, 6 columns, cannot overflow)
    expected = (x.double() @ w_gate.double().t() + b_gate.double()).to(dtype)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pre[over], expected[over], **tol)
    assert torch.isnan(pre[~over]).all()  # poisoned where nothing was written: the up/down must not read it
    with track_launches() as launched:
        y = twell_mlp(
            x, w_gate, w_up, w_down, b_gate=b_gate, b_up=b_up, b_down=b_down, tile=tile, compression=compression,
            method="twell",
        )  # fmt: skip
    assert launched["twell_gate_fwd_kernel"] == 1 and launched["twell_up_down_fwd_kernel"] == 1, launched
    ref = torch_twell_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    assert_close_to_reference(y, ref, torch_lowp_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down))
