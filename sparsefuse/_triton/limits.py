"""The shared sparse core's launch limits (:mod:`sparsefuse.sparse` and the :mod:`.slots` tile): the sizes from
which a launcher takes another kernel variant, grid shape or offset width. They are knobs of the planner's config,
registered as ``"sparse_core"``: a launcher reads them when it launches (:func:`limits`), and a test or a user
changes them with ``sparsefuse.planning(sparse_core={...})``, e.g. to cover a path at small sizes."""

from __future__ import annotations

import dataclasses

from .._plan.config import KnobGroup, current, register_knobs


@dataclasses.dataclass(frozen=True)
class SparseCoreLimits(KnobGroup):
    """``many_rows_per_sm``: rows per SM from which the compaction (dense -> ELL / Hybrid) walks its rows' bitmask
    words in small blocks of one warp: over many waves the walk is bound by its instructions (each round of set
    bits runs over every word of its block, nearly all zero at SAE sparsity): 4096 rows of 2048 words took 31 us
    against 52 with 1024-word blocks of 4 warps (H200); about a wave is bound by each row's latency, and takes few,
    wide blocks.

    ``max_grid_y``: programs along the second dimension of row_bits_kernel's grid, at most (CUDA's limit, 65535);
    past it each program loops over several row chunks.

    ``transposed_scheduled_groups``: column groups up to which ``transposed_matmul`` launches them heaviest first
    (hot neurons' groups hold 4-5x the mean entries; 1.43x on a 1.5B model layer's entries, H200). The order costs
    one launch comparing every group with every other: past this many (N > 131072) the grid is long enough for its
    tail not to matter, and the natural order is taken.

    ``offsets_32_limit``: element offsets below this fit int32, and a row-block kernel whose every offset does takes
    32-bit arithmetic for them (the ``OFFSETS_32`` constexpr): a [64, 128] tile's offsets then hold 32 registers a
    thread instead of 64, which keeps a tensor-core epilogue from spilling. At most 2**31.

    ``one_wave_programs_per_sm``: one-warp gather programs resident per SM, about: the ELL / CSR gather at 128-256
    columns takes 64-70 registers a thread (sm_90, Triton 3.6), so 28 fit an SM's registers (sm_90 allows 32
    blocks). A gather launch of at most this many programs per SM is taken for one wave, which lasts as long as its
    longest row: its rows past :data:`~sparsefuse.sparse.long_rows.ONE_WAVE_LONG_ENTRIES` stored entries are spread
    by a second launch (and ``sparse_decode``'s cost model prices them so). At 512 fp32 columns the gather takes 114
    registers (17 fit), but those blocks are used only where rows x blocks pass 8 programs per SM, and launches of
    17-28 programs per SM (fp32, D=768: ~1100-1800 rows) are taken for one wave though they run in two: left
    approximate."""

    many_rows_per_sm: int = 8
    max_grid_y: int = 65535
    transposed_scheduled_groups: int = 8192
    offsets_32_limit: int = 2**31
    one_wave_programs_per_sm: int = 28


register_knobs("sparse_core", SparseCoreLimits())


def limits() -> SparseCoreLimits:
    """The sparse core's launch limits in force."""
    return current().knobs("sparse_core")
