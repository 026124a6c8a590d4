"""unit_rows: rows at unit stride, a transposed or strided 2-D tensor copied by the tiled transpose kernel."""

import pytest
import torch
from conftest import assert_backend

from sparsefuse import track_launches
from sparsefuse.sparse.layout import unit_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
@pytest.mark.parametrize("R, C", [(1, 2), (70, 130), (64, 64), (3, 200)])
def test_transposed_and_strided_views_are_copied_exactly(R, C, dtype, device):
    base = (torch.randn(C, R) * 100).to(dtype).to(device)
    assert_backend(base)
    for view in (base.t(), torch.cat([base, base]).t()[:, ::2], base.t()[::2]):
        with track_launches() as launched:
            got = unit_rows(view)
        copied = view.stride(-1) != 1  # (one row: its last stride can be 1 already)
        assert launched["transpose_copy_kernel"] == copied and torch.equal(got, view)
        assert got.is_contiguous() or not copied
        into = torch.full(view.shape, -7, dtype=dtype, device=device)
        assert unit_rows(view, out=into) is into and torch.equal(into, view)


def test_rows_already_at_unit_stride_are_returned_as_they_are(device):
    t = torch.randn(5, 8, device=device)
    with track_launches() as launched:
        assert unit_rows(t) is t and unit_rows(t[:, :3]).data_ptr() == t.data_ptr()
        assert unit_rows(t[::2]).data_ptr() == t.data_ptr() and unit_rows(t[:, 0:1]).data_ptr() == t.data_ptr()
    assert not launched
    assert unit_rows(torch.empty(0, 4, device=device).t()).shape == (4, 0)
    with pytest.raises(ValueError, match=r"out must be a contiguous \[8, 5\]"):
        unit_rows(t.t(), out=torch.empty(5, 8, device=device))
