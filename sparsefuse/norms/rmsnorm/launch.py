"""RMSNorm's launchers: allocate, size the grid, launch, ``record_launch``. Nothing here checks arguments
(functional.py did). CPU tensors without the interpreter run the plain-torch reference instead.

Cost model (x [M, D] of E bytes an element): the forward reads x and writes y (2E bytes an element, plus 4 bytes
of 1/rms a row); the backward reads x and dy and writes dx (3E), plus ``programs x D`` float32 partial weight
gradients (a few MB at most) and their sum. transformers' ``LlamaRMSNorm`` runs ~6 elementwise kernels forward and
~10 backward through float32 copies of x: ~10x the bytes."""

from __future__ import annotations

import dataclasses

import torch

from ... import _backend
from ..._backend import Backend, backend_for, cdiv, compute_dtype, new_output, next_power_of_2, record_launch, sm_count
from ..._plan.config import KnobGroup, current, register_knobs
from .kernels import rms_norm_bwd_kernel, rms_norm_fwd_kernel
from .reference import torch_rms_norm, torch_rms_norm_backward, torch_rms_norm_rstd


@dataclasses.dataclass(frozen=True)
class RMSNormKnobs(KnobGroup):
    """Which of RMSNorm's kernel paths a launch takes (registered as ``"rms_norm"``; read at each launch).

    ``single_max``: rows up to this many elements stay in registers (one read of x); longer rows are walked in
    chunks twice (once for the sum of squares, once to scale). ``chunk``: the elements of such a chunk (the smaller of
    it and ``single_max``, rounded up to a power of two). Tests lower both to cover the chunked path at small sizes."""

    single_max: int = 8192
    chunk: int = 4096


register_knobs("rms_norm", RMSNormKnobs())

TILE = 8192  # elements a program holds (BLOCK_M rows of BLOCK_D): memory-bound, ~32 fp32 values a thread
WARPS = 8
PROGRAMS_PER_SM = 4  # backward programs: each keeps one [D] weight-gradient share


def _blocks(D: int) -> tuple[bool, int, int]:
    """(SINGLE, BLOCK_M, BLOCK_D) for rows of D elements."""
    knobs: RMSNormKnobs = current().knobs("rms_norm")
    single = D <= knobs.single_max
    block_d = next_power_of_2(D) if single else next_power_of_2(min(knobs.chunk, knobs.single_max))
    return single, max(1, min(16, TILE // block_d)), block_d


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The result dtype: x's, promoted with the weight's (``weight * normed`` in LlamaRMSNorm)."""
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


def rms_norm_forward(x2: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, D] in :func:`out_dtype`, rstd [M] in the compute precision) for x2 [M, D] (unit column stride) and
    weight [D] (contiguous) or None."""
    M, D = x2.shape
    y = new_output((M, D), out_dtype(x2, weight), x2.device)
    rstd = new_output((M,), compute_dtype(x2.dtype), x2.device)
    if M == 0:
        return y, rstd
    if D == 0 or backend_for(x2) is Backend.TORCH:
        if D:
            _backend.warn_reference_once("rms_norm")
        y.copy_(torch_rms_norm(x2, weight, eps))
        rstd.copy_(torch_rms_norm_rstd(x2, eps))
        return y, rstd
    single, block_m, block_d = _blocks(D)
    rms_norm_fwd_kernel[(cdiv(M, block_m),)](
        x2,
        weight if weight is not None else x2,
        y,
        rstd,
        M,
        D,
        x2.stride(0),
        y.stride(0),
        eps,
        HAS_WEIGHT=weight is not None,
        SINGLE=single,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=WARPS,
    )
    record_launch("rms_norm_fwd_kernel")
    return y, rstd


def rms_norm_backward(
    grad_y: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x [M, D] in x2's dtype, grad_weight [D] in weight's dtype, or an empty tensor without a weight) from
    grad_y [M, D] (unit column stride), the forward's x2 and rstd."""
    M, D = x2.shape
    grad_x = new_output((M, D), x2.dtype, x2.device)
    if weight is None:
        grad_w = x2.new_empty(0)
    elif M == 0 or D == 0:
        grad_w = torch.zeros_like(weight)
    else:
        grad_w = new_output(weight.shape, weight.dtype, weight.device)
    if M == 0 or D == 0:
        return grad_x, grad_w
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("rms_norm")
        dx, dw = torch_rms_norm_backward(grad_y, x2, weight, rstd)
        grad_x.copy_(dx)
        if dw is not None:
            grad_w.copy_(dw)
        return grad_x, grad_w
    single, block_m, block_d = _blocks(D)
    programs = min(cdiv(M, block_m), PROGRAMS_PER_SM * sm_count(x2.device))
    partial = None
    if weight is not None:  # the chunked path adds into its row: it starts from zeros
        alloc = torch.empty if single else torch.zeros
        partial = alloc((programs, D), dtype=rstd.dtype, device=x2.device)
    rms_norm_bwd_kernel[(programs,)](
        grad_y,
        x2,
        weight if weight is not None else x2,
        rstd,
        grad_x,
        partial if partial is not None else rstd,
        M,
        D,
        grad_y.stride(0),
        x2.stride(0),
        grad_x.stride(0),
        HAS_WEIGHT=weight is not None,
        SINGLE=single,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=WARPS,
    )
    record_launch("rms_norm_bwd_kernel")
    if partial is not None:
        if partial.dtype == grad_w.dtype:
            torch.sum(partial, 0, out=grad_w)
        else:  # a float16/bfloat16 weight: its gradient summed in float32, then rounded
            grad_w.copy_(partial.sum(0))
    return grad_x, grad_w
