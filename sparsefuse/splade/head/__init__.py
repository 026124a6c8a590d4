"""Fused SPLADE head: the masked LM's vocabulary logits pooled over the sequence, without the logits in memory.

    logits[b, s, v] = hidden[b, s, :] . weight[v, :] + bias[v]          hidden [B, S, H], weight [V, H] (tied decoder)
    max:  out[b, v] = max_s log1p(relu(logits[b, s, v])) * mask[b, s]    (SPLADE v2+, naver/splade, SpladePooling)
    sum:  out[b, v] = sum_s log1p(relu(logits[b, s, v])) * mask[b, s]    (SPLADE v1)

A position whose mask is 0 is skipped (its logits, NaN or not, never reach the result); any other mask value keeps
the position and weighs its score, as the formulas say (a 0/1 mask: plain SPLADE). So a column whose kept logits are
all negative scores 0, and a fully masked row is all zeros.

Precision: fp32/fp16/bf16 inputs (hidden and weight of one dtype; bias any float dtype); logits accumulate in fp32,
``log1p`` is evaluated accurately near 0, the output is rounded once to the input dtype. fp32 products use exact
fp32 (``input_precision="ieee"``) unless ``torch.set_float32_matmul_precision`` allows TF32, as for torch.matmul.
NaN logits propagate to the output (the argmax stored for a NaN column is unspecified).

Layout: :mod:`.reference` (plain torch; ground truth and CPU fallback), :mod:`.kernels` (forward GEMM with the
pooling as its epilogue), :mod:`.sum_kernels` (sum-pooling backward), :mod:`.launch` (configs and tuning
measurements, launches, the max-pooling backward through the shared sparse core), :mod:`.op` (``torch.library``
ops, autograd), :mod:`.functional` (:func:`splade_pool`).
"""

from .functional import POOLINGS, SPLADE_DTYPES, splade_pool
from .kernels import splade_fwd_combine_kernel, splade_fwd_kernel
from .op import splade_pool_backward_op, splade_pool_op
from .reference import torch_splade_pool
from .sum_kernels import splade_sum_bwd_hidden_kernel, splade_sum_bwd_weight_kernel

__all__ = [
    "splade_pool",
    "torch_splade_pool",
    "splade_pool_op",
    "splade_pool_backward_op",
    "POOLINGS",
    "SPLADE_DTYPES",
    "splade_fwd_kernel",
    "splade_fwd_combine_kernel",
    "splade_sum_bwd_hidden_kernel",
    "splade_sum_bwd_weight_kernel",
]
