"""The one-pass dense -> ELL compaction: every path of its look-back (a predecessor's inclusive prefix, a walk
over windows of aggregates, the recount from dense) places the same entries as the float reference."""

import pytest
import torch
from conftest import assert_backend
from helpers import sparse_rows

from sparsefuse import _backend, track_launches
from sparsefuse.sparse import ELL, dense_to_ell
from sparsefuse.sparse.ell_compact import _launch_dense_to_ell

# (spins, publish_inclusive): the GPU's path; aggregates only, so each look-back walks its windows to the row's
# start (several windows a row at the interpreter's chunks); no wait allowed, so every prefix is recounted from dense
PATHS = [(4096, True), (4096, False), (-1, True)]


def _compact(dense: torch.Tensor, width: int, spins: int, publish_inclusive: bool) -> ELL:
    M = dense.shape[0]
    values = _backend.new_output((M, width), dense.dtype, dense.device)  # NaN / -1 under test
    indices = _backend.new_output((M, width), torch.int32, dense.device)
    counts = _backend.new_output((M,), torch.int32, dense.device)
    _launch_dense_to_ell(dense, values, indices, counts, spins=spins, publish_inclusive=publish_inclusive)
    return ELL(values, indices, counts, dense.shape[1])


def _assert_same(got: ELL, ref: ELL) -> None:
    assert torch.equal(got.counts.cpu(), ref.counts.cpu())
    assert torch.equal(got.indices.cpu(), ref.indices.cpu())
    # bitwise, NaN included (a NaN activation is a non-zero and is stored)
    assert torch.equal(got.values.cpu().view(torch.uint8), ref.values.cpu().view(torch.uint8))


@pytest.mark.parametrize("spins, publish_inclusive", PATHS, ids=["inclusive", "aggregates", "recount"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n, l0s, width",
    [
        (300, [0, 3, 300, 7, 40], 16),  # an all-dense row, rows over the width, an empty row, N not a power of 2
        (1000, [1, 999, 64, 65, 2], 64),  # rows one under, at and over the width; many windows a row
        (17, [17, 0, 5], 32),  # the width past N: every row's padding
        (1, [1], 1),
    ],
)
def test_every_look_back_path_places_the_reference_entries(n, l0s, width, dtype, spins, publish_inclusive, device):
    dense = sparse_rows(2 * len(l0s) + 1, n, l0s, dtype, device)  # rows not a multiple of a program's rows
    dense[0, n // 2] = float("nan")
    assert_backend(dense)
    with track_launches() as launched:
        got = _compact(dense, width, spins, publish_inclusive)
    assert dict(launched) == {"dense_to_ell_kernel": 1}
    _assert_same(got, ELL.from_dense(dense, width))


def test_ell_of_a_strided_view_and_of_empty_inputs(device):
    base = sparse_rows(6, 400, [5, 0, 200], device=device)
    view = base[::2, 100:350]  # rows strided, columns a window
    _assert_same(dense_to_ell(view, 8), ELL.from_dense(view, 8))
    for shape in ((0, 50), (4, 0)):
        empty = torch.zeros(shape, device=device)
        ell = dense_to_ell(empty, 3)
        assert ell.values.shape == (shape[0], 3) and int(ell.counts.sum()) == 0


@pytest.mark.skipif(_backend.INTERPRET, reason="thousands of programs at once: the GPU's concurrency")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ell_under_real_concurrency_is_exact_every_time(dtype, device):
    """At SAE shapes the chunks of a row run side by side on many SMs; repeated calls give the reference entries
    every time (a look-back that read a status too early would place entries at shifted slots)."""
    if device.type != "cuda":
        pytest.skip("needs a GPU")
    torch.manual_seed(0)
    for M, N, width, density in ((256, 65536, 288, 72 / 65536), (4096, 16384, 64, 0.003), (64, 8192, 8192, 0.5)):
        dense = (torch.randn(M, N, device=device) * (torch.rand(M, N, device=device) < density)).to(dtype)
        ref = ELL.from_dense(dense, width)
        for _ in range(10):
            _assert_same(dense_to_ell(dense, width), ref)
