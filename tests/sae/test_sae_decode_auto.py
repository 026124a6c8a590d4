"""sparse_decode's ``auto``: its cost model against measured timings, its width, its sync-free estimate of each
decoder's L0 and its memoised pick, on the interpreter (fp16/fp32) and, marked ``gpu``, in CUDA graphs."""

from collections import Counter

import pytest
import torch
from helpers import product_allowance, product_reference, sparse_rows

from sparsefuse import planning, track_launches
from sparsefuse.sae import sparse_decode
from sparsefuse.sparse import matmul_skip_zeros
from sparsefuse.testing import assert_close_to_reference

# cuBLAS's product launches no Triton kernel of its own: this one reads its output and recomputes the non-finite
# elements (sparsefuse/sparse/nonfinite_rows.py), none here
CUBLAS = {"complete_nonfinite_rows_kernel": 1}

bf16, fp32 = torch.bfloat16, torch.float32

# Measured medians (us) of scan, the two passes of "fixed" at auto's width and cuBLAS at a constant L0 (CUDA graphs
# of 20 calls over two input sets, 4 for the largest): the sae_decode benchmark's shapes on an H200 (main shapes, L0
# and batch sweeps; None: not measured) and sae_decode_grid's constant inputs on an H100.
_MEASURED_DECODES = [
    ("H200", 32, 65536, 768, 64, fp32, 10.9, 16.0, 149.6),
    ("H200", 256, 65536, 768, 64, fp32, 52.4, 42.9, 502.4),
    ("H200", 32, 131072, 512, 128, fp32, 16.5, 32.5, 163.8),
    ("H200", 4096, 65536, 2304, 72, fp32, 1496.1, 840.6, 23576.6),
    ("H200", 1024, 262144, 2304, 100, fp32, 995.8, 505.6, 23703.3),
    ("H200", 1024, 131072, 3584, 72, fp32, 746.0, 387.9, 21188.1),
    ("H200", 1024, 32768, 2048, 100, fp32, 258.7, 181.1, 2899.1),
    ("H200", 32, 65536, 768, 64, bf16, 12.5, 14.1, 29.3),
    ("H200", 256, 65536, 768, 64, bf16, 45.2, 29.7, 42.7),
    ("H200", 32, 131072, 512, 128, bf16, 14.5, 20.0, 37.2),
    ("H200", 4096, 65536, 2304, 72, bf16, 858.9, 435.1, 1335.9),
    ("H200", 1024, 262144, 2304, 100, bf16, 545.5, 304.1, 1520.8),
    ("H200", 1024, 131072, 3584, 72, bf16, 335.7, 213.5, 1214.5),
    ("H200", 1024, 32768, 2048, 100, bf16, 159.9, 112.5, 159.5),
    ("H200", 32, 65536, 768, 16, bf16, 11.0, None, 29.5),
    ("H200", 32, 65536, 768, 64, bf16, 12.5, None, 29.3),
    ("H200", 32, 65536, 768, 256, bf16, 18.5, None, 29.6),
    ("H200", 32, 65536, 768, 1024, bf16, 38.2, None, 29.3),
    ("H200", 32, 65536, 768, 4096, bf16, 256.1, None, 30.4),
    ("H200", 32, 65536, 768, 16384, bf16, 736.2, None, 29.9),
    ("H200", 1024, 65536, 768, 16, bf16, 97.8, 60.1, 121.3),
    ("H200", 1024, 65536, 768, 64, bf16, 156.9, 72.4, 122.1),
    ("H200", 1024, 65536, 768, 256, bf16, 331.7, None, 121.5),
    ("H200", 1024, 65536, 768, 1024, bf16, 956.8, None, 122.2),
    ("H200", 1024, 65536, 768, 4096, bf16, 4754.1, None, 122.4),
    ("H200", 1024, 65536, 768, 16384, bf16, 15240.3, None, 129.3),
    ("H200", 1, 65536, 2304, 72, bf16, 9.0, 12.6, 70.9),
    ("H200", 8, 65536, 2304, 72, bf16, 12.0, 14.4, 71.9),
    ("H200", 64, 65536, 2304, 72, bf16, 32.0, 22.7, 77.0),
    ("H200", 512, 65536, 2304, 72, bf16, 122.3, 72.2, 191.8),
    ("H200", 4096, 65536, 2304, 72, bf16, 858.9, 435.1, 1335.9),
    ("H100", 32, 65536, 768, 64, fp32, 11.4, 17.9, 150.3),
    ("H100", 256, 65536, 768, 64, fp32, 58.4, 54.4, 503.8),
    ("H100", 4096, 65536, 768, 64, fp32, 789.3, 593.9, 7690.9),
    ("H100", 32, 65536, 2304, 72, bf16, 19.9, 18.9, 107.3),
    ("H100", 256, 65536, 2304, 72, bf16, 73.0, 53.6, 123.8),
    ("H100", 4096, 65536, 2304, 72, bf16, 916.7, 622.2, 1326.3),
]


@pytest.mark.parametrize("row", _MEASURED_DECODES, ids=lambda r: "{}-B{}-F{}-D{}-L0{}-{}".format(*r[:6]))
def test_auto_cost_model_picks_within_5_percent_of_the_fastest_measured(row):
    """auto's pick, given the true mean L0 and the GPU's DRAM bandwidth, ran within 5% of the fastest of scan,
    fixed and cuBLAS on that GPU."""
    from sparsefuse.sae.decode.auto import _fastest_method

    gpu, M, F, D, l0, dtype, scan, fixed, dense = row
    measured = {"scan": scan, "fixed": fixed, "dense": dense}
    pick = _fastest_method(M, F, D, l0, dtype, dtype, bandwidth={"H100": 3.35e12, "H200": 4.8e12}[gpu])
    assert measured[pick] is not None, f"picked {pick}, which this row did not measure"
    best = min(v for v in measured.values() if v is not None)
    assert measured[pick] <= 1.05 * best, (pick, measured)


def test_auto_width_is_four_times_the_mean_l0_within_bounds():
    from sparsefuse.sae.decode.auto import _auto_width

    assert _auto_width(72, 65536) == 512 and _auto_width(10, 65536) == 256 and _auto_width(0, 65536) == 256
    assert _auto_width(10, 100) == 100 and _auto_width(5000, 16384) == 16384


@pytest.fixture
def scan_below_10():
    """auto on small shapes, with a cost model of the test's own (scan iff L0 < 10) that records each L0 it is
    asked about (once per estimate: the planner memoises its pick on the rounded estimate)."""
    seen = []

    def costs(question, l0):
        seen.append(l0.mean)
        return {"scan": 1.0 if l0.mean < 10 else 3.0, "fixed": 5.0, "dense": 2.0}

    with planning(sparse_decode={"dense_below_d_sae": 256, "measured_s": costs}):
        yield seen


_FIXED_PREFERRED = {"dense_below_d_sae": 256, "measured_s": {"scan": 2.0, "fixed": 1.0, "dense": 3.0}}


def test_explicit_fixed_runs_its_two_passes_at_any_batch(device):
    """method="fixed" runs the bitmask, bits -> ELL and gather passes whatever the batch (an explicit method runs
    that method or raises); with validate it checks the count the format gives; auto's pick of "fixed" runs the
    same passes."""
    acts = sparse_rows(5, 600, [3, 300, 0, 40, 7], device=device)
    w = torch.randn(600, 24, device=device)
    two_pass = {"row_bits_kernel": 1, "bits_to_sparse_kernel": 1, "gather_accumulate_kernel": 2}
    for kwargs in ({"max_l0": 256}, {"max_l0": 300, "validate": True}, {"max_l0": 2}):
        with track_launches() as launched:
            out = sparse_decode(acts, w, method="fixed", **kwargs)
        assert dict(launched) == two_pass, (kwargs, dict(launched))  # (the 300-feature token: the second gather)
        assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))
    with planning(sparse_decode=_FIXED_PREFERRED), track_launches() as launched:
        sparse_decode(acts, w, expected_l0=10)
    assert dict(launched) == two_pass


def test_auto_runs_the_two_pass_method_when_the_model_picks_it(device):
    """When the model picks "fixed", auto compacts at 4x the mean L0, at least 256 slots (here 256: the token
    firing 300 features overflows and is decoded from its dense row) and gathers."""
    acts = sparse_rows(5, 600, [3, 300, 0, 40, 7], device=device)
    w = torch.randn(600, 24, device=device)
    with planning(sparse_decode=_FIXED_PREFERRED), track_launches() as launched:
        out = sparse_decode(acts, w, expected_l0=10)
    assert dict(launched) == {"row_bits_kernel": 1, "bits_to_sparse_kernel": 1, "gather_accumulate_kernel": 2}
    assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))


def _auto_decode(acts, w, kernel, **kwargs):
    with track_launches() as launched:
        out = sparse_decode(acts, w, **kwargs)
    assert (list(launched) == [kernel]) if kernel else (dict(launched) == CUBLAS), dict(launched)
    assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))


def test_auto_measures_each_decoder_once_then_follows_it_without_syncs(device, scan_below_10):
    import sparsefuse.sae.decode.auto as auto

    w = torch.randn(512, 8, device=device)
    _auto_decode(sparse_rows(2, 512, [3], device=device), w, "gather_accumulate_kernel")  # first call: counted, 3
    dense_ish = sparse_rows(6, 512, [25], device=device)  # not long (the long-row threshold of 512 columns: 32)
    for _ in range(auto.PLANNER.knobs.observe_every - 1):  # the estimate (3) holds until the next observation
        _auto_decode(dense_ish, w, "gather_accumulate_kernel")
    _auto_decode(dense_ish, w, "gather_accumulate_kernel")  # observes 25 (on the CPU folded at once)
    _auto_decode(dense_ish, w, None)  # estimate (3 + 25) / 2: cuBLAS
    assert scan_below_10 == [3.0, 3.0, 14.0]  # (asked once per batch size and estimate: the pick is memoised)
    _auto_decode(dense_ish, w.clone(), None)  # another decoder: counted anew (25)
    _auto_decode(dense_ish, w.clone(), "gather_accumulate_kernel", expected_l0=5)  # the hint decides
    assert scan_below_10[-2:] == [25.0, 5.0]
    with pytest.raises(ValueError, match="expected_l0 must be a non-negative number"):
        sparse_decode(dense_ish, w, expected_l0=-1.0)


def test_auto_keeps_the_estimate_of_the_callers_decoder_under_autocast(device, scan_below_10):
    """Under autocast the decode runs on a cast copy of W_dec made anew each call; the estimate must still be the
    one kept for the caller's W_dec (counted once), not a fresh count (a host sync) every call."""
    w = torch.randn(512, 8, device=device)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device.type, dtype=half):
        sparse_decode(sparse_rows(2, 512, [3], device=device), w)  # first call: counted, 3
        sparse_decode(sparse_rows(6, 512, [40], device=device), w)  # the estimate holds (observed later)
    assert scan_below_10 == [3.0, 3.0]  # (the two batch sizes: one question each)


@pytest.mark.gpu
def test_auto_inside_a_cuda_graph_follows_the_warm_up_estimate():
    """No sync is possible during capture: the decoder's estimate from the eager warm-up decides (sae_decode's
    L0 sweep at B=32, bf16: scan at L0=64, cuBLAS at L0=4096)."""
    for l0, kernel in [(64, "gather_accumulate_kernel"), (4096, None)]:
        acts = sparse_rows(32, 65536, [l0], torch.bfloat16, "cuda")
        w = (torch.randn(65536, 768, device="cuda") / 16).bfloat16()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            sparse_decode(acts, w)  # warm-up: the one counted call
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with track_launches() as launched, torch.cuda.graph(graph):
            out = sparse_decode(acts, w)
        assert (list(launched) == [kernel]) if kernel else (dict(launched) == CUBLAS), (l0, dict(launched))
        graph.replay()
        assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))


def test_auto_counts_host_time_for_plain_eager_calls_only():
    """A plain eager call pays each method's host time (a loop of one-token decodes ran 5-8x cuBLAS's time through
    the sparse kernels on a lent H200 host), so there few tokens take cuBLAS; a captured or compiled call picks by
    GPU time, and many tokens keep the sparse kernels either way."""
    from sparsefuse.sae.decode.auto import _fastest_method

    bf16, fp32 = torch.bfloat16, torch.float32
    for M, D, dtype in ((1, 2304, bf16), (32, 2304, bf16), (256, 2304, bf16), (32, 768, fp32)):
        assert _fastest_method(M, 65536, D, 72, dtype, dtype, eager=True) == "dense", (M, dtype)
        assert _fastest_method(M, 65536, D, 72, dtype, dtype) != "dense", (M, dtype)
    assert _fastest_method(4096, 65536, 2304, 72, bf16, bf16, eager=True) == "fixed"
    assert _fastest_method(32, 65536, 2304, 72, fp32, fp32, eager=True) == "scan"  # cuBLAS's fp32 is slower still


def test_an_eager_pick_of_cublas_warms_the_in_graph_pick_up_once(device):
    """Where the eager call takes cuBLAS and a capture of it would take a sparse kernel, the first such eager call
    per shape runs the sparse kernel once (a capture cannot compile one); the result is cuBLAS's either way."""
    # dense only above its host term; scan fastest by GPU time, but under the host terms
    knobs = {"dense_below_d_sae": 256, "measured_s": {"scan": 1e-6, "fixed": 2e-6, "dense": 20e-6}}
    acts, w = sparse_rows(3, 512, [3], device=device), torch.randn(512, 8, device=device)
    with track_launches() as scan:
        matmul_skip_zeros(acts, w)
    with planning(context="eager", sparse_decode=knobs):  # as a plain CUDA call would be priced
        for expected in (dict(scan + Counter(CUBLAS)), CUBLAS):  # the warm-up's scan and cuBLAS, then cuBLAS alone
            with track_launches() as launched:
                out = sparse_decode(acts, w, expected_l0=3)
            assert dict(launched) == expected, dict(launched)
            assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))
    with planning(context="graph", sparse_decode=knobs), track_launches() as launched:  # captured: GPU time
        sparse_decode(acts, w, expected_l0=3)
    assert dict(launched) == dict(scan)


def test_auto_pick_is_memoised_on_the_rounded_estimate():
    from sparsefuse.sae.decode.auto import PLANNER, L0Estimate, _question, _rounded

    l0 = _rounded(L0Estimate(72.04, 0.6012, 0.0, 0.0))
    assert l0 == L0Estimate(72.0, 0.6, 0.0, 0.0)
    question = _question(256, 65536, 2304, torch.bfloat16, torch.bfloat16, 4.8e12, 132)
    PLANNER.clear()
    for eager in (False, True):
        assert PLANNER.pick(question, l0, eager) == PLANNER.pick(question, _rounded(L0Estimate(72.0, 0.6)), eager)
    assert len(PLANNER._memo) == 2


def test_auto_scales_the_cost_model_by_the_device_dram_bandwidth(device):
    """The bandwidth comes from the device (None on the CPU: the reference GPU's rates); with less of it the
    two-pass "fixed" path, which is bandwidth-bound, takes over from the latency-bound scan at larger batches."""
    from sparsefuse._backend import dram_bandwidth
    from sparsefuse.sae.decode.auto import REFERENCE_BANDWIDTH, _fastest_method, _predicted_seconds

    bandwidth = dram_bandwidth(device)
    assert bandwidth is None if device.type == "cpu" else 1e12 < bandwidth < 2e13
    fp32 = torch.float32
    assert _fastest_method(128, 65536, 768, 64, fp32, fp32, REFERENCE_BANDWIDTH) == "fixed"
    assert _fastest_method(128, 65536, 768, 64, fp32, fp32, 3.35e12) == "scan"
    bf16 = torch.bfloat16
    h200, h100 = (_predicted_seconds(256, 65536, 2304, 72, bf16, bf16, bw) for bw in (REFERENCE_BANDWIDTH, 3.35e12))
    assert h200["fixed"] / h200["scan"] < h100["fixed"] / h100["scan"] < 1  # measured 0.59 and 0.73


# sae_decode_grid's inputs on an H200 (F=65536; fp32 D=768 mean L0 64, bf16 D=2304 mean L0 72): medians (us) of
# the scan, of the two passes of "fixed" at auto's width (4x the ordinary tokens' mean L0, at least 256) and of
# cuBLAS, measured together (a CUDA graph of 20 calls over two input sets; 6 calls at B=4096), per L0 distribution
# and batch.
_MEASURED_GRID = [
    ("constant", 32, fp32, 11.7, 17.3, 150.2),
    ("lognormal 0.3", 32, fp32, 13.0, 22.7, 151.3),
    ("lognormal 0.6", 32, fp32, 14.1, 28.5, 151.4),
    ("lognormal 1.0", 32, fp32, 15.1, 31.5, 151.5),
    ("full rows", 32, fp32, 105.0, 178.8, 152.0),
    ("constant", 256, fp32, 52.1, 44.1, 503.8),
    ("lognormal 0.3", 256, fp32, 54.2, 58.2, 503.6),
    ("lognormal 0.6", 256, fp32, 59.4, 59.4, 505.1),
    ("lognormal 1.0", 256, fp32, 75.1, 71.2, 504.6),
    ("full rows", 256, fp32, 130.8, 199.9, 504.2),
    ("constant", 4096, fp32, 658.1, 436.3, 7687.8),
    ("lognormal 0.3", 4096, fp32, 685.6, 475.8, 7686.1),
    ("lognormal 0.6", 4096, fp32, 779.1, 526.0, 7690.5),
    ("lognormal 1.0", 4096, fp32, 1048.8, 576.0, 7689.5),
    ("full rows", 4096, fp32, 955.1, 583.9, 7679.2),
    ("constant", 32, bf16, 19.1, 17.3, 76.3),
    ("lognormal 0.3", 32, bf16, 18.6, 18.4, 76.0),
    ("lognormal 0.6", 32, bf16, 18.0, 23.7, 76.3),
    ("lognormal 1.0", 32, bf16, 17.0, 22.9, 76.3),
    ("full rows", 32, bf16, 94.4, 182.0, 76.2),
    ("constant", 256, bf16, 70.9, 43.0, 100.6),
    ("lognormal 0.3", 256, bf16, 71.2, 56.4, 101.3),
    ("lognormal 0.6", 256, bf16, 75.8, 61.9, 100.7),
    ("lognormal 1.0", 256, bf16, 95.8, 79.7, 100.2),
    ("full rows", 256, bf16, 142.5, 204.5, 100.9),
    ("constant", 4096, bf16, 849.3, 445.4, 1328.4),
    ("lognormal 0.3", 4096, bf16, 894.7, 467.0, 1343.7),
    ("lognormal 0.6", 4096, bf16, 976.7, 491.4, 1348.7),
    ("lognormal 1.0", 4096, bf16, 1282.4, 587.6, 1345.9),
    ("full rows", 4096, bf16, 992.8, 628.5, 1330.5),
]


@pytest.mark.parametrize("row", _MEASURED_GRID, ids=lambda r: f"{r[0]}-B{r[1]}-{r[2]}".replace(" ", ""))
def test_auto_picks_within_5_percent_on_the_sae_decode_grid(row):
    """auto's pick from what its sample of the grid's input shows (the per-token L0s of the benchmark, counted over
    the rows auto samples and made into an estimate as a decoder's first call makes it) ran within 5% of the
    fastest method on the H200."""
    from sparsefuse._plan import SparsityMonitor
    from sparsefuse.bench.workloads.sae_grid import token_l0s
    from sparsefuse.sae.decode.auto import PLANNER, L0Estimate, _fastest_method
    from sparsefuse.sparse.long_rows import long_row_threshold

    distribution, M, dtype, scan, fixed, dense = row
    F, D, mean = (65536, 768, 64) if dtype == fp32 else (65536, 2304, 72)
    l0 = token_l0s(M, F, mean, distribution, torch.Generator().manual_seed(M + F + D))
    counts = l0[torch.linspace(0, M - 1, min(M, PLANNER.knobs.sample_rows)).long()]  # the rows sampled_row_stats counts
    long = counts > long_row_threshold(F)
    ordinary = torch.where(long, 0, counts)
    monitor = SparsityMonitor()
    sums = (ordinary.sum(), len(counts), (ordinary**2).sum(), long.sum(), torch.where(long, counts, 0).sum())
    monitor.update(*(float(v) for v in sums))
    est = L0Estimate.from_per_row(monitor.per_row)
    measured = {"scan": scan, "fixed": fixed, "dense": dense}
    pick = _fastest_method(
        M, F, D, est.mean, dtype, dtype, cv=est.cv, long_share=est.long_share, long_l0=est.long_l0, sms=132
    )
    assert measured[pick] <= 1.05 * min(measured.values()), (pick, measured, est)


def test_sampled_row_stats_sets_long_rows_apart(device):
    from sparsefuse._plan import sampled_row_stats

    acts = sparse_rows(4, 512, [3, 40, 5, 0], device=device)
    stats = sampled_row_stats(acts, 64, long_above=32)
    assert stats.tolist() == [8, 4, 34, 1, 40]
    assert sampled_row_stats(acts, 2, long_above=32).tolist() == [3, 2, 9, 0, 0]  # rows 0 and 3


@pytest.mark.gpu
def test_fixed_does_not_synchronise_on_a_new_decoder():
    a = sparse_rows(64, 4096, [40], torch.bfloat16, "cuda")
    w = (torch.randn(4096, 256, device="cuda") / 16).to(torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = sparse_decode(a, w, method="fixed", max_l0=128)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close_to_reference(out, *product_reference(a, w), **product_allowance(a, w))


@pytest.mark.parametrize("expected_l0", [None, 3.0, 400.0])
def test_torch_compile_fullgraph_of_the_default_call(expected_l0, device, scan_below_10):
    """The default call (method="auto") compiles without a graph break. With ``expected_l0`` the pick (a stub cost
    model: scan iff L0 < 10) is made at trace time and baked in; without, the op decides when the graph runs, from
    the decoder's estimate counted then (8.8 here), never from a prior frozen into the graph."""
    acts, w = sparse_rows(5, 600, [3, 30, 0, 4, 7], device=device), torch.randn(600, 24, device=device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: sparse_decode(a, b, expected_l0=expected_l0), fullgraph=True, backend=backend)
    with track_launches() as launched:
        out = fn(acts, w)
    assert ("complete_nonfinite_rows_kernel" in launched) == (expected_l0 == 400.0), dict(launched)
    assert scan_below_10 == [8.8 if expected_l0 is None else expected_l0]
    assert_close_to_reference(out, *product_reference(acts, w), **product_allowance(acts, w))
