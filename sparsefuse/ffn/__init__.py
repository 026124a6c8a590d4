"""Activation-sparse feed-forward blocks (TwELL): the gate matmul writes its ReLU activations compacted per tile,
and only the fired rows of the up and down projections are read. See :mod:`sparsefuse.ffn.twell`; realistic
sparse inputs for tests and benchmarks: :mod:`sparsefuse.ffn.synthetic`."""

from .twell import (
    DEFAULT_COMPRESSION,
    BlockPlan,
    CostModel,
    SparsityMonitor,
    predicted_block_time,
    predicted_times,
    torch_relu_mlp,
    torch_twell_mlp,
    twell_down_layout,
    twell_gate,
    twell_mlp,
    twell_relu_mlp,
    twell_to_ell,
    twell_up_down,
)

__all__ = [
    "twell_mlp",
    "twell_relu_mlp",
    "twell_gate",
    "twell_up_down",
    "twell_to_ell",
    "twell_down_layout",
    "torch_twell_mlp",
    "torch_relu_mlp",
    "SparsityMonitor",
    "CostModel",
    "predicted_times",
    "predicted_block_time",
    "BlockPlan",
    "DEFAULT_COMPRESSION",
]
