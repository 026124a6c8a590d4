"""TopK SAE encode that never materialises the dense pre-activations.

    pre      = (x - b_dec) @ W_enc + b_enc          x [M, d_in], W_enc [d_in, d_sae]   (then * feature_scale)
    selected = the k largest entries of each row of pre
    top_acts = relu(pre[selected])                   (SAELens ``TopK``: select on the raw pre-activation, then ReLU)

Selection is on the float32 pre-activation (fp32 accumulation). Each (value, feature) pair is packed into one int64
*sort key* -- the float's order-preserving integer image in the high 32 bits and ``0x7FFFFFFF - feature`` in the
low 32 -- so one integer comparison orders by value and breaks exact ties towards the lower feature index, NaN
counts as larger than every number (as in ``torch.topk``), and -0.0 equals +0.0. Results are sorted by decreasing
pre-activation, ties by increasing feature index: deterministic from run to run. SAELens calls
``torch.topk(sorted=False)`` on pre-activations rounded to the SAE dtype, so its order is unspecified and, in
bfloat16/float16, its choice among features whose rounded values tie is arbitrary; ours is the exact top-k of the
float32 values.

Kernel: a program owns BLOCK_M tokens and a group of feature columns. For each [BLOCK_M, BLOCK_N] tile of ``pre``
(``tl.dot``, fp32 accumulation) it merges the tile into a running top-k per token held in registers: only entries
above the token's current k-th best key are candidates, and they are inserted largest first, each replacing the
current minimum, so a tile costs one pass per candidate of its busiest token (after the first tiles, a few).
Every group writes its k best keys; ``torch.topk`` over the [M, groups * k] candidates finishes. Memory:
M * groups * k keys, never M * d_sae. k above :data:`~sparsefuse.sae.topk.launch.MAX_KERNEL_K` (rounded up to a
power of two) runs the same selection in plain torch, a chunk of features at a time.

Autograd: gradients for x, W_enc, b_enc and b_dec (the backward scatters the k gradients into a dense
[M, d_sae] buffer and uses dense matmuls, like the dense encode's backward); ``feature_scale`` gets none.
"""

from __future__ import annotations

import torch

from ..._validation import autocast_operands, check_topk_encode, flat_rows
from .op import topk_encode_op

ACTIVATIONS = ("relu", "none")


def topk_encode(
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    k: int,
    *,
    b_dec: torch.Tensor | None = None,
    activation: str = "relu",
    feature_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TopK SAE encode without the dense pre-activations (SAELens ``TopKSAE.encode`` semantics).

    Args:
        x: [..., d_in], float32/float16/bfloat16.
        W_enc: [d_in, d_sae] (cast to x's dtype tile by tile); b_enc: [d_sae].
        k: features kept per token, 1 <= k <= d_sae.
        b_dec: [d_in], subtracted from x first (SAELens ``apply_b_dec_to_input``); the difference is rounded to
            x's dtype as SAELens does.
        activation: "relu" (SAELens ``TopK``: ReLU after the selection) or "none" (raw pre-activations).
        feature_scale: optional [d_sae] multiplier of the pre-activations before the selection (SAELens
            ``rescale_acts_by_decoder_norm``: ``W_dec.norm(dim=-1)``); not differentiated.
    Returns:
        (top_indices int64 [..., k], top_acts [..., k] in x's dtype), sorted by decreasing pre-activation, exact
        ties by increasing feature index (see module docstring for NaN and rounding).
    """
    op = "topk_encode"
    x, W_enc = autocast_operands(x, W_enc)  # x @ W_enc under autocast, as torch
    check_topk_encode(op, x, W_enc, b_enc, k, b_dec, activation, ACTIVATIONS, feature_scale)
    acts, indices = topk_encode_op(flat_rows(x), W_enc, b_enc, b_dec, feature_scale, k, activation == "relu")
    batch = x.shape[:-1]
    return indices.reshape(*batch, k), acts.reshape(*batch, k)
