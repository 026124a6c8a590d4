"""The lab's ``ffn_products`` bench workload (benchmarks/lab/ffn_products.py) under the interpreter: the recorded
step's products, replayed one by one, run the block step's kernels and give what the step itself computed."""

import pytest
import torch
from helpers import interpreter_only

from benchmarks.lab import ffn_products
from sparsefuse import track_launches
from sparsefuse.ffn.hybrid import hybrid_mlp
from sparsefuse.ffn.synthetic import synthetic_ffn

K, N, M = 16, 128, 96  # two row groups of 64 tokens, the second partial


@pytest.fixture
def cases(device):
    interpreter_only(device, "ffn_products")
    return ffn_products._cases(K, N, M, torch.float32, "cpu")


def test_rows_name_each_product_and_count_its_floor(cases):
    names = [case.shape.split(f"N={N} ")[1] for case in cases]
    assert names == ["gate GEMM", "up + stats", "down", "dh", "dx", "weight grads"]
    by_name = dict(zip(names, cases))
    assert by_name["gate GEMM"].flops == 2 * M * N * K
    union = by_name["down"].flops  # 2 S K: S the union slots, at least one fired pair per fired (token, neuron)
    assert 0 < union <= 2 * M * N * K and union % (2 * K) == 0
    assert by_name["dx"].flops == 2 * union and by_name["up + stats"].flops == by_name["dh"].flops == union
    grads = by_name["weight grads"]
    nnz = grads.flops // (6 * K)
    assert 0 < nnz <= union // (2 * K) and grads.bytes_moved == (2 * nnz * K + 3 * N * K) * 4
    assert all(set(case.impls) == {"block step", "dense"} and case.eager_impl == "dense" for case in cases)


def test_replayed_products_launch_the_step_kernels(cases):
    inputs = cases[0].make_inputs()
    expected = {
        "gate GEMM": set(),
        "up + stats": {"block_sddmm_kernel"},
        "down": {"block_ell_matmul_kernel"},
        "dh": {"block_ell_sddmm_kernel"},
        "dx": {"block_ell_matmul_kernel"},
        "weight grads": {"transposed_matmul_kernel"},
    }
    for case in cases:
        with track_launches() as launched:
            case.impls["block step"](*inputs)
        assert expected[case.shape.split(f"N={N} ")[1]] <= set(launched), (case.shape, launched)
        case.impls["dense"](*inputs)  # the dense counterpart runs on the same inputs


def test_replays_give_the_steps_gradients(device):
    """The recorded calls, replayed, give exactly the gradients autograd returned for the same step: the
    recording holds the step's own arguments (on the test device: CPU tensors record nothing unless the kernels
    run in the interpreter)."""
    ffn = synthetic_ffn(K, N, dtype=torch.float32, device=device, seed=3)
    x = ffn.make_input(M, 30.0)
    dy = torch.randn(M, K, device=device)
    calls = ffn_products.record_step(x, ffn.w_gate, ffn.w_up, ffn.w_down, dy)
    leaves = [t.detach().clone().requires_grad_() for t in (x, ffn.w_gate, ffn.w_up, ffn.w_down)]
    out = hybrid_mlp(*leaves, layout="block")
    dx, dwg, dwu, dwd = torch.autograd.grad((out.y, out.l1), leaves, (dy, torch.tensor(2e-5, device=device)))
    (got_g, got_u, got_d), _ = ffn_products._replay("transposed_matmul", calls["transposed_matmul"][0])
    got_x = ffn_products._dx(calls["block_sparse_matmul"][1], calls["block_sparse_matmul"][2])
    for got, want in ((got_x, dx), (got_g, dwg), (got_u, dwu), (got_d, dwd.t())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
