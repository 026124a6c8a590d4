"""The SFU's approximate float32 transcendentals, one MUFU instruction each, for kernels whose output dtype cannot
see their error. The CPU interpreter has no SFU (nor inline PTX): there the exact tl functions stand in."""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import INTERPRET

if INTERPRET:

    @triton.jit
    def sfu_sin(r):
        return tl.sin(r)

    @triton.jit
    def sfu_cos(r):
        return tl.cos(r)

    @triton.jit
    def sfu_exp2_ftz(v):
        return tl.exp2(v)

else:

    @triton.jit
    def _sfu(v, INSTRUCTION: tl.constexpr):
        return tl.inline_asm_elementwise(INSTRUCTION, "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def sfu_sin(r):
        """sin.approx.f32: absolute error 2^-21.4 for |r| <= pi."""
        return _sfu(r, "sin.approx.f32 $0, $1;")

    @triton.jit
    def sfu_cos(r):
        """cos.approx.f32: absolute error 2^-21.4 for |r| <= pi."""
        return _sfu(r, "cos.approx.f32 $0, $1;")

    @triton.jit
    def sfu_exp2_ftz(v):
        """ex2.approx.ftz.f32 (what tl.exp2 lowers to, without the guards that keep a denormal result)."""
        return _sfu(v, "ex2.approx.ftz.f32 $0, $1;")
