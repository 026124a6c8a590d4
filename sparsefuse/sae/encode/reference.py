"""Ground truth of the fused JumpReLU encode: the dense activations in float64."""

from __future__ import annotations

import torch

from ..encoder import JumpReLUEncoder


def torch_jumprelu_encode(
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    threshold: torch.Tensor,
    b_dec: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense reference activations [M, d_sae] in float64 (x [..., d_in] flattened to M rows)."""
    return JumpReLUEncoder(x.reshape(-1, x.shape[-1]), W_enc, b_enc, threshold, b_dec).reference_activations()
