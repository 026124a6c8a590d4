"""Program scheduling helpers shared by the GEMM-shaped Triton kernels (SPLADE forward, TwELL gate)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile_coords(tile_id, num_pid_m, num_pid_n, group_m):
    """(M tile, N tile) of a linear tile id, grouped: group_m consecutive M tiles sweep the N tiles side by side,
    so consecutive programs share an operand tile and each N-side tile is read from DRAM about once per group
    (the last group may hold fewer M tiles)."""
    per_group = group_m * num_pid_n
    first_m = (tile_id // per_group) * group_m
    rows = tl.minimum(num_pid_m - first_m, group_m)
    local = tile_id % per_group
    return first_m + local % rows, local // rows
