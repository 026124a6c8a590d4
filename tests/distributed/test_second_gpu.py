"""The sparse training step on a GPU that is not the current one. Triton launches a kernel on the current device
(``torch.cuda.current_device()``), not on its tensors' device, so a layer on ``cuda:1`` called while ``cuda:0`` is
current (a model placed with ``.to("cuda:1")``, DDP without ``torch.cuda.set_device``) needs a device guard around
its launches (``_backend.on_tensor_device`` on every op). Run in a subprocess: an illegal memory access would poison
this process's CUDA context for the tests after it."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

PROGRAM = textwrap.dedent(
    """
    import torch
    from sparsefuse.ffn.hybrid import hybrid_mlp

    def step(current: int) -> list[torch.Tensor]:
        dev = torch.device("cuda", 1)
        g = torch.Generator(device=dev).manual_seed(0)
        K, N, M = 256, 1024, 512
        weights = [torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * 0.05 for _ in range(2)]
        w_down = torch.randn(K, N, device=dev, generator=g, dtype=torch.bfloat16) * 0.05
        b_gate = torch.full((N,), -0.08, device=dev, dtype=torch.bfloat16)
        x0 = torch.randn(M, K, device=dev, generator=g, dtype=torch.bfloat16)
        params = [t.requires_grad_() for t in (*weights, w_down, b_gate)]
        with torch.cuda.device(current):
            # x comes out of a long product on cuda:1's stream: a kernel launched elsewhere, without waiting for that
            # stream, reads it before it is written
            a = torch.randn(8192, 8192, device=dev, generator=g)
            x = (x0 + 0 * (a @ a)[:M, :K].to(torch.bfloat16)).requires_grad_()
            out = hybrid_mlp(x, params[0], params[1], params[2], b_gate=params[3], layout="block")
            (out.y.float().square().mean() + 0.3 * out.l1).backward()
        torch.cuda.synchronize(dev)
        return [t.detach().cpu() for t in (out.y, out.l1, x.grad, *(p.grad for p in params))]

    expected = step(current=1)
    got = step(current=0)
    for name, a, b in zip(["y", "l1", "dx", "dw_gate", "dw_up", "dw_down", "db_gate"], got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    print("same results with cuda:0 current")
    """
)


def test_hybrid_step_on_cuda1_while_cuda0_is_current():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=dict(os.environ), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
