"""sparsefuse: Triton GPU kernels for PyTorch that turn activation sparsity and operator fusion into speed.

Functional API (mirrors ``torch.nn.functional``): :func:`snake`, :func:`celu`, :func:`celu_`, :func:`sparse_decode`,
:func:`topk_decode`, :func:`jumprelu_encode`, :func:`topk_encode`, :func:`splade_pool`, :func:`twell_mlp`,
:func:`twell_relu_mlp`, :func:`rms_norm`.
Modules: :mod:`sparsefuse.nn`. Integrations with model libraries: :mod:`sparsefuse.integrations`.
Which path a call takes: :func:`backend_for` (``"triton"``, ``"interpreter"`` or ``"torch"``). Which method
``method="auto"`` picks and why: :func:`explain`; its knobs: :func:`planning`.
"""

from . import nn  # noqa: F401  (sparsefuse.nn: drop-in modules)
from ._backend import Backend, backend_for, track_launches
from ._plan import Explanation, explain, planning
from .activations.celu import celu, celu_
from .activations.snake import snake
from .ffn import twell_mlp, twell_relu_mlp
from .norms import rms_norm
from .sae import jumprelu_encode, sparse_decode, topk_decode, topk_encode
from .splade import splade_pool

__version__ = "0.1.0"

__all__ = [
    "explain",
    "Explanation",
    "planning",
    "snake",
    "celu",
    "celu_",
    "sparse_decode",
    "topk_decode",
    "jumprelu_encode",
    "topk_encode",
    "splade_pool",
    "twell_mlp",
    "twell_relu_mlp",
    "rms_norm",
    "backend_for",
    "Backend",
    "track_launches",
    "__version__",
]
