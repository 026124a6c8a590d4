"""The pass rule every ``check`` entry applies (:func:`compare`) and the shape of an entry (:data:`OpFn`): shared by
:mod:`.check` and the entries kept beside it (:mod:`.check_llama`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sparsefuse.testing import Comparison, compare_to_reference

Outputs = list[tuple[str, Comparison]]
# an entry: (shape, dtype, device, generator) -> (the tensor whose backend is reported, a run returning comparisons)
OpFn = Callable[[Sequence[int], torch.dtype, str, torch.Generator], tuple[torch.Tensor, Callable[[], Outputs]]]


def compare(
    name: str,
    out: torch.Tensor,
    ref: torch.Tensor,
    torch_in_dtype: torch.Tensor,
    dtype: torch.dtype,
    extra_rel: float = 0.0,
    extra_abs: float | torch.Tensor = 0.0,
) -> tuple[str, Comparison]:
    """(name, compare_to_reference result) for one output. Any later op's check can reuse this unchanged.

    Args:
        extra_rel: extra allowance relative to max|ref|, for documented approximations such as fast_sin.
        extra_abs: extra absolute allowance (a number, or one per element), e.g. :func:`reduction_allowance` for
            outputs that are sums.
    """
    ref = ref.detach()
    extra = extra_abs + (extra_rel * float(ref.abs().max()) if ref.numel() else 0.0)
    result = compare_to_reference(out.detach(), ref, torch_in_dtype.detach(), dtype=dtype, extra_abs=extra, name=name)
    return name, result
