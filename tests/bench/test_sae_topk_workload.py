"""The ``sae_topk`` bench workload under the interpreter: every row computes the same decode and gradients, the
sparsefuse row with its kernels."""

import pytest
import torch
from helpers import interpreter_only

from sparsefuse import track_launches
from sparsefuse.bench.workloads import sae_topk
from sparsefuse.testing import assert_close_to_reference


@pytest.fixture
def case(device):
    interpreter_only(device, "sae_topk")
    return sae_topk._case((12, 96, 24, 5), torch.float32, "cpu")


def test_rows_agree_and_the_inputs_hold_a_hot_feature(case):
    ids, vals, w, grad_out = inputs = case.make_inputs()
    assert bool((ids[:, 0] == 0).all()) and all(len(set(row.tolist())) == 5 for row in ids)  # distinct, one hot
    with track_launches() as launched:
        ours = case.impls["sparsefuse topk_decode"](*inputs)
    assert launched["sampled_dot_rows_kernel"] == 1 and launched["gather_accumulate_kernel"] >= 2, launched
    for name in ("eager", "F.embedding_bag"):
        for a, b, what in zip(ours, case.impls[name](*inputs), ("out", "grad_acts", "grad_W_dec")):
            assert_close_to_reference(a, b.double(), dtype=torch.float32, name=f"{name} {what}")
    assert case.bytes_moved == (3 * 12 * 5 * 24 + 2 * 12 * 24 + 96 * 24) * 4
