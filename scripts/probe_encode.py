"""Probe: the fused JumpReLU encode (jumprelu_encode_kernel) against cuBLAS at Gemma Scope 2B 65k, 4096 tokens,
bf16 -- with b_dec subtracted inside the K loop (HAS_B_DEC: the x tile passes through registers before tl.dot)
and with ``x - b_dec`` computed once beforehand, and per autotune config. Counting first: 2 * 4096 * 2304 * 65536
= 1.24 TFLOP; at the run's cuBLAS rate that is the floor; the epilogue adds ~L0 stores per token.
Also the epilogue's slot claims (per tile row: a cumsum; per fired entry: one atomic each), sparse and dense.
Usage: cd scripts && python probe_encode.py [--configs]"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from sparsefuse.sae import encode as enc
from sparsefuse.sae.encode import jumprelu_encode


def main() -> None:
    torch.manual_seed(0)
    M, d_in, d_sae, dtype = 4096, 2304, 65536, torch.bfloat16
    x = torch.randn(M, d_in, device="cuda").to(dtype)
    W = (torch.randn(d_in, d_sae, device="cuda") / d_in**0.5).to(dtype)
    b_enc = (torch.randn(d_sae, device="cuda") * 0.1).to(dtype)
    b_dec = (torch.randn(d_in, device="cuda") * 0.1).to(dtype)
    pre = (x - b_dec) @ W + b_enc
    threshold = pre[:512].float().quantile(1 - 72 / d_sae, dim=0).clamp(min=0)  # ~72 per token
    flops = 2 * M * d_in * d_sae
    rate = lambda us: f"{flops / us / 1e6:6.1f} TFLOP/s"  # noqa: E731
    t = do_bench(lambda: x @ W, warmup=20, rep=200) * 1e3
    print(f"cuBLAS x @ W_enc                 {t:8.1f} us {rate(t)}")
    sae_in = (x - b_dec).to(dtype)
    ell = jumprelu_encode(sae_in, W, b_enc, threshold)
    print(f"mean L0 {ell.counts.float().mean():.1f}, max {int(ell.counts.max())}")
    configs = enc.jumprelu_encode_kernel.configs
    for per_entry in (False, True):
        enc.CLAIM_PER_ENTRY = per_entry
        enc.jumprelu_encode_kernel.configs = configs
        enc.jumprelu_encode_kernel.cache.clear()
        t = do_bench(lambda: jumprelu_encode(x, W, b_enc, threshold, b_dec=b_dec), warmup=20, rep=200) * 1e3
        print(f"jumprelu_encode (x - b_dec first), claims per {'entry' if per_entry else 'tile row'}: {t:8.1f} us "
              f"{rate(t)}  tuned: {enc.jumprelu_encode_kernel.best_config}")
        for cfg in configs if "--configs" in sys.argv else []:
            enc.jumprelu_encode_kernel.configs = [cfg]
            enc.jumprelu_encode_kernel.cache.clear()
            t = do_bench(lambda: jumprelu_encode(sae_in, W, b_enc, threshold), warmup=10, rep=100) * 1e3
            print(f"  {str(cfg):70s} {t:8.1f} us {rate(t)}")
    enc.jumprelu_encode_kernel.configs = configs
    dense_threshold = torch.full_like(threshold, -1.0)  # every positive pre-activation fires: the contended case
    for per_entry in (False, True):
        enc.CLAIM_PER_ENTRY = per_entry
        enc.jumprelu_encode_kernel.cache.clear()
        t = do_bench(lambda: jumprelu_encode(sae_in, W, b_enc, dense_threshold), warmup=5, rep=30) * 1e3
        print(f"half the features fire, claims per {'entry' if per_entry else 'tile row'}: {t:8.1f} us "
              f"tuned: {enc.jumprelu_encode_kernel.best_config}")
    from sparsefuse.sae.topk import topk_encode

    t = do_bench(lambda: topk_encode(x, W, b_enc, 64, b_dec=b_dec), warmup=10, rep=50) * 1e3
    print(f"topk_encode k=64 (x - b_dec first) {t:8.1f} us {rate(t)}")

if __name__ == "__main__":
    main()
