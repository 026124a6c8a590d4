"""GPU probe: host time per call of small Snake/CELU calls (the regime of a SNAC decode), and a sweep of the Snake
backward's fixed (BLOCK_T, num_warps) choice. Run on a GPU: ``python3 scripts/probe_overhead.py``."""

import time

import torch
import triton

import sparsefuse
import sparsefuse._backend as backend
import sparsefuse.activations.snake as S


def scripted_snake(x, a):
    return x + (a + 1e-9).reciprocal() * torch.sin(a * x).pow(2)


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    x = torch.randn(1, 64, 236, device="cuda")
    alpha = torch.nn.Parameter(torch.rand(1, 64, 1, device="cuda") + 0.5)
    scripted = torch.jit.script(scripted_snake)
    with torch.no_grad():
        print(f"eager expression      {per_call_us(lambda: x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)):7.1f} us/call")
        print(f"torch.jit.script      {per_call_us(lambda: scripted(x, alpha)):7.1f} us/call")
        backend.EAGER_FAST_PATH = True
        print(f"sparsefuse fast path  {per_call_us(lambda: sparsefuse.snake(x, alpha)):7.1f} us/call")
        backend.EAGER_FAST_PATH = False
        print(f"sparsefuse via op     {per_call_us(lambda: sparsefuse.snake(x, alpha)):7.1f} us/call")
        backend.EAGER_FAST_PATH = True
        x3, a1 = x.reshape(1, 64, 236), alpha.reshape(64).contiguous()
        print(f"launcher only         {per_call_us(lambda: S._snake_forward(x3, a1, 1e-9, False)):7.1f} us/call")
        y = torch.empty_like(x)
        print(f"empty_like only       {per_call_us(lambda: torch.empty_like(x)):7.1f} us/call")
        print(f"celu fast path        {per_call_us(lambda: sparsefuse.celu(x)):7.1f} us/call")
        jit = S.snake_fwd_flat_kernel
        print(f"jit run only          {per_call_us(lambda: jit[(29,)](x3, a1, y, x3.numel(), 64, *S.division_magic(236), *S.division_magic(64), 1e-9, BLOCK=512, VECTOR=4, RUN_SHARES_CHANNEL=True, SIN_MODE=0)):7.1f} us/call")
        print(f"F.celu                {per_call_us(lambda: torch.nn.functional.celu(x)):7.1f} us/call")
    xr = x.clone().requires_grad_()
    print(f"snake fwd+bwd (op)    {per_call_us(lambda: torch.autograd.grad(sparsefuse.snake(xr, alpha), (xr, alpha), x), 500):7.1f} us/call")

    for dtype in (torch.float32, torch.bfloat16):
        for B, C, T in [(1, 1024, 65536), (8, 512, 16384), (1, 512, 1888), (1, 64, 120832)]:
            sets = [(torch.randn(B, C, T, device="cuda", dtype=dtype), torch.randn(B, C, T, device="cuda", dtype=dtype))
                    for _ in range(max(2, (256 << 20) // (2 * B * C * T * x.element_size())))]
            a = torch.rand(C, device="cuda") + 0.5
            floor = 3 * B * C * T * sets[0][0].element_size()
            line = f"bwd {str(dtype):15s} [{B},{C},{T}]"
            for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)]:
                nt = triton.cdiv(T, block)
                gx = torch.empty_like(sets[0][0])
                ga = torch.empty(C, device="cuda")
                part = torch.empty(B * C * nt, device="cuda")
                arr = torch.zeros(C, dtype=torch.int32, device="cuda")
                i = [0]

                def run():
                    i[0] = (i[0] + 1) % len(sets)
                    xx, gg = sets[i[0]]
                    arr.zero_()
                    S.snake_bwd_kernel[(B * C * nt,)](gg, xx, a, gx, ga, part, arr, B * nt, C, T, C * T, T, C * T, T, 1e-9,
                                                      BLOCK_T=block, SIN_MODE=0, WIDE_INDEX=False, NEED_ALPHA_GRAD=True, ONE_PROGRAM_PER_CHANNEL=False,
                                                      num_warps=warps)

                t = triton.testing.do_bench(run, warmup=20, rep=100, return_mode="median") * 1e-3
                line += f" {block}/{warps}: {floor / t / 1e9:5.0f}GB/s"
            print(line)


if __name__ == "__main__":
    main()
