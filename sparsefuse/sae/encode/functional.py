"""JumpReLU SAE encode that emits the sparse format from the matmul's epilogue.

    pre  = (x - b_dec) @ W_enc + b_enc          x [M, d_in], W_enc [d_in, d_sae]
    acts = relu(pre) * (pre > threshold)          (SAELens JumpReLU; threshold in fp32)

A program computes a [BLOCK_M tokens, BLOCK_N features] tile of ``pre`` with ``tl.dot`` (fp32 accumulation) and,
instead of writing it, keeps the entries that fire: each fired entry claims a slot in its token's ELL row with
one integer atomic and is stored there. ``x - b_dec`` is computed once before the launch. The dense
[M, d_sae] activations never reach memory. Counts are exact totals; a token that fired more than ``max_l0``
features is marked overflowed (``ELL.overflowed()``): decoding it without its dense row yields NaN, never a
silently truncated reconstruction, and ``validate=True`` raises instead (reading the largest count: one host sync,
a graph break under torch.compile). Entries race for slots, so a row is
sorted by feature id after the kernel: the ELL, and what is decoded from it, are the same on every run. (A row that
overflowed keeps the first ``max_l0`` entries to claim a slot, in feature order; it is recomputed, not decoded from
them.)
"""

from __future__ import annotations

import torch

from ..._validation import autocast_operands, check_jumprelu_encode, flat_rows
from ...sparse import ELL
from .op import jumprelu_encode_op


def jumprelu_encode(
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    threshold: torch.Tensor,
    *,
    b_dec: torch.Tensor | None = None,
    max_l0: int = 256,
    validate: bool = False,
) -> ELL:
    """Fused JumpReLU encode straight into ELL (see module docstring). x [..., d_in] -> ELL of [M, d_sae]."""
    op = "jumprelu_encode"
    x, W_enc = autocast_operands(x, W_enc)  # x @ W_enc under autocast, as torch
    check_jumprelu_encode(op, x, W_enc, b_enc, threshold, b_dec, max_l0)
    d_in, d_sae = W_enc.shape
    values, indices, counts = jumprelu_encode_op(flat_rows(x), W_enc, b_enc, threshold, b_dec, max_l0)
    ell = ELL(values, indices, counts, d_sae)
    if validate and values.shape[0]:
        largest = int(ell.counts.max())
        if largest > max_l0:
            raise ValueError(f"{op}: a token fired {largest} features but max_l0={max_l0}; raise max_l0")
    return ell
