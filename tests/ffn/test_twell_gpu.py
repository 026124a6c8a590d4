"""The TwELL FFN on a GPU: bf16 at the real shapes, the largest batch, overflow-heavy batches, CUDA-graph capture of
``auto`` and the default calls' syncs (marked ``gpu``; the interpreter covers the same code at small shapes in
test_twell.py)."""

import pytest
import torch
import torch.nn.functional as F
from test_twell import gated_launches_ok, torch_lowp_mlp

from sparsefuse import track_launches
from sparsefuse.ffn import (
    SparsityMonitor,
    torch_relu_mlp,
    torch_twell_mlp,
    twell_gate,
    twell_mlp,
    twell_relu_mlp,
)
from sparsefuse.ffn.synthetic import gate_statistics, synthetic_ffn
from sparsefuse.testing import assert_close_to_reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "M, K, N, mean_nnz",
    [
        (1, 2048, 5632, 30.0),
        (16, 2048, 5632, 30.0),
        (3001, 2048, 5632, 30.0),
        (8192, 2048, 5632, 30.0),
        (257, 4096, 14336, 60.0),
        (300, 2048, 11008, 200.0),
        (129, 4096, 8192, 30.0),
    ],
)
def test_real_shapes_gpu(M, K, N, mean_nnz, dtype, device):
    ffn = synthetic_ffn(K, N, dtype=dtype, device=device, seed=11)
    x = ffn.make_input(M, mean_nnz)
    with track_launches() as launched:
        y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, method="twell")
    assert gated_launches_ok(launched, M), launched
    rows = torch.arange(M, device=device)[:: max(1, M // 512)]  # float64 reference on a sample of tokens
    ref = torch_twell_mlp(x[rows], ffn.w_gate, ffn.w_up, ffn.w_down)
    lowp = torch_lowp_mlp(x[rows], ffn.w_gate, ffn.w_up, ffn.w_down)
    assert_close_to_reference(y[rows], ref, lowp)
    stats = gate_statistics(twell_gate(x, ffn.w_gate, tile=256, compression=8).counts)
    assert stats["mean"] < 3 * mean_nnz


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["twell", "block", "auto"])
def test_largest_batch_gpu(method, device):
    # The largest batch served: 65536 tokens (the block path sorts 64 groups of 1024 and has 1024 row blocks; the
    # TwELL kernels have a 65536-row grid). A float64 reference on every 128th token and the last one.
    M, K, N = 65536, 2048, 5632
    ffn = synthetic_ffn(K, N, dtype=torch.bfloat16, device=device, seed=12)
    x = ffn.make_input(M, 30.0)
    with track_launches() as launched:
        y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, method=method)
    if method == "twell":
        assert gated_launches_ok(launched, M), launched
    else:  # auto predicts the block path here (1.6x dense at 8192 and 16384 tokens)
        assert launched["block_sddmm_kernel"] == 1 and launched["group_rank_kernel"] == 1, launched
    rows = torch.cat([torch.arange(0, M, 128), torch.tensor([M - 1])]).to(device)
    ref = torch_twell_mlp(x[rows], ffn.w_gate, ffn.w_up, ffn.w_down)
    lowp = torch_lowp_mlp(x[rows], ffn.w_gate, ffn.w_up, ffn.w_down)
    assert_close_to_reference(y[rows], ref, lowp)


@pytest.mark.gpu
def test_overflow_heavy_batch_and_relu_variant_gpu(device):
    K, N = 2048, 5632
    ffn = synthetic_ffn(K, N, dtype=torch.bfloat16, device=device, seed=12)
    x = ffn.make_input(1024, 400.0)  # many tiles past their 32 slots
    twell = twell_gate(x, ffn.w_gate, tile=256, compression=8)
    assert twell.overflowed().any()
    y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, tile=256, compression=8, method="twell")
    rows = torch.arange(0, 1024, 7, device=device)
    ref = torch_twell_mlp(x[rows], ffn.w_gate, ffn.w_up, ffn.w_down)
    assert_close_to_reference(y[rows], ref, torch_lowp_mlp(x[rows], ffn.w_gate, ffn.w_up, ffn.w_down))
    y = twell_relu_mlp(x, ffn.w_gate, ffn.w_down, tile=256, compression=8)
    ref = torch_relu_mlp(x[rows], ffn.w_gate, ffn.w_down)
    lowp = F.linear(torch.relu(F.linear(x[rows], ffn.w_gate)), ffn.w_down)
    assert_close_to_reference(y[rows], ref, lowp)


@pytest.mark.gpu
def test_auto_under_cuda_graph_capture_gpu(device):
    ffn = synthetic_ffn(2048, 5632, dtype=torch.bfloat16, device=device, seed=13)
    x = ffn.make_input(2048, 30.0)
    monitor = SparsityMonitor()
    for _ in range(3):  # warm up: probe, autotune, monitor estimate arrives
        twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, monitor=monitor)
    torch.cuda.synchronize()
    assert monitor.estimate() is not None
    y = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, monitor=monitor)  # on the estimate the graph will use
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no host sync may happen in here
        y_graph = twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down, monitor=monitor)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, y)


@pytest.mark.gpu
def test_module_decode_step_eager_dense_then_captured_sparse_gpu(device):
    """One token from Python: the module runs the dense ops directly (host-bound: cheaper), feeding the estimate
    from its own gate activations now and then; a CUDA-graph capture of the same call runs the TwELL kernels,
    compiled and tuned by the eager warm-up, and gives the float64 reference's result."""
    from sparsefuse.nn import SparseGatedMLP

    ffn = synthetic_ffn(2048, 5632, dtype=torch.bfloat16, device=device, seed=14)
    mlp = SparseGatedMLP(2048, 5632, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(ffn.w_gate)
        mlp.up_proj.weight.copy_(ffn.w_up)
        mlp.down_proj.weight.copy_(ffn.w_down)
    x = ffn.make_input(1, 30.0).reshape(1, 1, 2048)
    with torch.no_grad():
        mlp(ffn.make_input(512, 30.0))  # a prefill first: the estimate is made at another batch size
        for _ in range(3):
            mlp(x)  # the first call at one token still goes through twell_mlp: warms up the in-graph pick
        with track_launches() as launched:
            for _ in range(40):
                y_eager = mlp(x)
        assert launched["twell_up_down_fwd_kernel"] == 0, launched
        assert mlp._eager_calls >= 38 and mlp._next_sample > 32  # samples taken at 8, 16 and 32 dense calls
        graph = torch.cuda.CUDAGraph()
        with track_launches() as launched, torch.cuda.graph(graph):
            y_graph = mlp(x)
        assert launched["twell_up_down_fwd_kernel"] == 1, launched
        graph.replay()
    torch.cuda.synchronize()
    x2 = x.reshape(1, 2048)
    ref = torch_twell_mlp(x2, ffn.w_gate, ffn.w_up, ffn.w_down)
    lowp = torch_lowp_mlp(x2, ffn.w_gate, ffn.w_up, ffn.w_down)
    assert_close_to_reference(y_graph.reshape(1, 2048), ref, lowp)
    assert_close_to_reference(y_eager.reshape(1, 2048), ref, lowp)


@pytest.mark.gpu
def test_default_calls_never_sync_after_the_weights_first_gpu(device):
    """The default call (no hint) and the module, eager, at decode and prefill batch sizes: after the first call on
    a gate weight (its one counted probe) no call synchronises with the GPU (sync debug mode raises if one does)."""
    from sparsefuse.nn import SparseGatedMLP

    ffn = synthetic_ffn(512, 1536, dtype=torch.bfloat16, device=device, seed=15)
    mlp = SparseGatedMLP(512, 1536, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(ffn.w_gate)
        mlp.up_proj.weight.copy_(ffn.w_up)
        mlp.down_proj.weight.copy_(ffn.w_down)
    inputs = [ffn.make_input(M, 30.0) for M in (1, 8, 128, 2048)]
    with torch.no_grad():
        for x in inputs:  # first calls: the probes, kernel compilation and tuning
            twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down)
            mlp(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(40):
                for x in inputs:
                    twell_mlp(x, ffn.w_gate, ffn.w_up, ffn.w_down)
                    mlp(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
