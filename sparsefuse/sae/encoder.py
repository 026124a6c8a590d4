"""The inputs of a JumpReLU SAE encode, as the shared core's :class:`~sparsefuse.sparse.ThresholdedLinear`: a
consumer of the fused encode's ELL (:func:`~sparsefuse.sparse.sparse_matmul`'s ``encoder=``) recomputes an
overflowed token's activations from them on the device."""

from __future__ import annotations

import torch

from ..sparse import ThresholdedLinear


class JumpReLUEncoder(ThresholdedLinear):
    """``relu(pre) * (pre > threshold)`` with ``pre = (x - b_dec) @ W_enc + b_enc`` (SAELens JumpReLU).

    x [M, d_in], W_enc [d_in, d_sae], b_enc and threshold [d_sae], b_dec [d_in] or None. The SAE's names are views
    of the generic layer's fields (W_enc = weight, b_enc = bias, b_dec = input_shift)."""

    def __init__(
        self,
        x: torch.Tensor,
        W_enc: torch.Tensor,
        b_enc: torch.Tensor,
        threshold: torch.Tensor,
        b_dec: torch.Tensor | None = None,
    ) -> None:
        super().__init__(x, W_enc, b_enc, threshold, b_dec)

    @property
    def W_enc(self) -> torch.Tensor:
        return self.weight

    @property
    def b_enc(self) -> torch.Tensor:
        return self.bias

    @property
    def b_dec(self) -> torch.Tensor | None:
        return self.input_shift

    def __repr__(self) -> str:
        fields = ("x", "W_enc", "b_enc", "threshold", "b_dec")
        return f"JumpReLUEncoder({', '.join(f'{f}={getattr(self, f)!r}' for f in fields)})"
