"""The row-block path of the gated block (``method="block"``, large batches): the gate on cuBLAS, then the up and
down products on tensor cores over each block of tokens' union of fired neurons."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ... import _backend
from ..._backend import next_power_of_2
from ...sparse.block_spmm import block_sparse_matmul
from ...sparse.compact import dense_to_row_block_pattern
from ...sparse.sddmm import block_sddmm


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Tokens grouped ``block_rows`` at a time, unions per ``tile`` columns. From ``sort_min_tokens`` tokens up
    (when ``sort_rows``) the tokens are first ordered by their gate non-zero count over the first ``sort_fraction``
    of the columns (:func:`sparsefuse.sparse.compact.count_order`; counting all of them costs nothing extra since
    the pattern's one pass over the gate output reads every column).

    Measured on an H200 (1.5B shape, 30 non-zeros): 64 rows beat 32 and 128; sorting shrinks the unions from 22% to
    13-14% of N and the whole path by 5-10% from 8192 tokens up (8B layer: 1.88x -> 2.00x dense), but costs 5-30%
    at 1024-4096 tokens, hence the threshold."""

    block_rows: int = 64
    tile: int = 256
    sort_rows: bool = True
    sort_fraction: float = 1.0
    sort_min_tokens: int = 8192

    def sort_sample(self, N: int) -> int:
        """Columns counted to sort the tokens."""
        return max(1, math.ceil(N * self.sort_fraction))

    def sorts(self, M: int) -> bool:
        return self.sort_rows and M >= self.sort_min_tokens


BLOCK_PLAN = BlockPlan()
_INTERPRET_BLOCK_PLAN = BlockPlan(block_rows=16, tile=64, sort_min_tokens=64)  # the tests cover both orders


def block_plan(N: int) -> BlockPlan:
    """The plan for N intermediate columns (tiles no wider than the padded N)."""
    plan = _INTERPRET_BLOCK_PLAN if _backend.INTERPRET else BLOCK_PLAN
    tile = min(plan.tile, max(16, next_power_of_2(N)))
    return dataclasses.replace(plan, tile=tile) if tile != plan.tile else plan


def launch_block_mlp(
    x2,
    w_gate,
    b_gate,
    w_up,
    b_up,
    w_down_t,
    b_down,
    plan: BlockPlan | None = None,
    *,
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated block through row-block unions (tensor cores throughout):

    1. ``pre = x W_gate^T + b_gate`` by cuBLAS (dense [M, N] in x's dtype, as the dense block has it);
    2. :func:`sparsefuse.sparse.dense_to_row_block_pattern`: per block of ``block_rows`` tokens and tile of columns,
       the union of the columns where the gate fires, ``pre > threshold`` (0 but for FATReLU; large batches: tokens
       sorted by non-zero count first);
    3. :func:`sparsefuse.sparse.block_sddmm`: ``h = gate(pre) * (x W_up^T + b_up)`` on the unions only (BlockELL,
       rounded to x's dtype as the dense block rounds h); dReLU relus the up product in the same epilogue (the
       unions stay the gate's);
    4. :func:`sparsefuse.sparse.block_sparse_matmul`: ``y = h W_down^T + b_down``.

    x2 [M, K]; w_gate, w_up [N, K]; w_down_t [N, K]. The up and down products cost the dense ones times the unions'
    share of N. Returns (y [M, K], pre [M, N]: its entries above the threshold are the fired gates)."""
    plan = plan or block_plan(w_gate.shape[0])
    pre = F.linear(x2, w_gate, b_gate)
    M, N = pre.shape
    pattern = dense_to_row_block_pattern(
        pre, plan.tile, plan.block_rows, relu=True, threshold=threshold, sort_rows=plan.sorts(M),
        sort_sample=plan.sort_sample(N),
    )  # fmt: skip
    h = block_sddmm(
        pattern, pre, x2, w_up, b_up, relu=True, threshold=threshold, up_relu=activation == "drelu",
        out_dtype=x2.dtype,
    )  # fmt: skip
    return block_sparse_matmul(h, w_down_t, bias=b_down, out_dtype=x2.dtype), pre
