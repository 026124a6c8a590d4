"""The training steps' custom ops under torch.library.opcheck: schema, fake implementations against the real
outputs (shapes, dtypes, strides and storage offsets) and autograd registration, with w_down row-major (nn.Linear's
layout, FSDP2's) and column-major. (Not the AOT-dispatch comparison of
values: the packed arrays' slots past the fired pairs are left unwritten, so two runs differ there by design; the
compiled step's values are checked against eager in tests/ffn/test_hybrid_train.py.)"""

import pytest
import torch
from conftest import assert_backend

from sparsefuse.ffn.hybrid.block_step import block_mlp_train_bwd_op, block_mlp_train_fwd_op
from sparsefuse.ffn.hybrid.functional import block_plan
from sparsefuse.ffn.hybrid.op import hybrid_mlp_bwd_op, hybrid_mlp_fwd_op

UTILS = ("test_schema", "test_faketensor", "test_autograd_registration")


def _w_down_t(N: int, K: int, down: str, g: torch.Generator) -> torch.Tensor:
    """W_down^T [N, K] as the steps receive it (``w_down.t()``): contiguous for a column-major w_down [K, N], the
    transpose of a contiguous tensor for a row-major one."""
    if down == "row":
        return (torch.randn(K, N, generator=g) / K**0.5).t()
    return torch.randn(N, K, generator=g) / K**0.5


@pytest.mark.parametrize("down", ["column", "row"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("capacity", [10**6, 40])  # every pair kept; pairs past 40 recomputed in the backward
def test_block_step_ops_pass_opcheck(gated, capacity, down, device):
    M, K, N = 40, 16, 48
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, K, generator=g)
    wg, wu = (torch.randn(N, K, generator=g) / K**0.5 for _ in range(2))
    wd = _w_down_t(N, K, down, g)
    bg, bu, bd = torch.full((N,), -0.3), torch.randn(N, generator=g), torch.randn(K, generator=g)
    x, wg, wu, wd, bg, bu, bd = (t.to(device).requires_grad_() for t in (x, wg, wu, wd, bg, bu, bd))
    assert_backend(x)
    if not gated:
        wu = bu = None
    plan = block_plan(N)
    fwd_args = (x, wg, bg, wu, bu, wd, bd, plan.block_rows, plan.tile, plan.sorts(M), min(capacity, M * N))
    torch.library.opcheck(block_mlp_train_fwd_op, fwd_args, test_utils=UTILS)
    out = block_mlp_train_fwd_op(*(a.detach() if isinstance(a, torch.Tensor) else a for a in fwd_args))
    assert out[2].shape == (M + N,) and out[2].storage_offset() == 0  # token then neuron counts, one tensor
    saved = out[3:]
    dy, dl1 = torch.randn(M, K, device=device), torch.tensor(0.5, device=device)
    detached = [t.detach() if t is not None else None for t in (x, wg, wu, wd, bg, bu)]
    bwd_args = (dy, dl1, *detached, *saved, plan.block_rows, True)
    torch.library.opcheck(block_mlp_train_bwd_op, bwd_args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("down", ["column", "row"])
def test_hybrid_format_backward_op_passes_opcheck(down, device):
    """The paper's format's backward op: its weight gradients as its fake says, each in its weight's layout (with
    ``down="row"`` also a transposed w_gate)."""
    M, K, N, width = 24, 16, 40, 6
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, K, generator=g).to(device)
    wg, wu = ((torch.randn(N, K, generator=g) / K**0.5).to(device) for _ in range(2))
    if down == "row":
        wg = wg.t().contiguous().t()
    wd = _w_down_t(N, K, down, g).to(device)
    out = hybrid_mlp_fwd_op(x, wg, None, wu, None, wd, None, width, 2)
    saved = out[2:9]
    dy, dl1 = torch.randn(M, K, generator=g).to(device), torch.tensor(0.5, device=device)
    args = (dy, dl1, x, wg, wu, wd, *saved)
    torch.library.opcheck(hybrid_mlp_bwd_op, args, test_utils=("test_schema", "test_faketensor"))
    grads = hybrid_mlp_bwd_op(*args)
    assert [t.stride() for t in grads[1:4]] == [wg.stride(), wu.stride(), wd.stride()]
