"""Launchers of the TwELL kernels: allocate, size the grid, launch, record. Arguments arrive checked (by
:mod:`.functional`) and laid out: x2 [M, K] and w_up [N, K] with unit column stride, w_down_t = W_down^T [N, K]
with unit column stride. CPU tensors without the interpreter take the plain-torch branch of each launcher."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton

from ... import _backend
from ..._backend import Backend, backend_for, cdiv, new_output, next_power_of_2, record_launch, sm_count
from ..._plan import device_scalar, sampled_nonzero_stats
from ..._plan.config import current as current_config
from ..._triton.dot import ieee_fp32
from ...sparse.formats import ELL, TwELL
from ...sparse.spmm import sparse_matmul
from .block import launch_block_mlp
from .heavy_kernels import heavy_block_counts_kernel, heavy_first_order_kernel, heavy_tokens_kernel
from .kernels import (
    twell_gate_fwd_kernel,
    twell_overflow_down_kernel,
    twell_pack_kernel,
    twell_to_ell_kernel,
    twell_up_down_fwd_kernel,
)
from .reference import dense_gated, gate_activation, threshold_in

DEFAULT_COMPRESSION = 8  # slots = tile / 8: 32 slots per 256-column tile (the paper's setting)
STATS_TOKENS = 256  # tokens whose non-zeros the dense and block paths count for a SparsityMonitor


def _tune_key(M: int) -> int:
    return min(M, 1 << 20).bit_length()  # autotune once per power-of-two bucket of the token count


def _gate_configs() -> list[triton.Config]:
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bk, w, s in [
            (128, 64, 8, 3),
            (128, 64, 8, 4),
            (64, 64, 4, 4),
            (64, 64, 8, 3),
            (128, 32, 8, 4),
            (64, 128, 8, 3),
            (32, 128, 4, 4),
            (16, 128, 4, 4),
            (16, 256, 4, 3),
        ]
    ]
    return _backend.tuning_configs(configs, triton.Config({"BLOCK_M": 16, "BLOCK_K": 32, "GROUP_M": 4}))


def _prune_gate_configs(configs, named_args, **kwargs):
    # Row blocks much taller than the batch only waste the tensor cores; wide tiles need smaller row blocks.
    M = named_args["M"]
    tile = kwargs.get("TILE", named_args.get("TILE", 256))
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] <= max(16, next_power_of_2(M)) and c.kwargs["BLOCK_M"] * tile <= 128 * 256
    ]
    return kept or configs[-1:]


_twell_gate_kernel = triton.autotune(
    configs=_gate_configs(),
    key=["tune_key", "N", "K", "TILE", "SLOTS"],
    prune_configs_by={"early_config_prune": _prune_gate_configs},
)(twell_gate_fwd_kernel)


# tokens per packing program, and its warps (H200: the fastest of 8-64 tokens x 2-8 warps at 256-8192 tokens)
PACK_BLOCK_M = 8
PACK_WARPS = 4


def auto_tile(M: int, N: int, compression: int) -> int:
    """The default tile: 256 columns (the paper's); 64 when the batch is small, so the gate has enough programs."""
    tile = 256 if M > 64 else 64
    tile = min(tile, max(16, next_power_of_2(N)))
    return max(tile, next_power_of_2(compression))


def _knobs():
    """twell_mlp's knobs in force (:class:`.auto.CostModel`: the gate's and the heavy pass's thresholds too)."""
    return current_config().knobs("twell_mlp")


def _output_block(M: int, K: int, device: torch.device) -> int:
    """Output slice per program of the overflow kernel: the whole row (weight rows read once per token) unless the
    batch is too small to fill the GPU, then split so that there are >= 2 programs per SM."""
    if _backend.INTERPRET:
        return 128
    block = min(4096, next_power_of_2(K))
    while block > 128 and M * cdiv(K, block) < 2 * sm_count(device):
        block //= 2
    return block


@dataclasses.dataclass(frozen=True)
class _UpDownPlan:
    block_d: int  # the whole output row
    block_j: int  # stored entries per step: [block_j, block_d] weight tiles
    num_warps: int
    n_splits: int  # programs per token (each a share of its tiles)
    ordered: bool  # heavy tokens scheduled first
    block_c: int  # overflowed-tile recompute: columns per step ...
    block_k: int  # ... and hidden elements per step (small: the recompute must not raise the kernel's registers)


def _up_down_plan(M: int, K: int, n_tiles: int, device: torch.device) -> _UpDownPlan:
    """Kernel 2's launch, measured on an H200: 4 entries per step with ~64 weight elements per thread per tile; one
    program per token once the batch fills the GPU (the heavy ones first), otherwise each token's tiles split over
    enough programs to fill it, at most ``max_splits``."""
    block_d = next_power_of_2(max(K, 1))
    block_j = 4 if block_d <= 16384 else max(1, 65536 // block_d)
    num_warps = min(32, max(4, block_j * block_d // 2048))
    wave = 2 * sm_count(device)
    n_splits = 1 if M >= wave else min(n_tiles, cdiv(wave, max(M, 1)), _knobs().max_splits)
    block_c, block_k = (16, 64) if _backend.INTERPRET else (8, 1024)
    return _UpDownPlan(block_d, block_j, num_warps, n_splits, M >= wave, block_c, block_k)


def _listing_block(n_tiles: int) -> int:
    """Tokens per program of the kernels that read whole rows of counts: [block, n_tiles] counts per program, ~4096
    elements, keep them out of spilling (256 tokens of 56 tiles spill on sm_90)."""
    return 16 if _backend.INTERPRET else max(16, min(256, 4096 // next_power_of_2(n_tiles)))


def heavy_first_order(counts: torch.Tensor, slots: int, block_j: int) -> torch.Tensor:
    """[M] int32 permutation of the tokens, those with >= 16 steps of work (or an overflowed tile) first."""
    M, n_tiles = counts.shape
    order = torch.empty(M, dtype=torch.int32, device=counts.device)
    cursors = torch.zeros(2, dtype=torch.int32, device=counts.device)
    block_m = _listing_block(n_tiles)
    heavy_first_order_kernel[(cdiv(M, block_m),)](
        counts,
        order,
        cursors,
        M,
        n_tiles,
        16 * block_j,
        SLOTS=slots,
        BLOCK_M=block_m,
        BLOCK_TILES=next_power_of_2(n_tiles),
    )
    record_launch("heavy_first_order_kernel")
    return order


def _heavy_splits(M: int, n_tiles: int) -> int:
    """Programs per heavy token in the heavy launch: many where the batch is small (a heavy token would set the
    launch's length), fewer as the batch grows and the other tokens fill the GPU; more splits also mean fewer
    tokens fit the partials' budget."""
    k = _knobs()
    return max(1, min(n_tiles, k.heavy_splits, max(4, k.heavy_splits * k.heavy_splits_tokens // M)))


def heavy_tokens(
    counts: torch.Tensor, slots: int, block_j: int, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``cap`` tokens with an overflowed tile, then with >= 16 steps of work (each class in token order),
    on the device:
    (heavy_rows [cap] int32, heavy_count [2] int32: taken, of which with an overflowed tile, taken [M] int8). Two
    launches, no host sync."""
    M, n_tiles = counts.shape
    block_m = _listing_block(n_tiles)
    n_blocks = cdiv(M, block_m)
    block_heavy = torch.empty(2, n_blocks, dtype=torch.int32, device=counts.device)
    heavy_rows = torch.empty(cap, dtype=torch.int32, device=counts.device)
    heavy_count = torch.empty(2, dtype=torch.int32, device=counts.device)
    taken = torch.empty(M, dtype=torch.int8, device=counts.device)
    shape = dict(SLOTS=slots, BLOCK_M=block_m, BLOCK_TILES=next_power_of_2(n_tiles))
    heavy_block_counts_kernel[(n_blocks,)](counts, block_heavy, M, n_tiles, 16 * block_j, **shape)
    record_launch("heavy_block_counts_kernel")
    heavy_tokens_kernel[(n_blocks,)](
        counts, block_heavy, taken, heavy_rows, heavy_count, M, n_tiles, 16 * block_j, cap, **shape,
        BLOCK_B=min(1024, next_power_of_2(n_blocks)),
    )  # fmt: skip
    record_launch("heavy_tokens_kernel")
    return heavy_rows, heavy_count, taken


def _opt(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t.to(dtype) if t is not None else None


def _complete_dense(twell: TwELL, x2, w_act, b_act, compute: torch.dtype, threshold: float = 0.0) -> torch.Tensor:
    """Torch fallback: the dense activations, stored entries where the tile fits, recomputed where it overflowed."""
    recomputed = gate_activation(F.linear(x2.to(compute), w_act.to(compute), _opt(b_act, compute)), threshold)
    over = twell.overflowed().repeat_interleave(twell.tile, dim=1)[:, : twell.n_cols]
    clean = TwELL(
        twell.values,
        twell.indices,
        twell.counts.masked_fill(twell.overflowed(), 0),
        twell.n_cols,
        twell.tile,
        twell.compression,
    )
    return torch.where(over, recomputed, clean.to_dense().to(compute))


def launch_gate(
    x2: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    tile: int,
    compression: int,
    keep_pre: bool = False,
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Kernel 1: TwELL (values [M, n_tiles * slots], indices int32 likewise, counts [M, n_tiles] int32) of
    ``relu(x2 w^T + b)`` (with a ``threshold`` > 0, FATReLU: the entries > threshold, unshifted); w [N, K] any
    strides. Fourth: the pre-activations ``x2 w^T + b`` [M, N] for the second
    kernel's overflowed tiles: all of them where the gate ran as cuBLAS's GEMM and a packing pass (from
    ``gate_gemm_min_tokens`` tokens); below that, with ``keep_pre``, those of the overflowed tiles only (the fused
    kernel writes nothing else there); else None."""
    M, K = x2.shape
    N = w.shape[0]
    n_tiles, slots = cdiv(N, tile), tile // compression
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("twell_gate")
        compute = _backend.compute_dtype(x2.dtype)
        pre = F.linear(x2.to(compute), w.to(compute), b.to(compute) if b is not None else None)
        t = TwELL.from_dense(gate_activation(pre, threshold).to(x2.dtype), tile, compression)
        return t.values, t.indices, t.counts, None
    values = new_output((M, n_tiles * slots), x2.dtype, x2.device)  # poisoned under test: every slot is written
    indices = torch.empty(M, n_tiles * slots, dtype=torch.int32, device=x2.device)
    counts = torch.empty(M, n_tiles, dtype=torch.int32, device=x2.device)
    if M == 0:
        return values, indices, counts, None
    if M >= _knobs().gate_gemm_min_tokens:
        pre = F.linear(x2, w, b)  # [M, N]: cuBLAS's GEMM, then a packing pass over it
        block_m = 16 if _backend.INTERPRET else PACK_BLOCK_M
        twell_pack_kernel[(cdiv(M, block_m) * n_tiles,)](
            pre, values, indices, counts, M, N, n_tiles, pre.stride(0), threshold_in(torch.float32, threshold),
            TILE=tile, SLOTS=slots, BLOCK_M=block_m, num_warps=PACK_WARPS,
        )  # fmt: skip
        record_launch("twell_pack_kernel")
        return values, indices, counts, pre
    pre = new_output((M, N), x2.dtype, x2.device) if keep_pre else None  # poisoned under test: read where written
    grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * n_tiles,)  # noqa: E731
    _twell_gate_kernel[grid](
        x2,
        w,
        b if b is not None else x2,
        values,
        indices,
        counts,
        M,
        K,
        N,
        n_tiles,
        _tune_key(M),
        x2.stride(0),
        w.stride(0),
        w.stride(1),
        TILE=tile,
        SLOTS=slots,
        HAS_BIAS=b is not None,
        IEEE_FP32=ieee_fp32(x2.dtype),
        threshold=threshold_in(torch.float32, threshold),
        **({} if pre is None else dict(pre_ptr=pre, stride_pre=pre.stride(0), STORE_PRE=True)),
    )
    record_launch("twell_gate_fwd_kernel")
    return values, indices, counts, pre


def _pre_args(pre: torch.Tensor | None) -> dict:
    """The dense pre-activations' kernel arguments (none without them: the kernels' defaults, a GEMV instead)."""
    return {} if pre is None else dict(pre_ptr=pre, stride_pre=pre.stride(0), HAS_PRE=True)


def launch_up_down(
    values,
    indices,
    counts,
    x2,
    w_gate,
    b_gate,
    w_up,
    b_up,
    w_down_t,
    b_down,
    tile: int,
    compression: int,
    pre: torch.Tensor | None = None,
    activation: str = "relu",
    threshold: float = 0.0,
) -> torch.Tensor:
    """Kernel 2: y [M, K] = (h_g * (x2 w_up^T + b_up)) w_down_t + b_down for h_g given as TwELL; overflowed tiles
    read their pre-activations from ``pre`` [M, N] (x2 w_gate^T + b_gate, unit column stride) when given, else
    recompute them from w_gate/b_gate, firing above ``threshold`` as kernel 1 packed them. ``activation="drelu"``:
    relu on the up product, and no W_down row read where it is <= 0."""
    M, K = x2.shape
    N = w_up.shape[0]
    y = new_output((M, K), x2.dtype, x2.device)
    if M == 0 or K == 0:
        return y
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("twell_up_down")
        compute = _backend.compute_dtype(x2.dtype)
        twell = TwELL(values, indices, counts, N, tile, compression)
        h_gate = _complete_dense(twell, x2, w_gate, b_gate, compute, threshold)
        up = F.linear(x2.to(compute), w_up.to(compute), _opt(b_up, compute))
        h = h_gate * (torch.relu(up) if activation == "drelu" else up)
        return y.copy_(F.linear(h, w_down_t.t().to(compute), _opt(b_down, compute)))
    n_tiles, slots = cdiv(N, tile), tile // compression
    plan = _up_down_plan(M, K, n_tiles, x2.device)
    heavy_pass = M >= _knobs().heavy_pass_min_tokens
    order = heavy_first_order(counts, slots, plan.block_j) if plan.ordered else counts
    operands = (values, indices, counts, order, x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, y)
    options = dict(tile=tile, slots=slots, n_tiles=n_tiles, plan=plan, **_pre_args(pre))
    options.update(threshold=threshold_in(torch.float32, threshold), UP_RELU=activation == "drelu")
    if heavy_pass:
        splits = _heavy_splits(M, n_tiles)
        cap = min(M, max(1, _knobs().heavy_partial_bytes // (splits * K * 4)))
        heavy_rows, heavy_count, taken = heavy_tokens(counts, slots, plan.block_j, cap)
        heavy = dict(heavy_count_ptr=heavy_count, heavy_rows_ptr=heavy_rows, taken_ptr=taken)
        _launch_up_down_kernel(*operands, M, plan.n_splits, **options, ordered=plan.ordered, **heavy, SKIP_HEAVY=True)
        _launch_up_down_kernel(*operands, cap, splits, **options, ordered=False, **heavy, HEAVY_PASS=True)
    else:
        _launch_up_down_kernel(*operands, M, plan.n_splits, **options, ordered=plan.ordered)
    return y


def _launch_up_down_kernel(
    values,
    indices,
    counts,
    order,
    x2,
    w_gate,
    b_gate,
    w_up,
    b_up,
    w_down_t,
    b_down,
    y,
    programs: int,
    n_splits: int,
    *,
    tile: int,
    slots: int,
    n_tiles: int,
    plan: _UpDownPlan,
    ordered: bool,
    **kernel_args,
) -> None:
    """One launch of kernel 2 over ``programs`` tokens (of the order, when ``ordered``), ``n_splits`` programs
    each; with ``n_splits > 1`` its fp32 partials [programs, n_splits, K] are summed by the last to arrive."""
    M, K = x2.shape
    if n_splits > 1:
        partial = torch.empty(programs, n_splits, K, dtype=torch.float32, device=x2.device)  # read where written
        used = torch.empty(programs, n_splits, dtype=torch.int32, device=x2.device)
        arrivals = torch.zeros(programs, 1, dtype=torch.int32, device=x2.device)
    else:
        partial = used = arrivals = y
    twell_up_down_fwd_kernel[(programs, n_splits)](
        values,
        indices,
        counts,
        order,
        x2,
        w_gate,
        b_gate if b_gate is not None else x2,
        w_up,
        b_up if b_up is not None else x2,
        w_down_t,
        b_down if b_down is not None else x2,
        y,
        partial,
        used,
        arrivals,
        K,
        w_up.shape[0],
        n_tiles,
        cdiv(n_tiles, n_splits),
        n_splits,
        x2.stride(0),
        w_gate.stride(0),
        w_gate.stride(1),
        w_up.stride(0),
        w_down_t.stride(0),
        y.stride(0),
        TILE=tile,
        SLOTS=slots,
        BLOCK_TILES=next_power_of_2(cdiv(n_tiles, n_splits)),
        BLOCK_J=plan.block_j,
        BLOCK_D=plan.block_d,
        BLOCK_C=plan.block_c,
        BLOCK_K=plan.block_k,
        REDUCE_SPLITS=max(1, min(next_power_of_2(n_splits), 8192 // plan.block_d)),
        HAS_ORDER=ordered,
        HAS_B_GATE=b_gate is not None,
        HAS_B_UP=b_up is not None,
        HAS_B_DOWN=b_down is not None,
        num_warps=plan.num_warps,
        **kernel_args,
    )
    record_launch("twell_up_down_fwd_kernel")


def launch_to_ell(values, indices, counts, n_cols: int, tile: int, compression: int) -> ELL:
    """TwELL rows packed into ELL of the same width on the device; overflowed tiles left out."""
    M, width = values.shape
    n_tiles, slots = counts.shape[1], tile // compression
    if backend_for(values) is Backend.TORCH or M == 0:
        if M:
            _backend.warn_reference_once("twell_to_ell")
        clean = counts.masked_fill(counts > slots, 0)
        dense = TwELL(values, indices, clean, n_cols, tile, compression).to_dense()
        ell = ELL.from_dense(dense, width)
        return ELL(ell.values, ell.indices, clean.sum(1, dtype=torch.int32), n_cols)
    ell_values = torch.zeros(M, width, dtype=values.dtype, device=values.device)
    ell_indices = torch.zeros(M, width, dtype=torch.int32, device=values.device)
    ell_counts = torch.empty(M, dtype=torch.int32, device=values.device)
    twell_to_ell_kernel[(M,)](
        values,
        indices,
        counts,
        ell_values,
        ell_indices,
        ell_counts,
        n_tiles,
        SLOTS=slots,
        BLOCK_TILES=next_power_of_2(n_tiles),
    )
    record_launch("twell_to_ell_kernel")
    return ELL(ell_values, ell_indices, ell_counts, n_cols)


def launch_relu_mlp(x2, w_up, b_up, w_down_t, b_down, tile: int, compression: int) -> torch.Tensor:
    """Non-gated block through TwELL -> ELL -> sparse_matmul, overflowed tiles added in place; tile 0: default."""
    M, K = x2.shape
    N = w_up.shape[0]
    tile = tile or auto_tile(M, N, compression)
    values, indices, counts, pre = launch_gate(x2, w_up, b_up, tile, compression, keep_pre=True)
    if backend_for(x2) is Backend.TORCH:
        _backend.warn_reference_once("twell_relu_mlp")
        compute = _backend.compute_dtype(x2.dtype)
        h = _complete_dense(TwELL(values, indices, counts, N, tile, compression), x2, w_up, b_up, compute)
        return F.linear(h, w_down_t.t().to(compute), _opt(b_down, compute)).to(x2.dtype)
    ell = launch_to_ell(values, indices, counts, N, tile, compression)
    y = sparse_matmul(ell, w_down_t, out_dtype=x2.dtype)
    if M == 0 or K == 0:
        return y
    if b_down is not None:
        y += b_down
    n_tiles, slots = counts.shape[1], tile // compression
    block_d = _output_block(M, K, x2.device)
    twell_overflow_down_kernel[(M, cdiv(K, block_d))](
        counts,
        x2,
        w_up,
        b_up if b_up is not None else x2,
        w_down_t,
        y,
        K,
        N,
        n_tiles,
        x2.stride(0),
        w_up.stride(0),
        w_up.stride(1),
        w_down_t.stride(0),
        y.stride(0),
        TILE=tile,
        SLOTS=slots,
        BLOCK_TILES=next_power_of_2(n_tiles),
        BLOCK_C=16 if _backend.INTERPRET else 8,
        BLOCK_K=64 if _backend.INTERPRET else min(block_d, 1024),
        BLOCK_D=block_d,
        HAS_BA=b_up is not None,
        **_pre_args(pre),
    )
    record_launch("twell_overflow_down_kernel")
    return y


def _no_stats(x2: torch.Tensor, with_stats: bool) -> torch.Tensor:
    """Stats when none were asked for: an empty tensor (no kernel; a zero-filled [2] costs a launch, ~3 us at one
    token), or zeros for an empty batch that was asked for them."""
    return x2.new_zeros(2, dtype=torch.int64) if with_stats else x2.new_empty(0, dtype=torch.int64)


def launch_mlp(
    x2,
    w_gate,
    b_gate,
    w_up,
    b_up,
    w_down_t,
    b_down,
    tile: int,
    compression: int,
    method: str,
    with_stats: bool,
    activation: str = "relu",
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated block by a resolved ``method`` ("twell", "block" or "dense"; tile 0: the default) with the gate
    ``activation`` ("relu", "fatrelu" firing above ``threshold``, "drelu"). Returns (y [M, K], stats): stats is the
    [2] int64 (gate non-zeros, tokens counted) for a SparsityMonitor when ``with_stats``, else an empty tensor."""
    M = x2.shape[0]
    if method == "dense":
        y, h_gate, _ = dense_gated(x2, w_gate, b_gate, w_up, b_up, w_down_t.t(), b_down, activation, threshold)
        if not with_stats or M == 0:
            return y, _no_stats(x2, with_stats)
        return y, sampled_nonzero_stats(h_gate, STATS_TOKENS, positive=True)
    if method == "block":
        y, pre = launch_block_mlp(
            x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, activation=activation, threshold=threshold
        )
        if not with_stats or M == 0:
            return y, _no_stats(x2, with_stats)
        return y, sampled_nonzero_stats(pre, STATS_TOKENS, positive=True, threshold=threshold_in(pre.dtype, threshold))
    tile = tile or auto_tile(M, w_gate.shape[0], compression)
    values, indices, counts, pre = launch_gate(x2, w_gate, b_gate, tile, compression, True, threshold)
    y = launch_up_down(
        values, indices, counts, x2, w_gate, b_gate, w_up, b_up, w_down_t, b_down, tile, compression, pre,
        activation, threshold,
    )  # fmt: skip
    if not with_stats:
        return y, _no_stats(x2, with_stats)
    return y, torch.stack([counts.sum(dtype=torch.int64), device_scalar(M, x2.device)])
