"""The Hybrid format: a sparse training step's activations, stored exactly in a fixed memory budget.

A ReLU layer trained with an L1 penalty fires a few dozen of thousands of neurons per token, with a heavy tail: most
rows fit a narrow ELL, a few do not. :class:`Hybrid` keeps

* an :class:`~sparsefuse.sparse.ELL` part of fixed ``width`` (the TwELL paper's default: 128) holding every row's
  first ``width`` non-zeros in column order and its **true** count;
* a dense **backup** of ``R`` rows (default ``ceil(M / 8)``) holding, in row order, the rows whose count exceeds the
  width, whole;
* a per-row **slot**: ``IN_ELL`` (-1) when the ELL part holds the whole row, ``s >= 0`` when backup row ``s`` does,
  and ``SPILLED`` (-2) when the row overflowed and the backup was already full. A consumer recomputes a spilled row
  from its inputs (the gate's ``x`` row and weight): nothing is dropped, and the format never grows behind the
  caller's back.

Building it needs no host sync (:func:`dense_to_hybrid`): counts, ranks and the backup's row list come from a prefix
sum and a sorted search on the device, so the same input always gives the same format (no atomics). How many rows
spilled is a device scalar (:meth:`Hybrid.spilled`) that a caller may read when it chooses, e.g. to size the next
step's backup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validation import check_rows
from .compact import dense_to_ell
from .formats import ELL

__all__ = ["Hybrid", "dense_to_hybrid", "DEFAULT_WIDTH", "IN_ELL", "SPILLED"]

DEFAULT_WIDTH = 128
IN_ELL, SPILLED = -1, -2


@dataclass(frozen=True)
class Hybrid:
    """An [M, N] matrix as ELL (``ell``: values/indices [M, width], true counts [M]) plus a dense ``backup``
    [R, N] of overflowed rows, ``backup_rows`` [R] int32 (the matrix row in each backup row, -1 when unused) and
    ``slot`` [M] int32 (``IN_ELL``, a backup row, or ``SPILLED``)."""

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


def dense_to_hybrid(dense: torch.Tensor, width: int = DEFAULT_WIDTH, backup_rows: int | None = None) -> Hybrid:
    """The :class:`Hybrid` form of ``dense`` [M, N] (non-zeros: entries != 0; pass ``relu(pre)`` for a ReLU layer).

    Args:
        width: ELL slots per row (a row with more non-zeros goes to the backup whole).
        backup_rows: R, dense rows kept for overflowed rows (default ``ceil(M / 8)``); overflowed rows past the
            first R are marked ``SPILLED``.
    No host sync; deterministic (prefix sums and a sorted search, no atomics)."""
    check_rows("dense", dense, 2)
    M, N = dense.shape
    R = math.ceil(M / 8) if backup_rows is None else backup_rows
    if not isinstance(R, int) or isinstance(R, bool) or R < 0:
        raise ValueError(f"dense_to_hybrid: backup_rows must be a non-negative int or None; got {backup_rows!r}")
    ell = dense_to_ell(dense, width)
    overflowed = ell.overflowed()
    seen = overflowed.to(torch.int32).cumsum(0, dtype=torch.int32)  # overflowed rows up to and including each row
    rank = seen - 1
    slot = torch.where(overflowed, torch.where(rank < R, rank, SPILLED), IN_ELL).to(torch.int32)
    # backup row s holds the first row at which `seen` reaches s + 1 (M when fewer rows overflowed)
    wanted = torch.arange(1, R + 1, device=dense.device, dtype=torch.int32)
    rows = torch.searchsorted(seen, wanted) if M else torch.zeros(R, dtype=torch.int64, device=dense.device)
    valid = rows < M
    backup = dense[rows.clamp(max=max(M - 1, 0))] if M else dense.new_zeros(R, N)
    backup = torch.where(valid[:, None], backup, 0)  # unused rows: zeros (never read)
    return Hybrid(ell, backup, torch.where(valid, rows, -1).to(torch.int32), slot)
