"""``tl.dot`` on bfloat16 under Triton's interpreter, computed as the GPU computes it.

The interpreter keeps bfloat16 values as their raw 16-bit patterns (numpy has no bfloat16) and its ``create_dot``
hands those patterns to ``np.matmul`` as integers: a bf16 product comes out as garbage (relative errors of 1e10 and
more), silently. On a GPU a bf16 ``tl.dot`` multiplies exactly (a bf16 product fits in float32) and accumulates in
float32; here the operands are widened to float32 (exact) and multiplied in float32, which is the same arithmetic up
to summation order. Every other dot goes to the interpreter's own code.

Installed whenever ``TRITON_INTERPRET=1`` is set before sparsefuse is imported (:mod:`sparsefuse._backend`): a
correction, not an option. A Triton whose interpreter has no ``InterpreterBuilder.create_dot`` or
``_convert_float`` is left as it is (:func:`install` returns False).
"""

from __future__ import annotations

from typing import Any


def install() -> bool:
    """Route the interpreter's bf16 dots through float32 (idempotent); False where this Triton differs."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    convert = getattr(interpreter, "_convert_float", None)
    handle = getattr(interpreter, "TensorHandle", None)
    dot = getattr(builder, "create_dot", None)
    if dot is None or convert is None or handle is None:
        return False
    if getattr(dot, "_sparsefuse_bf16", False):
        return True
    import numpy as np
    import triton.language as tl

    def widened(t: Any) -> Any:
        """t's values as float32 (bf16 widened exactly; float32 as is)."""
        if _scalar(t.dtype) == tl.bfloat16:
            return convert(t.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return t.data.astype(np.float32, copy=False)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (_scalar(a.dtype), _scalar(b.dtype)):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.matmul(widened(a), widened(b), dtype=np.float32) + widened(d)
        acc_dtype = _scalar(d.dtype)
        if acc_dtype == tl.bfloat16:  # a bf16 accumulator: rounded back to its bit patterns
            out = convert(out, tl.float32, tl.bfloat16, None).view(np.uint16)
        else:
            out = out.astype(d.data.dtype, copy=False)
        return handle(out, acc_dtype)

    create_dot._sparsefuse_bf16 = True
    builder.create_dot = create_dot
    return True


def _scalar(dtype: Any) -> Any:
    """The element type of a Triton (block) type."""
    return getattr(dtype, "scalar", dtype)
