"""The step anatomy (sparsefuse.bench.workloads.step_anatomy): its interval arithmetic on hand-made kernel timelines,
and its words in a row's note read back."""

import math

import pytest

from sparsefuse.bench.workloads.step_anatomy import StepAnatomy, anatomy, describe, gpu_bound_ms, union_length


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0
    assert union_length([(0, 10)]) == 10
    assert union_length([(5, 15), (0, 10), (20, 30)]) == 25  # [0, 15) and [20, 30)
    assert union_length([(0, 30), (5, 10), (10, 20)]) == 30  # nested and touching


def test_anatomy_of_two_steps():
    ms = 1_000_000  # ns
    kernels = [
        (0, 40 * ms, "gemm"),  # step 1: compute 0-40, an all-reduce 30-50 (10 ms of it alone), idle 50-60
        (30 * ms, 50 * ms, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
        (60 * ms, 100 * ms, "block_ell_matmul_kernel"),  # step 2: compute 60-100, all-reduce 90-100 hidden
        (90 * ms, 100 * ms, "ncclKernel_AllReduce"),
    ]
    a = anatomy(kernels, steps=2)
    assert a.span == 50.0  # 100 ms over 2 steps
    assert a.compute == 40.0  # 80 ms of compute
    assert a.collectives == 15.0  # 20 + 10 ms
    assert a.exposed == 5.0  # 40-50 ms, no compute beside it
    assert a.idle == 5.0  # 50-60 ms


def test_anatomy_without_kernels_is_nan():
    a = anatomy([], steps=3)
    assert all(math.isnan(v) for v in (a.span, a.compute, a.collectives, a.exposed, a.idle))


def test_described_anatomy_reads_back_as_the_gpu_bound_step():
    """A row's note carries each rank's anatomy in words; the GPU-bound step is the largest over the ranks of
    compute plus exposed collectives (a rank waiting for a slower one waits inside a collective)."""
    ranks = [StepAnatomy(150.0, 137.7, 15.7, 1.1, 7.8), StepAnatomy(150.0, 138.1, 14.3, 1.2, 7.2)]
    words = describe(ranks)
    assert words == "ms a step by rank: compute 137.7/138.1, NCCL 15.7/14.3 (exposed 1.1/1.2), idle 7.8/7.2"
    assert gpu_bound_ms(f"ddp on 2x GPU; peak/GPU 11171 MB; {words}; grads ok") == pytest.approx(139.3)
    assert gpu_bound_ms(describe([StepAnatomy(140.0, 131.5, 0.0, 0.0, 36.2)])) == pytest.approx(131.5)
    assert gpu_bound_ms("ddp on 2x CPU; peak n/a; anatomy n/a (no GPU kernels recorded)") is None
    assert describe([anatomy([], steps=1)]) == "anatomy n/a (no GPU kernels recorded)"
    assert describe([]) == "anatomy n/a (no GPU kernels recorded)"
