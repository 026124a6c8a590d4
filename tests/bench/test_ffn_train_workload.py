"""The ``ffn_train`` bench workload's rows under the interpreter: each computes the step's gradients for its own
weights (the row-major row's W_down gradient in that layout), equal to dense eager's: the L1 term's share of the
gate's gradient (coefficient 2e-5 over M N pairs) is far under fp32's tolerance here."""

import pytest
import torch
from helpers import interpreter_only

from sparsefuse.bench.workloads import ffn_train
from sparsefuse.testing import assert_close_to_reference

K, N, M = 16, 128, 96


@pytest.fixture
def case(device):
    interpreter_only(device, "ffn_train")
    return ffn_train._case(K, N, M, torch.float32, "cpu")


def test_each_row_gives_the_dense_steps_gradients(case):
    inputs = case.make_inputs()
    wd, row_wd = inputs[4], inputs[-1]
    assert wd.stride(0) == 1 and row_wd.is_contiguous()  # column-major as sparsefuse stores it; nn.Linear's
    dense = case.impls["dense eager"](*inputs)
    rows = [name for name in case.impls if name.endswith("nnz=30")]
    assert "row-major nnz=30" in rows
    for name in rows:
        grads = case.impls[name](*inputs)
        for which, ours, theirs in zip(("x", "w_gate", "w_up", "w_down"), grads, dense):
            assert_close_to_reference(ours, theirs.double(), dtype=torch.float32, name=f"{name} d{which}")
        if name == "row-major nnz=30":
            assert grads[3].stride() == row_wd.stride()  # written in its layout: no copy into it
