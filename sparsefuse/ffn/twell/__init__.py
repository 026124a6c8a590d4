"""Activation-sparse feed-forward blocks for ReLU LLMs: gate activations compacted into TwELL inside the gate
matmul, then only the fired rows of the up and down projections are touched.

Gated block (Llama-style, ``nn.Linear`` weight layouts, ``K`` = hidden size, ``N`` = intermediate size):

    h_g = relu(x @ W_gate^T + b_gate)        x [M, K], W_gate [N, K]
    y   = (h_g * (x @ W_up^T + b_up)) @ W_down^T + b_down        W_up [N, K], W_down [K, N]

Two steps (inference, :mod:`.kernels`):

1. The gate, as TwELL (see :class:`sparsefuse.sparse.TwELL`): from ``gate_gemm_min_tokens`` tokens cuBLAS's GEMM
   ``x @ W_gate^T`` and ``twell_pack_kernel`` over its output; below, ``twell_gate_fwd_kernel``, a ``tl.dot`` tile
   of [BLOCK_M tokens, TILE columns] whose epilogue packs it (the dense gate never reaches memory, but the rank's
   scan on the tensor-core accumulator's layout is slow past small batches). Either way one program owns a whole
   (rows, tile) block and applies the ReLU, so each row's in-tile rank is a ``cumsum`` over the tile -- no atomics,
   deterministic, column order. Counts are exact totals.
2. ``twell_up_down_fwd_kernel``: per token, walks its stored non-zeros: ``u = x[m] . W_up[n, :]`` (a contiguous
   row of ``up_proj.weight``), ``y[m] += h_g[m, n] * u * W_down^T[n, :]`` (a contiguous row when
   ``down_proj.weight`` is stored column-major: :func:`twell_down_layout`). fp32 accumulation throughout.

Overflow is never silent: a (token, tile) with more non-zeros than its ``TILE / C`` slots is flagged by its count;
kernel 2 skips that tile's stored entries and computes the whole tile: from the gate GEMM's pre-activation row (its
[M, N] output, kept for the call), whose fired columns it walks like stored entries, or below
``gate_gemm_min_tokens`` tokens recomputed from ``x`` and ``W_gate`` (a GEMV over TILE columns for that token
only). The result is exact whatever the sparsity, with no host sync. From ``heavy_pass_min_tokens`` tokens the heavy
tokens (an overflowed tile, or many entries) are listed on the device and split over more programs by a second
launch of kernel 2 (:mod:`.heavy_kernels`).

Other gates of the ReLU family (``activation=``, :mod:`.reference`): FATReLU fires where the gate pre-activation
exceeds a threshold (kernel 1 packs those entries, kernel 2 recomputes overflowed tiles with the same test); dReLU
multiplies by ``relu(x . W_up[n] + b_up)``, and kernel 2 skips the W_down rows where that is 0.

Non-gated block (``y = relu(x @ W_up^T + b_up) @ W_down^T + b_down``): kernel 1 on W_up, ``twell_to_ell_kernel``
packs the TwELL rows into ELL on the device, the shared :func:`sparsefuse.sparse.sparse_matmul` runs, and
``twell_overflow_down_kernel`` adds the overflowed tiles' terms in place.

Cost: kernel 1 is the gate matmul (``2 M K N`` flops) plus the TwELL writes; kernel 2 reads per token
``nnz * 2K`` weight elements (mostly L2 hits, since hot neurons are shared across tokens). At M=8192, K=2048, 30
non-zeros per token that is ~2 GB of row gathers against ~380 GFLOP of dense up/down matmuls: the fused path costs
the gate matmul plus an L2-bound gather. Large batches: ``method="block"`` (:mod:`.block`) runs the gate on cuBLAS
and the up and down products on tensor cores over each 64-token block's union of fired neurons.
``method="auto"`` picks by predicted time (:mod:`.auto`).

Gradients: the fused paths are inference-only; the functional API computes the dense block with plain torch ops
whenever autograd needs a gradient.

Files: reference.py (float64 ground truth), kernels.py, launch.py (TwELL launchers), block.py (row-block path),
auto.py (cost model, estimate), op.py (torch.library ops), functional.py (public functions).
"""

# Names with "X as X" are importable from here but are not part of __all__.
from ..._plan import SparsityMonitor
from .auto import CostModel, predicted_block_time, predicted_times
from .block import BLOCK_PLAN as BLOCK_PLAN
from .block import BlockPlan
from .functional import (
    DEFAULT_COMPRESSION,
    METHODS,
    twell_down_layout,
    twell_gate,
    twell_mlp,
    twell_relu_mlp,
    twell_to_ell,
    twell_up_down,
)
from .heavy_kernels import heavy_first_order_kernel as heavy_first_order_kernel
from .kernels import twell_gate_fwd_kernel as twell_gate_fwd_kernel
from .kernels import twell_overflow_down_kernel as twell_overflow_down_kernel
from .kernels import twell_to_ell_kernel as twell_to_ell_kernel
from .kernels import twell_up_down_fwd_kernel as twell_up_down_fwd_kernel
from .launch import STATS_TOKENS as STATS_TOKENS
from .op import twell_gate_op as twell_gate_op
from .op import twell_mlp_op as twell_mlp_op
from .op import twell_relu_mlp_op as twell_relu_mlp_op
from .op import twell_up_down_op as twell_up_down_op
from .reference import ACTIVATIONS as ACTIVATIONS
from .reference import torch_relu_mlp, torch_twell_mlp

__all__ = [
    "torch_twell_mlp",
    "torch_relu_mlp",
    "twell_gate",
    "twell_up_down",
    "twell_mlp",
    "twell_relu_mlp",
    "twell_to_ell",
    "twell_down_layout",
    "SparsityMonitor",
    "CostModel",
    "predicted_times",
    "predicted_block_time",
    "BlockPlan",
    "DEFAULT_COMPRESSION",
    "METHODS",
]
