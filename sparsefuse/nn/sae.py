"""A JumpReLU SAE module whose parameters (and state_dict keys) are SAELens' ``JumpReLUSAE``'s.

Forward: ``acts = jumprelu((x - b_dec) @ W_enc + b_enc, threshold)``, ``recon = acts @ W_dec + b_dec``.
Without autograd it is :func:`sparsefuse.sae.jumprelu_sae_forward`: by default (``max_l0=None``) cuBLAS encode,
JumpReLU in place, then ``sparse_decode`` (auto) -- the fastest; with ``max_l0`` set, the fused encode into ELL
(the dense [tokens, d_sae] activations never reach memory) and a gather of only the fired features' decoder rows.
With autograd (or ``return_feature_acts``) the encode is the dense matmul and the decode sparse.
"""

from __future__ import annotations

import torch
from torch import nn

from ..sae import jumprelu_sae_forward, sparse_decode


class SparseJumpReLUSAE(nn.Module):
    """Parameters: W_enc [d_in, d_sae], b_enc [d_sae], threshold [d_sae], W_dec [d_sae, d_in], b_dec [d_in]."""

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        *,
        max_l0: int | None = None,
        apply_b_dec_to_input: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.W_enc = nn.Parameter(torch.empty(d_in, d_sae, **kw))
        self.b_enc = nn.Parameter(torch.zeros(d_sae, **kw))
        self.threshold = nn.Parameter(torch.zeros(d_sae, **kw))
        self.W_dec = nn.Parameter(torch.empty(d_sae, d_in, **kw))
        self.b_dec = nn.Parameter(torch.zeros(d_in, **kw))
        nn.init.kaiming_uniform_(self.W_dec)
        with torch.no_grad():
            self.W_enc.copy_(self.W_dec.t())
        self.max_l0, self.apply_b_dec_to_input = max_l0, apply_b_dec_to_input

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_in] -> feature activations [..., d_sae] (zero where pre-activation <= threshold)."""
        sae_in = x - self.b_dec if self.apply_b_dec_to_input else x
        pre = sae_in @ self.W_enc + self.b_enc
        if torch.is_grad_enabled() and pre.requires_grad:
            return torch.relu(pre) * (pre > self.threshold)
        return pre.masked_fill_(pre <= self.threshold.clamp(min=0), 0)  # inference: one in-place pass

    def decode(self, feature_acts: torch.Tensor) -> torch.Tensor:
        # max_l0: the width of "fixed" where auto picks it (the planner weighs it against the scan and cuBLAS)
        return sparse_decode(feature_acts, self.W_dec, max_l0=self.max_l0) + self.b_dec

    def forward(self, x: torch.Tensor, *, return_feature_acts: bool = False):
        params = (x, self.W_enc, self.b_enc, self.threshold, self.W_dec, self.b_dec)
        if not return_feature_acts and not (torch.is_grad_enabled() and any(t.requires_grad for t in params)):
            return jumprelu_sae_forward(
                x,
                self.W_enc,
                self.b_enc,
                self.threshold,
                self.W_dec,
                self.b_dec,
                apply_b_dec_to_input=self.apply_b_dec_to_input,
                max_l0=self.max_l0,
            )
        acts = self.encode(x)
        recon = self.decode(acts)
        return (recon, acts) if return_feature_acts else recon
