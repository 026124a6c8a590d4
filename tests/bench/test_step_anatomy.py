"""The step anatomy's interval arithmetic (sparsefuse.bench.workloads.step_anatomy) on hand-made kernel timelines."""

import math

from sparsefuse.bench.workloads.step_anatomy import anatomy, union_length


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
