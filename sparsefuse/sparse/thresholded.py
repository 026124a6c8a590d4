"""The thresholded linear layer whose activations an ELL may hold (a JumpReLU encoder, a ReLU layer), and the
GEMV that recomputes a row's activations from the layer's inputs: how the gather product (:mod:`.spmm`) completes an
overflowed ELL row written by a fused encode, which never wrote the dense activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._validation import unit_last_stride


@dataclass(frozen=True)
class ThresholdedLinear:
    """A thresholded linear layer whose activations form the rows of a sparse operand, so that the gather product
    can recompute an overflowed ELL row on the device instead of reading its (incomplete) stored entries:

        activations = relu(pre) * (pre > threshold),   pre = (x - input_shift) @ weight + bias

    (e.g. a JumpReLU encoder; a ReLU layer is threshold 0)."""

    x: torch.Tensor  # [M, d_in]
    weight: torch.Tensor  # [d_in, n]
    bias: torch.Tensor  # [n]
    threshold: torch.Tensor  # [n]
    input_shift: torch.Tensor | None = None  # [d_in]

    def prepared(self) -> tuple[torch.Tensor, ...]:
        """(x, weight, bias, threshold, input_shift) with unit column strides, input_shift defaulting to a
        placeholder (never read)."""
        shift = self.input_shift if self.input_shift is not None else self.bias
        vectors = (unit_last_stride(v) for v in (self.bias, self.threshold, shift))  # read at unit stride
        return unit_last_stride(self.x), unit_last_stride(self.weight), *vectors

    def reference_activations(self) -> torch.Tensor:
        """float64 activations [M, n]; ``x - input_shift`` is rounded to x's dtype first, as the encode kernels feed
        it to tl.dot in that dtype."""
        shifted = self.x.double()
        if self.input_shift is not None:
            shifted = (shifted - self.input_shift.double()).to(self.x.dtype).double()
        pre = shifted @ self.weight.double() + self.bias.double()
        return torch.relu(pre) * (pre > self.threshold.double())


@triton.jit
def thresholded_linear_chunk(
    row,
    f,
    f_mask,
    x_ptr,
    stride_x,
    w_ptr,
    stride_w,
    bias_ptr,
    threshold_ptr,
    shift_ptr,
    d_in,
    HAS_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Activations [BLOCK_F] of input row ``row`` for outputs f of a :class:`ThresholdedLinear` (x [M, d_in],
    w [d_in, n], bias/threshold [n], shift [d_in]): relu(pre) * (pre > threshold), fp32. A GEMV: meant for the rare
    rows that overflowed."""
    pre = tl.zeros(f.shape, dtype=tl.float32)
    for e0 in range(0, d_in, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_mask = e < d_in
        xe = tl.load(x_ptr + row * stride_x + e, mask=e_mask, other=0.0).to(tl.float32)
        if HAS_SHIFT:
            xe -= tl.load(shift_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
        we = tl.load(
            w_ptr + e[:, None].to(tl.int64) * stride_w + f[None, :], mask=e_mask[:, None] & f_mask[None, :], other=0.0
        )  # [BLOCK_E, BLOCK_F]
        pre += tl.sum(xe[:, None] * we.to(tl.float32), axis=0)
    pre += tl.load(bias_ptr + f, mask=f_mask, other=0.0).to(tl.float32)
    threshold = tl.load(threshold_ptr + f, mask=f_mask, other=float("inf")).to(tl.float32)
    return tl.where(((pre > threshold) & (pre > 0)) | (pre != pre), pre, 0.0)  # NaN kept, as in the reference
