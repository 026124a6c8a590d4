"""Ground truth of the SAE decode."""

from __future__ import annotations

import torch


def torch_sparse_decode(feature_acts: torch.Tensor, W_dec: torch.Tensor) -> torch.Tensor:
    """Reference, in float64: ``sum_f feature_acts[..., f] * W_dec[f]`` over the features that fired (non-zero
    activations) only. A feature that did not fire contributes exactly zero whatever its decoder row holds -- where
    the dense product would give ``0 * NaN = NaN`` -- as ``topk_decode`` and ``torch.sparse.mm`` give it; a fired
    feature's non-finite row, or a NaN / inf activation, propagates as in the dense float64 product.

    The decoder rows holding a NaN or infinity (rare) are summed entry by entry over the tokens that fired them, the
    rest by one dense product in which a zero activation's term is an exact zero."""
    acts, w = feature_acts.double(), W_dec.double()
    finite = torch.isfinite(w).all(dim=1)
    # the finite rows' features by the product (an inf activation of a non-finite row's feature must not meet a 0)
    out = torch.where(finite, acts, 0.0) @ torch.where(finite[:, None], w, 0.0)
    bad = (~finite).nonzero().squeeze(1)
    if bad.numel():
        rows = acts.reshape(-1, w.shape[0])
        tokens, j = (rows[:, bad] != 0).nonzero(as_tuple=True)
        features = bad[j]
        out.view(-1, w.shape[1]).index_add_(0, tokens, rows[tokens, features, None] * w[features])
    return out
