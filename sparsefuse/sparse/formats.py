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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_rows(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s); got shape {list(t.shape)}")


def _check_indices(fmt: str, values: torch.Tensor, indices: torch.Tensor) -> None:
    if indices.shape != values.shape or indices.dtype != torch.int32:
        raise ValueError(f"{fmt}.indices must be int32 of shape {list(values.shape)}; got "
                         f"{indices.dtype} {list(indices.shape)}")  # fmt: skip


@dataclass(frozen=True)
class ELL:
    values: torch.Tensor  # [M, width]
    indices: torch.Tensor  # [M, width] int32
    counts: torch.Tensor  # [M] int32, true non-zeros per row (may exceed width)
    n_cols: int

    def __post_init__(self) -> None:
        _check_rows("ELL.values", self.values, 2)
        _check_indices("ELL", self.values, self.indices)
        if self.counts.shape != (self.values.shape[0],) or self.counts.dtype != torch.int32:
            raise ValueError(f"ELL.counts must be int32 of shape [{self.values.shape[0]}]; got "
                             f"{self.counts.dtype} {list(self.counts.shape)}")  # fmt: skip

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
            raise ValueError(f"ELL.to_dense: {int(self.overflowed().sum())} row(s) overflowed width {self.width} "
                             f"(largest count {int(self.counts.max())}); their dense form is not stored")  # fmt: skip
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
        _check_rows("dense", dense, 2)
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
        _check_rows("CSR.values", self.values, 1)
        _check_indices("CSR", self.values, self.indices)
        if self.row_offsets.dim() != 1 or self.row_offsets.dtype != torch.int64:
            raise ValueError(f"CSR.row_offsets must be int64 [M + 1]; got {self.row_offsets.dtype} "
                             f"{list(self.row_offsets.shape)}")  # fmt: skip

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
        _check_rows("dense", dense, 2)
        rows, cols = (dense != 0).nonzero(as_tuple=True)
        counts = torch.bincount(rows, minlength=dense.shape[0])
        offsets = torch.zeros(dense.shape[0] + 1, dtype=torch.int64, device=dense.device)
        offsets[1:] = counts.cumsum(0)
        return CSR(dense[rows, cols], cols.to(torch.int32), offsets, dense.shape[1])


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_twell_geometry(op: str, tile: object, compression: object) -> None:
    """ValueError unless ``tile`` is a power of two in [16, 1024] and ``compression`` a positive int dividing it."""
    for name, value in (("tile", tile), ("compression", compression)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{op}: {name} must be a positive int; got {value!r}")
    if not (_is_power_of_two(tile) and 16 <= tile <= 1024):
        raise ValueError(f"{op}: tile must be a power of two between 16 and 1024; got tile={tile}")
    if tile % compression:
        raise ValueError(f"{op}: compression={compression} does not divide tile={tile} (a tile keeps "
                         f"tile / compression slots, which must be a whole number)")  # fmt: skip


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
        _check_rows("TwELL.values", self.values, 2)
        _check_indices("TwELL", self.values, self.indices)
        n_tiles = -(-self.n_cols // self.tile)
        if self.values.shape[1] != n_tiles * self.slots:
            raise ValueError(f"TwELL.values must have {n_tiles} tiles x {self.slots} slots = "
                             f"{n_tiles * self.slots} columns for n_cols={self.n_cols}, tile={self.tile}, "
                             f"compression={self.compression}; got {list(self.values.shape)}")  # fmt: skip
        if self.counts.shape != (self.values.shape[0], n_tiles) or self.counts.dtype != torch.int32:
            raise ValueError(f"TwELL.counts must be int32 of shape [{self.values.shape[0]}, {n_tiles}]; got "
                             f"{self.counts.dtype} {list(self.counts.shape)}")  # fmt: skip

    @property
    def slots(self) -> int:
        """Stored entries per (row, tile): ``tile // compression``."""
        return self.tile // self.compression

    @property
    def n_tiles(self) -> int:
        return -(-self.n_cols // self.tile)

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
            raise ValueError(f"TwELL.to_dense: {int(over.sum())} (row, tile) pair(s) overflowed {self.slots} slots "
                             f"(largest tile count {int(self.counts.max())}); their dense form is not stored")  # fmt: skip
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
        _check_rows("dense", dense, 2)
        M, N = dense.shape
        n_tiles, slots = -(-N // tile), tile // compression
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
