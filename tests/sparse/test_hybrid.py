"""The Hybrid training format: fixed-width ELL plus a dense backup of overflowed rows, built without a sync and
never dropping a value (rows past the backup are marked spilled, to be recomputed)."""

import pytest
import torch
from conftest import assert_backend
from helpers import sparse_rows

from sparsefuse import track_launches
from sparsefuse.sparse import ELL, Hybrid, dense_to_hybrid
from sparsefuse.sparse.formats import IN_ELL, SPILLED


def _expected_slots(counts: list[int], width: int, backup: int) -> list[int]:
    slots, used = [], 0
    for c in counts:
        if c <= width:
            slots.append(IN_ELL)
        elif used < backup:
            slots.append(used)
            used += 1
        else:
            slots.append(SPILLED)
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n, l0s, width, backup",
    [
        (300, [0, 3, 300, 7, 40, 0, 12, 299], 16, 2),  # an all-dense row, rows over the width, N not a power of 2
        (64, [5, 5, 5], 8, None),  # nothing overflows
        (200, [50, 60, 70, 80, 1], 10, 1),  # more overflowed rows than the backup holds: spilled, counted
        (100, [0, 0, 0, 0], 4, None),  # an all-zero batch
        (100, [30, 30], 4, 0),  # no backup at all: every overflowed row spills
    ],
)
def test_dense_to_hybrid_stores_every_value_or_marks_the_row(n, l0s, width, backup, dtype, device):
    dense = sparse_rows(len(l0s), n, l0s, dtype, device)
    assert_backend(dense)
    with track_launches() as launched:
        hybrid = dense_to_hybrid(dense, width=width, backup_rows=backup)
    assert launched["bits_to_sparse_kernel"] == 1  # the ELL part is the core's compaction kernel
    R = -(-len(l0s) // 8) if backup is None else backup
    assert hybrid.backup.shape == (R, n) and hybrid.shape == dense.shape
    ref = ELL.from_dense(dense, width)
    assert torch.equal(hybrid.ell.counts.cpu(), ref.counts.cpu())
    assert torch.equal(hybrid.ell.indices.cpu(), ref.indices.cpu())
    slots = _expected_slots(ref.counts.tolist(), width, R)
    assert hybrid.slot.tolist() == slots
    assert int(hybrid.spilled()) == slots.count(SPILLED)
    assert int(hybrid.nonzeros()) == int((dense != 0).sum())
    for s, row in enumerate(hybrid.backup_rows.tolist()):
        if row >= 0:
            assert slots[row] == s and torch.equal(hybrid.backup[s].cpu(), dense[row].cpu())
        else:
            assert s >= sum(1 for x in slots if x >= 0)
    # exact: spilled rows need their recomputed values, every other row comes from the format
    if SPILLED in slots:
        with pytest.raises(ValueError, match=r"spilled past the backup"):
            hybrid.to_dense()
        poison = torch.full_like(dense, float("nan"))
        lost = torch.tensor([x == SPILLED for x in slots], device=dense.device)
        poison[lost] = dense[lost]
        assert torch.equal(hybrid.to_dense(spilled=poison).cpu(), dense.cpu())
    else:
        assert torch.equal(hybrid.to_dense().cpu(), dense.cpu())


def test_dense_to_hybrid_is_deterministic_and_counts_nan_as_fired(device):
    dense = sparse_rows(9, 130, [1, 90, 2, 91, 3, 92, 4, 93, 0], device=device)
    dense[8, 5] = float("nan")
    a, b = dense_to_hybrid(dense, width=8, backup_rows=2), dense_to_hybrid(dense, width=8, backup_rows=2)
    for x, y in ((a.ell.values, b.ell.values), (a.ell.indices, b.ell.indices), (a.backup, b.backup)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)  # bit for bit, NaN included
    assert a.slot.tolist() == [IN_ELL, 0, IN_ELL, 1, IN_ELL, SPILLED, IN_ELL, SPILLED, IN_ELL]
    assert int(a.ell.counts[8]) == 1


def test_hybrid_validates_its_parts(device):
    h = dense_to_hybrid(sparse_rows(3, 20, [1, 2, 3], device=device), width=4)
    with pytest.raises(ValueError, match=r"Hybrid.backup must be \[R, 20\]"):
        Hybrid(h.ell, h.backup[:, :5], h.backup_rows, h.slot)
    with pytest.raises(ValueError, match=r"Hybrid.slot must be int32 of shape \[3\]"):
        Hybrid(h.ell, h.backup, h.backup_rows, h.slot.long())
    with pytest.raises(ValueError, match="backup_rows must be a non-negative int"):
        dense_to_hybrid(sparse_rows(3, 20, [1, 2, 3], device=device), backup_rows=-1)
