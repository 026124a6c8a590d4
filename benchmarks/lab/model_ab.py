"""One line of eager timings of a patched sparse ReLU Llama, for an A/B of two source trees on one GPU.

Run it from each tree's root in turn (``cd TREE && PYTHONPATH=$PWD python /path/to/model_ab.py LABEL``), rounds
interleaved, so host-speed drift shows as the spread between rounds. It times the user's eager paths on an
8-layer 1.5B-shape model (bf16, ~30 of 5632 neurons fire): a one-token step at batch 1 (host-bound: where per-call
checks show), a 4 x 2048 prefill, and a 2 x 2048 AdamW training step with the sparse training step and its L1 term.
Only APIs present in older trees are used (the training method is set on the modules, not by patching twice)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from sparsefuse.ffn.synthetic import synthetic_llama
from sparsefuse.integrations.transformers import l1_loss, patch_llama
from sparsefuse.nn.ffn import SparseGatedMLP


def median_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(label: str) -> None:
    torch.manual_seed(0)
    model = patch_llama(synthetic_llama("1.5B", num_hidden_layers=8, device="cuda"))
    one = torch.randint(0, 32000, (1, 1), device="cuda")
    prefill = torch.randint(0, 32000, (4, 2048), device="cuda")
    with torch.no_grad():
        decode_ms = median_ms(lambda: model(one, use_cache=False), 200)
        prefill_ms = median_ms(lambda: model(prefill, use_cache=False), 20)
    for module in model.modules():
        if isinstance(module, SparseGatedMLP):
            module.train_method = "hybrid"
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, 32000, (2, 2048), device="cuda")

    def step() -> None:
        loss = model(batch, labels=batch, use_cache=False).loss + 1e-5 * l1_loss(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_ms = median_ms(step, 10)
    print(f"{label}: decode1 {decode_ms:.3f} ms  prefill4x2048 {prefill_ms:.2f} ms  train2x2048 {train_ms:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tree")
