"""Probe: warps and entries per step of TwELL kernel 2 (fused up/down, issue 5). The ELL gather ran 1.2-1.7x faster
with one warp per program (probe_gather_config.py): with more warps, each step's sums crossed warps through shared
memory. Kernel 2 holds a whole output row (BLOCK_D >= K) and sums both over K (u = x . W_up[n]) and over the step's
entries; its plan uses at least 4 warps. This times twell_mlp(method="twell") at M in {1, 16, 256, 2048} on the
paper's 1.5B shape (K=2048, N=5632, bf16, synthetic gate statistics at ~30 non-zeros per token) and the 8B layer's
K=4096, under the library plan and under (warps, entries per step) overrides. Median us, CUDA graphs over rotated
inputs. Usage: cd scripts && python probe_twell_warps.py"""

from __future__ import annotations

import dataclasses

import torch
import triton

from probe_decode import time_graph
from sparsefuse import twell_mlp
from sparsefuse.ffn import twell as tw
from sparsefuse.ffn.synthetic import synthetic_ffn


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    default = tw._up_down_plan
    for K, N in [(2048, 5632), (4096, 14336)]:
        ffn = synthetic_ffn(K, N, dtype=torch.bfloat16, device="cuda", seed=0)
        for M in [1, 16, 256, 2048]:
            sets = [(ffn.make_input(M, 30.0), ffn.w_gate, ffn.w_up, ffn.w_down) for _ in range(3)]
            ref = twell_mlp(*sets[0], method="dense").float()
            lib = time_graph(lambda x, g, u, d: twell_mlp(x, g, u, d, method="twell"), sets)
            results = []
            for warps in [1, 2, 4, 8]:
                for block_j in [1, 2, 4, 8]:
                    def plan(*args, warps=warps, block_j=block_j, **kw):
                        return dataclasses.replace(default(*args, **kw), num_warps=warps, block_j=block_j)
                    tw._up_down_plan = plan
                    try:
                        out = twell_mlp(*sets[0], method="twell").float()
                        err = float((out - ref).abs().max() / ref.abs().max())
                        t = time_graph(lambda x, g, u, d: twell_mlp(x, g, u, d, method="twell"), sets)
                        results.append((t, warps, block_j, err))
                    except Exception as e:  # noqa: BLE001 (a config the compiler refuses)
                        print(f"  w{warps} j{block_j}: {type(e).__name__}", flush=True)
                    finally:
                        tw._up_down_plan = default
            p = default(M, K, triton.cdiv(N, 64), torch.device("cuda"))
            print(f"K={K} N={N} M={M}: library (w{p.num_warps} j{p.block_j}) {lib:8.1f} us; "
                  + ", ".join(f"w{w} j{j} {t:.1f}" for t, w, j, _ in sorted(results)[:6])
                  + f"; worst rel err {max(r[3] for r in results):.1e}", flush=True)


if __name__ == "__main__":
    main()
