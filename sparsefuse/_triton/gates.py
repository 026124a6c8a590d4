"""The gate tests every kernel of the ReLU family shares, so that the pattern, the product and a recompute fire on
exactly the same entries (the counts that place the pairs depend on it)."""

import triton
import triton.language as tl


@triton.jit
def fires(v, threshold):
    """Where a gate of pre-activations ``v`` fires: v > threshold (0: ReLU; above: FATReLU, its threshold on v's
    dtype grid: :func:`sparsefuse._backend.threshold_in`), or NaN (it propagates). Compared in fp32, exact for every
    input dtype (the interpreter compares bf16 by its raw bits, where -0.0 would fire and -1 be > 0)."""
    v = v.to(tl.float32)
    return (v > threshold) | (v != v)


@triton.jit
def relu_keep_nan(v):
    """relu(v) in fp32 with NaN kept, as torch.relu keeps it (dReLU's up factor)."""
    v = v.to(tl.float32)
    return tl.where(v <= 0, 0.0, v)  # NaN <= 0 is false
