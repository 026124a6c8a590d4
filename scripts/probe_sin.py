"""GPU probe: which sine should Snake's kernel use by default?

Times the Snake forward with four sine implementations at memory-bound sizes, next to a plain copy of the same
bytes, and measures each one's error on sin(u)^2 against float64. Also reports what ``tl.sin`` lowers to in PTX.
Run on a GPU: ``python3 scripts/probe_sin.py``.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

import sparsefuse.activations.snake as S


@triton.jit
def _sin_variant(u, MODE: tl.constexpr):
    if MODE == 0:
        return tl.sin(u)
    elif MODE == 1:
        return libdevice.sin(u)
    elif MODE == 2:
        s, _ = S._sin_cos_mod_pi(u, False, S.SIN_ACCURATE)  # sparsefuse's default (reduction mod pi + polynomial)
        return s
    else:
        return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def probe_fwd_kernel(x_ptr, alpha_ptr, y_ptr, C, T, BLOCK_T: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    n_tb = tl.cdiv(T, BLOCK_T)
    row = pid // n_tb
    tb = pid - row * n_tb
    c = row % C
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    m = t < T
    a = tl.load(alpha_ptr + c).to(tl.float32)
    x = tl.load(x_ptr + row.to(tl.int64) * T + t, mask=m).to(tl.float32)
    s = _sin_variant(a * x, MODE)
    y = x + (1.0 / (a + 1e-9)) * s * s
    tl.store(y_ptr + row.to(tl.int64) * T + t, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def probe_sin2_kernel(u_ptr, out_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n)
    s = _sin_variant(u, MODE)
    tl.store(out_ptr + offs, s * s, mask=offs < n)


NAMES = {0: "tl.sin", 1: "libdevice.sin", 2: "poly (sparsefuse default)", 3: "sin.approx.f32"}


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for lim in (10.0, 1e3, 1e5):
        u = torch.linspace(-lim, lim, 1 << 22, device="cuda")
        ref = torch.sin(u.double()) ** 2
        for mode, name in NAMES.items():
            out = torch.empty_like(u)
            k = probe_sin2_kernel[(triton.cdiv(u.numel(), 1024),)](u, out, u.numel(), MODE=mode, BLOCK=1024)
            err = (out.double() - ref).abs().max().item()
            if lim == 10.0 and mode == 0:
                ptx = k.asm["ptx"]
                print("tl.sin PTX uses sin.approx:", "sin.approx" in ptx, "| calls __nv_sinf:", "__nv_sin" in ptx)
            print(f"|u|<={lim:g}  {name:18s} max |sin^2 err| = {err:.3g}")
    for dtype in (torch.float32, torch.bfloat16):
        for B, C, T in [(1, 1024, 65536), (8, 512, 16384)]:
            sets = [torch.randn(B, C, T, device="cuda").mul_(3).to(dtype) for _ in range(2)]
            alpha = torch.rand(C, device="cuda") + 0.5
            y = torch.empty_like(sets[0])
            nbytes = 2 * sets[0].numel() * sets[0].element_size()
            i = [0]

            def copy():
                i[0] ^= 1
                y.copy_(sets[i[0]])

            t_copy = triton.testing.do_bench(copy, warmup=50, rep=300, return_mode="median") * 1e-3
            line = f"{str(dtype):15s} [{B},{C},{T}] copy {nbytes / t_copy / 1e9:7.0f} GB/s |"
            for mode, name in NAMES.items():
                for block, warps in [(1024, 4), (2048, 8), (4096, 8)]:
                    def run():
                        i[0] ^= 1
                        probe_fwd_kernel[(B * C * triton.cdiv(T, block),)](sets[i[0]], alpha, y, C, T, BLOCK_T=block,
                                                                           MODE=mode, num_warps=warps)

                    t = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median") * 1e-3
                    line += f" {name}/{block}/{warps}: {100 * t_copy / t:5.1f}%"
            print(line)
    x = torch.randn(1, 1024, 65536, device="cuda")
    alpha = torch.rand(1024, device="cuda") + 0.5
    for fast in (False, True):
        t = triton.testing.do_bench(lambda: S.snake(x, alpha, fast_sin=fast), return_mode="median") * 1e-3
        print(f"sparsefuse.snake fp32 fast_sin={fast}: {2 * x.numel() * 4 / t / 1e9:.0f} GB/s")


if __name__ == "__main__":
    main()
