"""Ground truth of the TopK encode: the selection over the float64 pre-activations."""

from __future__ import annotations

import torch


def torch_topk_encode(
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    k: int,
    b_dec=None,
    activation: str = "relu",
    feature_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference: (top_indices int64 [M, k], top_acts float64 [M, k]) sorted by decreasing pre-activation,
    exact ties by increasing feature index, NaN first."""
    sae_in = x.reshape(-1, x.shape[-1]).double()
    if b_dec is not None:
        sae_in = sae_in - b_dec.double()
    pre = sae_in @ W_enc.double() + b_enc.double()
    if feature_scale is not None:
        pre = pre * feature_scale.double()
    pre = torch.where(pre == 0, 0.0, pre)  # -0.0 ties with +0.0
    order = torch.sort(pre, dim=1, descending=True, stable=True).indices[:, :k]
    acts = pre.gather(1, order)
    return order, (acts.relu() if activation == "relu" else acts)
