"""Sparse row formats shared by the SAE, FFN and (later) training kernels.

Both formats store each row's non-zeros in increasing column order (compaction is deterministic).

* :class:`CSR` -- exact size: ``values``/``indices`` [nnz] and ``row_offsets`` [M + 1] (int64). Building it needs the
  total nnz on the host (one device->host sync).
* :class:`ELL` -- fixed width ``width`` per row: ``values``/``indices`` [M, width] and the per-row **true** count
  ``counts`` [M] (int32), which may exceed ``width``. Building it needs no sync; a row whose count exceeds the
  width has *overflowed*: only its first ``width`` non-zeros are stored, and consumers must complete it another way
  (never silently drop it). Unused slots hold index 0 and value 0.
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
