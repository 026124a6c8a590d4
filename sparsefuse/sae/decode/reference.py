"""Ground truth of the SAE decode."""

from __future__ import annotations

import torch


def torch_sparse_decode(feature_acts: torch.Tensor, W_dec: torch.Tensor) -> torch.Tensor:
    """Reference: the dense product in float64."""
    return feature_acts.double() @ W_dec.double()
