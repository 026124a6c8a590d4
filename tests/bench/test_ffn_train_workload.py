"""The ``ffn_train`` bench workload's rows under the interpreter: each computes the step's gradients for its own
weights (the row-major row's W_down gradient in that layout), equal to the step's gradients in float64 (its L1 term
included) within fp32's rounding plus dense eager's own distance from float64: both sum the same products in fp32,
in different orders."""

import pytest
import torch
from helpers import interpreter_only

from sparsefuse.bench.workloads import ffn_train
from sparsefuse.bench.workloads.ffn import eager_ffn
from sparsefuse.testing import assert_close_to_reference

K, N, M = 16, 128, 96


@pytest.fixture
def case(device):
    interpreter_only(device, "ffn_train")
    return ffn_train._case(K, N, M, torch.float32, "cpu")


def _step_in_float64(x, w_gate, w_up, w_down, dy, coefficient):
    """The gradients of ``<y, dy> + coefficient * sum(relu(x W_g^T)) / (M N)`` w.r.t. (x, W_g, W_u, W_d), float64."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    y = eager_ffn(*leaves)
    gate = torch.relu(torch.nn.functional.linear(leaves[0], leaves[1]))
    loss = (y * dy.double()).sum() + coefficient.double() * gate.sum() / gate.numel()
    return torch.autograd.grad(loss, leaves)


def test_each_row_gives_the_dense_steps_gradients(case):
    inputs = case.make_inputs()
    x30, _, wg, wu, wd, dy, coefficient = inputs[:7]
    row_wd = inputs[-1]
    assert wd.stride(0) == 1 and row_wd.is_contiguous()  # column-major as sparsefuse stores it; nn.Linear's
    reference = _step_in_float64(x30, wg, wu, wd, dy, coefficient)
    dense = case.impls["dense eager"](*inputs)
    rows = [name for name in case.impls if name.endswith("nnz=30")]
    assert "row-major nnz=30" in rows
    for name in rows:
        grads = case.impls[name](*inputs)
        for which, ours, ref64, lowp in zip(("x", "w_gate", "w_up", "w_down"), grads, reference, dense):
            assert_close_to_reference(ours, ref64, lowp, dtype=torch.float32, name=f"{name} d{which}")
        if name == "row-major nnz=30":
            assert grads[3].stride() == row_wd.stride()  # written in its layout: no copy into it
