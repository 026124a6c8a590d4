"""The test session's interpreter (sparsefuse/_fast_interpreter.py) runs kernels and helpers as Triton's own does."""

import pytest
import torch
import triton
import triton.language as tl

from sparsefuse import _backend

pytestmark = pytest.mark.skipif(not _backend.INTERPRET, reason="Triton's interpreter only")


@triton.jit
def _inner(x):
    return x * 2 + tl.zeros_like(x)  # tl.zeros_like: a helper of triton.language.standard (its globals: core)


@triton.jit
def _six():
    return tl.sum(tl.arange(0, 4), axis=0)


@triton.jit
def _outer(x):
    return _inner(x) + _six()  # a helper calling helpers


@triton.jit
def _kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _outer(tl.load(x_ptr + offs)))


def test_nested_helpers_run_inside_launches_and_a_helper_called_outside_one_still_runs():
    from triton.runtime import interpreter

    from sparsefuse._fast_interpreter import install

    assert install() and interpreter._patch_lang._sparsefuse_once
    x = torch.arange(8, dtype=torch.float32)
    for _ in range(2):  # the second launch starts from the first one's restored modules
        y = torch.full_like(x, float("nan"))
        _kernel[(1,)](x, y, BLOCK=8)
        assert torch.equal(y, x * 2 + 6)
    # a jit function called from the host after a launch (no launch running) is patched as Triton does it
    assert _six().handle.data.tolist() == [6]


@triton.jit
def _add_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 2147483000)


def test_the_overflow_sanitiser_is_off_while_its_checks_would_be_discarded_and_int32_wraps_as_compiled():
    from triton.runtime import interpreter

    from sparsefuse._fast_interpreter import skip_discarded_overflow_checks

    assert _backend.FAST_INTERPRETER  # installed for the session by sparsefuse._backend (tests/conftest.py asks)
    assert skip_discarded_overflow_checks()
    options = interpreter.interpreter_builder.options
    assert not options.sanitize_overflow and not options.debug
    x = torch.tensor([0, 600, 1000, -5], dtype=torch.int32)
    y = torch.zeros_like(x)
    _add_kernel[(1,)](x, y, BLOCK=4)
    assert torch.equal(y, x + 2147483000)  # torch's int32 add wraps too
