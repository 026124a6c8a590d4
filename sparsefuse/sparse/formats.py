"""Sparse row formats shared by the SAE, FFN and (later) training kernels.

Both formats store each row's non-zeros in increasing column order (compaction is deterministic).

* :class:`CSR` -- exact size: ``values``/``indices`` [nnz] and ``row_offsets`` [M + 1] (int64). Building it needs the
  total nnz on the host (one device->host sync).
* :class:`ELL` -- fixed width ``width`` per row: ``values``/``indices`` [M, width] and the per-row **true** count
  ``counts`` [M] (int32), which may exceed ``width``. Building it needs no sync; a row whose count exceeds the
  width has *overflowed*: only its first ``width`` non-zeros are stored, and consumers must complete it another way
  (never silently drop it). Unused slots hold index 0 and value 0.
* :class:`TwELL` -- tile-wise ELL: per (row, column tile of width T) ``T / C`` slots and the tile's true count;
  written by a matmul epilogue (the FFN gate), overflowed tiles are recomputed by the consumer.
* :class:`Hybrid` -- the training format: a fixed-width ELL plus a dense backup of the rows that overflow it, and a
  per-row slot (in the ELL, a backup row, or spilled past the backup: the consumer recomputes it). Exact in a fixed
  memory budget, built without a sync (:func:`sparsefuse.sparse.dense_to_hybrid`).
* :class:`RowBlockPattern` -- per (block of rows, column tile) the union of the rows' non-zero columns, shared by
  the block (rows optionally permuted first); never overflows. :class:`BlockELL` -- values on such unions, one
  compacted column list per row block. For tensor-core products at large batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._backend import cdiv
from .._validation import check_block_rows, check_indices, check_row_order, check_rows, check_twell_geometry

__all__ = ["CSR", "ELL", "TwELL", "Hybrid", "RowBlockPattern", "BlockELL", "check_twell_geometry", "IN_ELL", "SPILLED"]


@dataclass(frozen=True)
class ELL:
    values: torch.Tensor  # [M, width]
    indices: torch.Tensor  # [M, width] int32
    counts: torch.Tensor  # [M] int32, true non-zeros per row (may exceed width)
    n_cols: int

    def __post_init__(self) -> None:
        check_rows("ELL.values", self.values, 2)
        check_indices("ELL", self.values, self.indices)
        if self.counts.shape != (self.values.shape[0],) or self.counts.dtype != torch.int32:
            raise ValueError(
                f"ELL.counts must be int32 of shape [{self.values.shape[0]}]; got "
                f"{self.counts.dtype} {list(self.counts.shape)}"
            )

    @property
    def width(self) -> int:
        return self.values.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.n_cols)

    def overflowed(self) -> torch.Tensor:
        """[M] bool: rows with more non-zeros than the width (not fully stored)."""
        return self.counts > self.width

    def to_dense(self) -> torch.Tensor:
        """The stored entries as a dense [M, n_cols] tensor. Raises if a row overflowed (it would be incomplete)."""
        if bool(self.overflowed().any()):
            raise ValueError(
                f"ELL.to_dense: {int(self.overflowed().sum())} row(s) overflowed width {self.width} "
                f"(largest count {int(self.counts.max())}); their dense form is not stored"
            )
        M = self.values.shape[0]
        dense = torch.zeros(M, self.n_cols, dtype=self.values.dtype, device=self.values.device)
        slot = torch.arange(self.width, device=self.values.device)
        used = slot[None, :] < self.counts[:, None]
        rows = torch.arange(M, device=self.values.device)[:, None].expand_as(used)
        dense[rows[used], self.indices[used].long()] = self.values[used]
        return dense

    @staticmethod
    def from_dense(dense: torch.Tensor, width: int) -> ELL:
        """Plain-torch reference: the first ``width`` non-zeros of each row, in column order, and the true counts."""
        check_rows("dense", dense, 2)
        M, N = dense.shape
        nonzero = dense != 0
        counts = nonzero.sum(dim=1).to(torch.int32)
        rank = nonzero.cumsum(dim=1) - 1  # slot of each non-zero within its row
        keep = nonzero & (rank < width)
        values = torch.zeros(M, width, dtype=dense.dtype, device=dense.device)
        indices = torch.zeros(M, width, dtype=torch.int32, device=dense.device)
        rows, cols = keep.nonzero(as_tuple=True)
        values[rows, rank[rows, cols]] = dense[rows, cols]
        indices[rows, rank[rows, cols]] = cols.to(torch.int32)
        return ELL(values, indices, counts, N)


@dataclass(frozen=True)
class CSR:
    values: torch.Tensor  # [nnz]
    indices: torch.Tensor  # [nnz] int32
    row_offsets: torch.Tensor  # [M + 1] int64
    n_cols: int

    def __post_init__(self) -> None:
        check_rows("CSR.values", self.values, 1)
        check_indices("CSR", self.values, self.indices)
        if self.row_offsets.dim() != 1 or self.row_offsets.dtype != torch.int64:
            raise ValueError(
                f"CSR.row_offsets must be int64 [M + 1]; got {self.row_offsets.dtype} {list(self.row_offsets.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.row_offsets.shape[0] - 1, self.n_cols)

    def to_dense(self) -> torch.Tensor:
        M = self.row_offsets.shape[0] - 1
        counts = self.row_offsets.diff()
        rows = torch.repeat_interleave(torch.arange(M, device=self.values.device), counts)
        dense = torch.zeros(M, self.n_cols, dtype=self.values.dtype, device=self.values.device)
        dense[rows, self.indices.long()] = self.values
        return dense

    @staticmethod
    def from_dense(dense: torch.Tensor) -> CSR:
        """Plain-torch reference (column order within rows)."""
        check_rows("dense", dense, 2)
        rows, cols = (dense != 0).nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=dense.shape[0])
        offsets = torch.zeros(dense.shape[0] + 1, dtype=torch.int64, device=dense.device)
        offsets[1:] = counts.cumsum(0)
        return CSR(dense[rows, cols], cols.to(torch.int32), offsets, dense.shape[1])


@dataclass(frozen=True)
class TwELL:
    """Tile-wise ELL: the columns of an [M, N] matrix are cut into ``n_tiles = ceil(N / tile)`` tiles of ``tile``
    columns and every (row, tile) keeps its non-zeros, in column order, in its own ``slots = tile // compression``
    slots (ELL packing inside each tile). A tiled matmul can write it from its epilogue: one program owns a whole
    (rows, tile) block, so no cross-program synchronisation is needed.

    * ``values``/``indices`` [M, n_tiles * slots]: tile t of row m occupies ``[t * slots, (t + 1) * slots)``;
      indices are global column numbers (int32). For N a multiple of the tile this is the paper's [M, N / C].
    * ``counts`` [M, n_tiles] int32: the **true** number of non-zeros of each (row, tile). A tile with more than
      ``slots`` non-zeros has *overflowed*: only its first ``slots`` are stored, and consumers must complete it
      another way (sparsefuse recomputes such tiles; it never drops them). Unused slots hold index 0, value 0.
    """

    values: torch.Tensor  # [M, n_tiles * slots]
    indices: torch.Tensor  # [M, n_tiles * slots] int32
    counts: torch.Tensor  # [M, n_tiles] int32, true non-zeros per (row, tile) (may exceed slots)
    n_cols: int
    tile: int
    compression: int

    def __post_init__(self) -> None:
        check_twell_geometry("TwELL", self.tile, self.compression)
        check_rows("TwELL.values", self.values, 2)
        check_indices("TwELL", self.values, self.indices)
        n_tiles = cdiv(self.n_cols, self.tile)
        if self.values.shape[1] != n_tiles * self.slots:
            raise ValueError(
                f"TwELL.values must have {n_tiles} tiles x {self.slots} slots = "
                f"{n_tiles * self.slots} columns for n_cols={self.n_cols}, tile={self.tile}, "
                f"compression={self.compression}; got {list(self.values.shape)}"
            )
        if self.counts.shape != (self.values.shape[0], n_tiles) or self.counts.dtype != torch.int32:
            raise ValueError(
                f"TwELL.counts must be int32 of shape [{self.values.shape[0]}, {n_tiles}]; got "
                f"{self.counts.dtype} {list(self.counts.shape)}"
            )

    @property
    def slots(self) -> int:
        """Stored entries per (row, tile): ``tile // compression``."""
        return self.tile // self.compression

    @property
    def n_tiles(self) -> int:
        return cdiv(self.n_cols, self.tile)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.n_cols)

    def overflowed(self) -> torch.Tensor:
        """[M, n_tiles] bool: (row, tile) pairs with more non-zeros than slots (not fully stored)."""
        return self.counts > self.slots

    def row_nnz(self) -> torch.Tensor:
        """[M] int32: true non-zeros per row (overflowed tiles included)."""
        return self.counts.sum(dim=1, dtype=torch.int32)

    def _stored_mask(self) -> torch.Tensor:
        M, slots = self.values.shape[0], self.slots
        slot = torch.arange(slots, device=self.values.device)
        stored = self.counts.clamp(max=slots)
        return (slot[None, None, :] < stored[:, :, None]).reshape(M, self.n_tiles * slots)

    def to_dense(self) -> torch.Tensor:
        """The stored entries as a dense [M, n_cols] tensor. Raises if a tile overflowed (it would be incomplete)."""
        over = self.overflowed()
        if bool(over.any()):
            raise ValueError(
                f"TwELL.to_dense: {int(over.sum())} (row, tile) pair(s) overflowed {self.slots} slots "
                f"(largest tile count {int(self.counts.max())}); their dense form is not stored"
            )
        M = self.values.shape[0]
        dense = torch.zeros(M, self.n_cols, dtype=self.values.dtype, device=self.values.device)
        used = self._stored_mask()
        rows = torch.arange(M, device=self.values.device)[:, None].expand_as(used)
        dense[rows[used], self.indices[used].long()] = self.values[used]
        return dense

    @staticmethod
    def from_dense(dense: torch.Tensor, tile: int, compression: int) -> TwELL:
        """Plain-torch reference: per (row, tile) the first ``tile // compression`` non-zeros in column order and
        the true counts. NaN counts as a non-zero."""
        check_twell_geometry("TwELL.from_dense", tile, compression)
        check_rows("dense", dense, 2)
        M, N = dense.shape
        n_tiles, slots = cdiv(N, tile), tile // compression
        padded = torch.zeros(M, n_tiles * tile, dtype=dense.dtype, device=dense.device)
        padded[:, :N] = dense
        nonzero = (padded != 0).reshape(M, n_tiles, tile)
        counts = nonzero.sum(dim=2).to(torch.int32)
        rank = nonzero.cumsum(dim=2) - 1  # slot of each non-zero within its tile
        keep = nonzero & (rank < slots)
        values = torch.zeros(M, n_tiles * slots, dtype=dense.dtype, device=dense.device)
        indices = torch.zeros(M, n_tiles * slots, dtype=torch.int32, device=dense.device)
        rows, tiles, cols = keep.nonzero(as_tuple=True)
        dest = tiles * slots + rank[rows, tiles, cols]
        global_cols = tiles * tile + cols
        values[rows, dest] = padded[rows, global_cols]
        indices[rows, dest] = global_cols.to(torch.int32)
        return TwELL(values, indices, counts, N, tile, compression)


IN_ELL, SPILLED = -1, -2  # Hybrid.slot of a row held whole by the ELL part / overflowed past the backup


@dataclass(frozen=True)
class Hybrid:
    """A sparse training step's activations, exact in a fixed memory budget. A ReLU layer trained with an L1 penalty
    fires a few dozen of thousands of neurons per token with a heavy tail: most rows fit a narrow ELL, a few do not.

    * ``ell``: :class:`ELL` of fixed width (the TwELL paper's default: 128) holding every row's first ``width``
      non-zeros in column order and its **true** count;
    * ``backup`` [R, N]: the rows whose count exceeds the width, whole, in row order (default R = ceil(M / 8));
      ``backup_rows`` [R] int32: the matrix row in each backup row (-1 when unused);
    * ``slot`` [M] int32: ``IN_ELL`` when the ELL holds the whole row, ``s >= 0`` when backup row ``s`` does, and
      ``SPILLED`` when the row overflowed after the backup was full. A consumer recomputes a spilled row from its
      inputs (the gate's x row and weight): nothing is dropped, and the format never grows behind the caller's back.
    """

    ell: ELL
    backup: torch.Tensor
    backup_rows: torch.Tensor
    slot: torch.Tensor

    def __post_init__(self) -> None:
        check_rows("Hybrid.backup", self.backup, 2)
        M, N = self.ell.shape
        R = self.backup.shape[0]
        if self.backup.shape[1] != N or self.backup.dtype != self.ell.values.dtype:
            raise ValueError(
                f"Hybrid.backup must be [R, {N}] of the ELL's dtype {self.ell.values.dtype}; got "
                f"{self.backup.dtype} {list(self.backup.shape)}"
            )
        for name, t, n in (("backup_rows", self.backup_rows, R), ("slot", self.slot, M)):
            if t.shape != (n,) or t.dtype != torch.int32:
                raise ValueError(f"Hybrid.{name} must be int32 of shape [{n}]; got {t.dtype} {list(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.ell.shape

    @property
    def n_cols(self) -> int:
        return self.ell.n_cols

    def spilled_rows(self) -> torch.Tensor:
        """[M] bool: rows that overflowed the ELL width after the backup was full (to be recomputed)."""
        return self.slot == SPILLED

    def spilled(self) -> torch.Tensor:
        """0-dim int32 on the device: how many rows spilled (reading it on the host is the caller's sync)."""
        return self.spilled_rows().sum(dtype=torch.int32)

    def nonzeros(self) -> torch.Tensor:
        """0-dim int64 on the device: the matrix's non-zeros (the ELL's true counts: spilled rows included)."""
        return self.ell.counts.sum(dtype=torch.int64)

    def to_dense(self, spilled: torch.Tensor | None = None) -> torch.Tensor:
        """The dense [M, N] matrix. Rows that spilled are taken from ``spilled`` ([M, N] or None); without it a
        spilled row raises (its values are not stored). Reads the slots on the host: a reference, not a hot path."""
        M, N = self.shape
        overflowed = self.ell.overflowed()
        fitting = ELL(self.ell.values, self.ell.indices, self.ell.counts.masked_fill(overflowed, 0), N)
        dense = fitting.to_dense()
        used = self.backup_rows >= 0
        dense[self.backup_rows[used].long()] = self.backup[used]
        lost = self.spilled_rows()
        if bool(lost.any()):
            if spilled is None:
                raise ValueError(
                    f"Hybrid.to_dense: {int(lost.sum())} row(s) spilled past the backup's {self.backup.shape[0]} "
                    "rows; pass their dense values (spilled=) or recompute them"
                )
            dense[lost] = spilled[lost].to(dense.dtype)
        return dense


def _block_rows_of(M: int, block_rows: int, b: int, row_order: torch.Tensor | None):
    """Row indices (into the original matrix) of block b."""
    rows = torch.arange(b * block_rows, min(M, (b + 1) * block_rows))
    return row_order[rows.to(row_order.device)].long() if row_order is not None else rows


@dataclass(frozen=True)
class RowBlockPattern:
    """The sparsity pattern of an [M, N] matrix as row-block unions: rows are taken in ``row_order`` (a permutation;
    None = natural order) and grouped in blocks of ``block_rows``; columns are cut into tiles of ``tile``. For each
    (row block, tile) it lists the columns in which **any** row of the block is non-zero (their union), shared by
    the block's rows. A union holds at most ``tile`` columns, so the pattern never overflows. Tensor-core consumers
    multiply [block_rows, union] blocks: the work is the union's, which for a sparse ReLU layer is a fraction of the
    dense work (hot neurons are shared across tokens, more so when tokens of similar sparsity share a block).

    * ``indices`` [n_blocks, n_tiles * tile] int32: block b's union in tile t at ``[t * tile, t * tile + count)``,
      global column numbers in increasing order (slots past the count are never read).
    * ``counts`` [n_blocks, n_tiles] int32: union sizes.
    * ``row_order`` [M] int32 or None: block b holds rows ``row_order[b * block_rows : (b + 1) * block_rows]``.
    """

    indices: torch.Tensor  # [n_blocks, n_tiles * tile] int32
    counts: torch.Tensor  # [n_blocks, n_tiles] int32
    row_order: torch.Tensor | None  # [M] int32
    n_rows: int
    n_cols: int
    tile: int
    block_rows: int

    def __post_init__(self) -> None:
        check_twell_geometry("RowBlockPattern", self.tile, 1)
        check_block_rows("RowBlockPattern", self.block_rows)
        n_blocks, width = cdiv(self.n_rows, self.block_rows), self.n_tiles * self.tile
        if self.indices.shape != (n_blocks, width) or self.indices.dtype != torch.int32:
            raise ValueError(
                f"RowBlockPattern.indices must be int32 of shape [{n_blocks}, {width}]; got "
                f"{self.indices.dtype} {list(self.indices.shape)}"
            )
        if self.counts.shape != (n_blocks, self.n_tiles) or self.counts.dtype != torch.int32:
            raise ValueError(
                f"RowBlockPattern.counts must be int32 of shape [{n_blocks}, {self.n_tiles}]; got "
                f"{self.counts.dtype} {list(self.counts.shape)}"
            )
        check_row_order("RowBlockPattern", self.row_order, self.n_rows)

    @property
    def n_tiles(self) -> int:
        return cdiv(self.n_cols, self.tile)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_rows, self.n_cols)

    def union_sizes(self) -> torch.Tensor:
        """[n_blocks] int32: columns in each row block's union (the sparse work per block)."""
        return self.counts.sum(dim=1, dtype=torch.int32)

    def block_columns(self, b: int) -> torch.Tensor:
        """Block b's union, all tiles, in column order (int64)."""
        slot = torch.arange(self.tile, device=self.indices.device)
        return self.indices[b][(slot[None, :] < self.counts[b][:, None]).flatten()].long()

    def to_mask(self) -> torch.Tensor:
        """[M, N] bool: True in every (row, union column) of the row's block."""
        mask = torch.zeros(self.n_rows, self.n_cols, dtype=torch.bool, device=self.indices.device)
        for b in range(self.counts.shape[0]):
            rows = _block_rows_of(self.n_rows, self.block_rows, b, self.row_order).to(mask.device)
            mask[rows[:, None], self.block_columns(b)[None, :]] = True
        return mask

    @staticmethod
    def from_dense(
        dense: torch.Tensor, tile: int, block_rows: int, row_order: torch.Tensor | None = None
    ) -> RowBlockPattern:
        """Plain-torch reference: the unions of ``dense != 0`` (NaN counts as non-zero)."""
        check_twell_geometry("RowBlockPattern.from_dense", tile, 1)
        check_block_rows("RowBlockPattern.from_dense", block_rows)
        check_rows("dense", dense, 2)
        M, N = dense.shape
        check_row_order("RowBlockPattern", row_order, M)
        n_tiles, n_blocks = cdiv(N, tile), cdiv(M, block_rows)
        indices = torch.zeros(n_blocks, n_tiles * tile, dtype=torch.int32, device=dense.device)
        counts = torch.zeros(n_blocks, n_tiles, dtype=torch.int32, device=dense.device)
        for b in range(n_blocks):
            fired = (dense[_block_rows_of(M, block_rows, b, row_order).to(dense.device)] != 0).any(dim=0)
            for t in range(n_tiles):
                cols = fired[t * tile : (t + 1) * tile].nonzero().flatten() + t * tile
                indices[b, t * tile : t * tile + cols.numel()] = cols.to(torch.int32)
                counts[b, t] = cols.numel()
        return RowBlockPattern(indices, counts, row_order, M, N, tile, block_rows)


@dataclass(frozen=True)
class BlockELL:
    """ELL with indices shared by a block of rows: slot row r (in block b = r // block_rows) has ``values[r, j]`` in
    column ``indices[b, j]`` for ``j < counts[b]``, and stands for matrix row ``row_order[r]`` (r when None). Slots
    past a block's count are never read. What :func:`sparsefuse.sparse.block_sddmm` writes and the tensor-core
    gather product :func:`sparsefuse.sparse.block_sparse_matmul` walks in one loop."""

    values: torch.Tensor  # [M, width]
    indices: torch.Tensor  # [n_blocks, width] int32
    counts: torch.Tensor  # [n_blocks] int32 (<= width)
    n_cols: int
    block_rows: int
    row_order: torch.Tensor | None = None  # [M] int32

    def __post_init__(self) -> None:
        check_block_rows("BlockELL", self.block_rows)
        check_rows("BlockELL.values", self.values, 2)
        M, width = self.values.shape
        n_blocks = cdiv(M, self.block_rows)
        if self.indices.shape != (n_blocks, width) or self.indices.dtype != torch.int32:
            raise ValueError(
                f"BlockELL.indices must be int32 of shape [{n_blocks}, {width}]; got "
                f"{self.indices.dtype} {list(self.indices.shape)}"
            )
        if self.counts.shape != (n_blocks,) or self.counts.dtype != torch.int32:
            raise ValueError(
                f"BlockELL.counts must be int32 of shape [{n_blocks}]; got {self.counts.dtype} "
                f"{list(self.counts.shape)}"
            )
        check_row_order("BlockELL", self.row_order, M)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.n_cols)

    def to_dense(self) -> torch.Tensor:
        M = self.values.shape[0]
        dense = torch.zeros(M, self.n_cols, dtype=self.values.dtype, device=self.values.device)
        for b, count in enumerate(self.counts.tolist()):
            slots = slice(b * self.block_rows, min(M, (b + 1) * self.block_rows))
            rows = _block_rows_of(M, self.block_rows, b, self.row_order).to(dense.device)
            dense[rows[:, None], self.indices[b, :count].long()[None, :]] = self.values[slots, :count]
        return dense

    @staticmethod
    def from_dense(dense: torch.Tensor, block_rows: int) -> BlockELL:
        """Plain-torch reference: each row block's union of non-zero columns, in column order."""
        check_block_rows("BlockELL.from_dense", block_rows)
        check_rows("dense", dense, 2)
        M, N = dense.shape
        n_blocks = cdiv(M, block_rows)
        unions = [
            (dense[b * block_rows : (b + 1) * block_rows] != 0).any(dim=0).nonzero().flatten() for b in range(n_blocks)
        ]
        width = max([u.numel() for u in unions] + [1])
        values = torch.zeros(M, width, dtype=dense.dtype, device=dense.device)
        indices = torch.zeros(n_blocks, width, dtype=torch.int32, device=dense.device)
        for b, cols in enumerate(unions):
            rows = slice(b * block_rows, min(M, (b + 1) * block_rows))
            indices[b, : cols.numel()] = cols.to(torch.int32)
            values[rows, : cols.numel()] = dense[rows][:, cols]
        counts = torch.tensor([u.numel() for u in unions], dtype=torch.int32, device=dense.device)
        return BlockELL(values, indices, counts, N, block_rows)


@dataclass(frozen=True)
class BlockCSC:
    """The non-zero slots of a :class:`BlockELL` grouped by column (its transpose, as indices into its slots):
    column n's entries are ``src[offsets[n]:offsets[n + 1]]``, each the flat index ``slot_row * width + slot`` into
    the BlockELL's [M, width] value arrays (so any array on the same slots can be read through it), in (block,
    row) order. A slot row r stands for matrix row ``row_order[r]`` (r when None). What
    :func:`sparsefuse.sparse.block_grad.transposed_matmul` walks for the weight gradients ``A^T X``.

    * ``src`` [capacity] int32 (int64 when M * width >= 2**31): only the first ``offsets[-1]`` are meaningful.
    * ``offsets`` [N + 1] int64.
    * ``rows`` [capacity] int32 or None: each entry's matrix row (``row_order`` applied), so that the weight
      gradients gather their rows of x without a division and a dependent lookup per entry; None where not built."""

    src: torch.Tensor
    offsets: torch.Tensor
    width: int
    row_order: torch.Tensor | None
    n_rows: int
    n_cols: int
    rows: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_rows, self.n_cols)

    def to_dense(self, values: torch.Tensor) -> torch.Tensor:
        """[M, N]: ``values`` [M, width] (an array on the BlockELL's slots) at this pattern's entries, 0 elsewhere."""
        nnz = int(self.offsets[-1])
        flat = self.src[:nnz].long()
        cols = torch.repeat_interleave(
            torch.arange(self.n_cols, device=flat.device), (self.offsets[1:] - self.offsets[:-1])
        )
        rows = flat // self.width
        if self.row_order is not None:
            rows = self.row_order[rows].long()
        dense = torch.zeros(self.n_rows, self.n_cols, dtype=values.dtype, device=values.device)
        dense[rows, cols] = values.flatten()[flat]
        return dense
