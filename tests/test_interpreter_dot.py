"""bfloat16 ``tl.dot`` under Triton's interpreter (sparsefuse/_interpreter_dot.py): the interpreter keeps bf16 as
raw 16-bit patterns and multiplied them as integers; the kernels' bf16 paths must give the float64 answer on a CPU
as on a GPU."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, assert_backend

import sparsefuse
from sparsefuse.ffn import twell_down_layout
from sparsefuse.ffn.hybrid import hybrid_mlp

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's dot; compiled kernels are the GPU suite's")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])  # [M, K]
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])  # [K, N]
    acc = tl.dot(a, b, tl.zeros((M, N), tl.float32))  # [M, N] float32
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dot_matches_the_float64_product(dtype):
    a, b = torch.randn(16, 32).to(dtype), torch.randn(32, 16).to(dtype)
    out = torch.full((16, 16), float("nan"), dtype=torch.float32)
    _dot_kernel[(1,)](a, b, out, M=16, N=16, K=32)
    ref = a.double() @ b.double()  # the operands as given: their products are exact in float32
    assert (out.double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("method", ["twell", "block"])
def test_bf16_twell_mlp_on_the_interpreter(method):
    x, w_gate, w_up = torch.randn(8, 64), torch.randn(256, 64) / 8, torch.randn(256, 64) / 8
    w_down = torch.randn(64, 256) / 16
    args = [t.bfloat16() for t in (x, w_gate, w_up, w_down)]
    assert_backend(args[0])
    with sparsefuse.track_launches() as launched:
        y = sparsefuse.twell_mlp(*args[:3], twell_down_layout(args[3]), method=method)
    assert sum(launched.values()) > 0
    x64, g64, u64, d64 = (t.double() for t in args)
    ref = (torch.relu(x64 @ g64.T) * (x64 @ u64.T)) @ d64.T
    assert _relative_error(y, ref) < 2e-2  # bf16 rounding of the hidden and output only (it was ~1e10)


def test_bf16_hybrid_step_under_cpu_autocast():
    x = torch.randn(64, 64, requires_grad=True)
    w_gate = (torch.randn(256, 64) / 8).requires_grad_()
    w_up, w_down = (torch.randn(256, 64) / 8).requires_grad_(), twell_down_layout(torch.randn(64, 256) / 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = [t.bfloat16() for t in (x, w_gate, w_up, w_down)]
        out = hybrid_mlp(*cast[:3], twell_down_layout(cast[3]), layout="block")
    x64, g64, u64, d64 = (t.detach().double() for t in cast)
    ref = (torch.relu(x64 @ g64.T) * (x64 @ u64.T)) @ d64.T
    assert _relative_error(out.y, ref) < 2e-2
