"""Sparse training of the gated ReLU block (the TwELL paper's Hybrid half): every product of the step but the
gate's forward runs on the gate's sparsity pattern, and the backward keeps only sparse activations.
:func:`hybrid_mlp` is the function; :mod:`.reference` holds the float64 ground truth, product by product."""

from ...sparse.block_pack import spilled_blocks
from .functional import HybridMLPOutput, hybrid_mlp, hybrid_relu_mlp, sparsity_stats
from .graphed import release_graphs
from .op import REBUILDS
from .reference import StepGrads, hybrid_step_reference

__all__ = [
    "hybrid_mlp",
    "hybrid_relu_mlp",
    "HybridMLPOutput",
    "sparsity_stats",
    "hybrid_step_reference",
    "StepGrads",
    "REBUILDS",
    "spilled_blocks",
    "release_graphs",
]
