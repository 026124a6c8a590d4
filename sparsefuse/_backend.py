"""Where a sparsefuse call runs, and a record of which kernels actually launched.

Three backends:

* ``"triton"``       CUDA tensors: compiled Triton kernels.
* ``"interpreter"``  ``TRITON_INTERPRET=1`` was set before sparsefuse was imported: the *same* Triton kernels,
                     executed by Triton's CPU interpreter (this is how CI tests the kernels without a GPU).
* ``"torch"``        CPU tensors otherwise: the plain-torch reference, with a one-time warning.

Triton decides at decoration time (module import) whether ``@triton.jit`` functions are interpreted, so the
interpreter flag is read once, here, at import.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton

from ._plan import config as _plan_config

__all__ = [
    "Backend",
    "backend_for",
    "INTERPRET",
    "STREAMING_WARPS",
    "streaming_block",
    "track_launches",
    "record_launch",
    "tuning_configs",
    "block_configs",
    "new_output",
    "new_output_like",
    "is_dense",
    "empty_layout_like",
    "new_output_layout_like",
    "poison_outputs",
    "sm_count",
    "dram_bandwidth",
    "on_tensor_device",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off")
# Triton's interpreter without its discarded overflow checks and redundant re-patching (sparsefuse/_fast_interpreter.py)
FAST_INTERPRETER: bool = INTERPRET and os.environ.get("SPARSEFUSE_FAST_INTERPRETER", "0") == "1"
if FAST_INTERPRETER:
    from sparsefuse._fast_interpreter import install as _install_fast_interpreter

    _install_fast_interpreter()
# Whether a bf16 tl.dot computes what the GPU computes: the interpreter's multiplies raw bit patterns and is always
# corrected (sparsefuse/_interpreter_dot.py), except on a Triton whose interpreter that correction does not know.
BF16_DOT_OK: bool = True
if INTERPRET:
    from sparsefuse._interpreter_dot import install as _install_interpreter_dot

    BF16_DOT_OK = _install_interpreter_dot()


class Backend(str, enum.Enum):
    TRITON = "triton"
    INTERPRETER = "interpreter"
    TORCH = "torch"


def cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for the host's launch arithmetic, without its per-call wrapper: ``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions whose every host call unwraps its arguments (~2 us, where this
    takes 0.1), and a training step of the sparse FFN alone makes ~27 such calls."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` on the host (0 for n <= 0), without its per-call wrapper (see :func:`cdiv`)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@functools.cache
def _cached_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# The device queries below run at trace time under torch.compile, their answers baked in as constants: a host-side
# cost model reads them from traced code, and Dynamo cannot trace Triton's driver query (a graph break).
@torch.compiler.assume_constant_result
def _cuda_sm_count(index: int) -> int:
    return _cached_sm_count(index)


def sm_count(device: torch.device, interpreted: int = 8) -> int:
    """Streaming multiprocessors of a CUDA device (cached); ``interpreted`` stands in for CPU tensors, so grids
    sized by it still give the interpreter several programs per "SM" to run."""
    if device.type != "cuda":
        return interpreted
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cached_dram_bandwidth(index: int) -> float:
    """0.0 where the driver does not report the memory clock and bus width, or Triton lacks the query."""
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
    except (AttributeError, RuntimeError):
        return 0.0
    clock_khz, bus_bits = props.get("mem_clock_rate", 0), props.get("mem_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else 0.0  # double data rate


@torch.compiler.assume_constant_result
def _cuda_dram_bandwidth(index: int) -> float:
    return _cached_dram_bandwidth(index)


def dram_bandwidth(device: torch.device) -> float | None:
    """Peak DRAM bandwidth of a CUDA device in bytes/s (memory clock x bus width, double data rate; cached), or
    None where it is unknown (CPU tensors, a driver that does not report it). Cost models scale their byte-bound
    terms by it: H100 SXM 3.35e12, H200 4.8e12."""
    if device.type != "cuda":
        return None
    # 0.0 where unknown: cost models keep their reference rates
    return _cuda_dram_bandwidth(device.index if device.index is not None else torch.cuda.current_device()) or None


# Launch rule for the elementwise (streaming) kernels, measured rather than autotuned (H200, CUDA-graph replay with
# inputs rotated past L2): 4 KB tiles of the input over 4 warps
# were within 2% of the best of 17 configurations at every Snake bench shape from 1M elements up but one (fp32
# 1x256x15104, 6% behind a 16 KB row tile that is 5% behind elsewhere); below four such tiles per SM, 2 KB tiles
# keep every SM busy. Triton's autotuner times each candidate on one L2-resident input: its picks were 2-8% behind
# the best at 3 of the 7 fp32 shapes, and it cost seconds on every new size bucket.
STREAMING_WARPS = 4
STREAMING_TILE_BYTES = 4096


def streaming_block(n: int, element_size: int, device: torch.device, interpret_block: int) -> int:
    """Elements per program for an elementwise kernel over n elements of element_size bytes (see above)."""
    if INTERPRET:
        return interpret_block
    tile = STREAMING_TILE_BYTES
    if n * element_size < 4 * tile * sm_count(device):
        tile //= 2
    return max(1, tile // element_size)


def backend_for(*tensors: torch.Tensor) -> Backend:
    """The backend a sparsefuse call on these tensors takes (see module docstring)."""
    if INTERPRET:
        return Backend.INTERPRETER
    if tensors and all(t.is_cuda for t in tensors):
        return Backend.TRITON
    return Backend.TORCH


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision kernels (and the torch fallback) compute in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# (significand bits, frexp exponent of the smallest normal, largest finite) of the dtypes the kernels take
_FORMATS = {
    torch.float32: (24, -125, torch.finfo(torch.float32).max),
    torch.float16: (11, -13, torch.finfo(torch.float16).max),
    torch.bfloat16: (8, -125, torch.finfo(torch.bfloat16).max),
}


def threshold_in(dtype: torch.dtype, threshold: float) -> float:
    """The largest value of ``dtype`` that is <= ``threshold`` (>= 0): for every value v of that dtype, ``v >
    threshold_in(dtype, t)`` compared in the dtype's arithmetic is ``v > t`` exactly. torch compares a half-precision
    tensor with a Python float after rounding the float to the tensor's dtype (to nearest), and Triton rounds a float
    argument to fp32, so every path passes this instead: each then fires exactly where the pre-activation it holds
    exceeds the threshold. Pure Python (torch.compile traces it as constants)."""
    if threshold <= 0 or dtype not in _FORMATS:
        return threshold
    bits, min_exponent, largest = _FORMATS[dtype]
    if threshold >= largest:
        return largest
    spacing = max(math.frexp(threshold)[1], min_exponent) - bits  # the dtype's grid step near the threshold: 2**spacing
    return math.ldexp(math.floor(math.ldexp(threshold, -spacing)), spacing)


# The op that warned first (empty until then). One warning per process, not one per op: the fallback is one fact
# about the machine, and a script calling several ops on CPU tensors should say it once, not once per op.
_warned: set[str] = set()


def warn_reference_once(op: str) -> None:
    """Warn, the first time any op falls back to the plain-torch reference on CPU tensors in this process, that
    CPU tensors get no speed-up; later fallbacks, of this op or another, are silent."""
    if _warned:
        return
    _warned.add(op)
    warnings.warn(
        f"sparsefuse.{op}: CPU tensors run the plain-torch reference, with no speed-up (so does every other "
        "sparsefuse op on CPU tensors: warned once per process). Use CUDA tensors, or set TRITON_INTERPRET=1 "
        "before import to run the Triton kernels on the CPU.",
        stacklevel=_caller_stacklevel(),
    )


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warn_reference_once`'s warning that names the first frame outside sparsefuse
    and torch: the user's line, however deep in the package (functional API, custom op, launcher) the op warned."""
    frame = sys._getframe(2)  # warn_reference_once's caller: stacklevel 2
    level = 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
        frame = frame.f_back
        level += 1
    return level


# --- eager fast path ----------------------------------------------------------------------------------------------
# A torch.library op costs tens of microseconds of host time per call before the kernel is launched. Models like
# SNAC call small activations dozens of times per step and are host-bound, so in plain eager inference the
# functional API calls the launcher directly. Anything that needs the dispatcher -- autograd, torch.compile/export
# tracing, tensor subclasses (FakeTensor, DTensor), dispatch modes, functorch transforms -- still goes through the op.
# (sparsefuse.planning(eager_fast_path=False) sends every call through its op.)
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


@functools.cache
def _several_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 1


def _on_another_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a GPU other than the current one (never, and nothing queried, with one GPU visible)."""
    return (
        t.is_cuda and _several_gpus() and t.device.index is not None and t.device.index != torch.cuda.current_device()
    )


def on_tensor_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for a custom op's implementation: Triton launches on the *current* CUDA device, so a call whose
    first tensor argument lives on another GPU (a layer on ``cuda:1`` while ``cuda:0`` is current) runs with that
    GPU made current for its duration. Costs a device query per call where several GPUs are visible."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and _on_another_gpu(first):
            with torch.cuda.device(first.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def plain_eager_call(*tensors: torch.Tensor) -> bool:
    """True for a plain eager call on plain tensors: no torch.compile/export tracing, no tensor subclass (FakeTensor,
    DTensor), no dispatch mode, no functorch transform. Such a call may skip the torch.library dispatcher; autograd
    can then be served by a ``torch.autograd.Function`` around the same implementation."""
    if torch.compiler.is_compiling() or not _plan_config.CONFIG.eager_fast_path:
        return False
    if any(type(t) not in _PLAIN_TENSOR_TYPES for t in tensors):
        return False
    return torch._C._len_torch_dispatch_stack() == 0 and not torch._C._are_functorch_transforms_active()


def bypass_dispatcher(*tensors: torch.Tensor) -> bool:
    """True when calling the launcher directly is indistinguishable from calling the torch.library op (the op
    also makes the tensors' GPU current where it is not)."""
    if not plain_eager_call(*tensors):
        return False
    if tensors and _on_another_gpu(tensors[0]):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def inductor_traces_inference() -> bool:
    """True while torch.compile traces a call that records no autograd graph (inference). There the drop-in
    modules whose gain is fusing a chain of elementwise ops (RMSNorm, the rotary embedding) hand the compiler the
    plain torch expression instead of their op: the compiler fuses that expression with its neighbours (the
    residual add before a norm, the casts around it), which an opaque op prevents. On an H200, a 6-layer 1.5B-shape
    ReLU Llama under torch.compile ran 0.95x (prefill 4 x 2048) and 0.98x / 0.89x (one decode step at batch 1 / 8,
    mode="reduce-overhead") of the unpatched compiled model with the fused norm and rotary ops, and 1.17x / 1.08x /
    0.98x with the sparse FFN alone."""
    return torch.compiler.is_compiling() and not torch.is_grad_enabled()


# --- launch accounting ------------------------------------------------------------------------------------------
# Every launcher calls record_launch(<kernel name>) so tests can assert that a Triton kernel really ran (and the
# reference was not silently compared with itself). A dict increment per launch costs ~50 ns.
_LAUNCHES: collections.Counter[str] = collections.Counter()


def record_launch(kernel_name: str) -> None:
    _LAUNCHES[kernel_name] += 1


@contextlib.contextmanager
def track_launches() -> Iterator[collections.Counter[str]]:
    """Context manager yielding a Counter of kernel launches made inside the block (filled on exit)."""
    before = collections.Counter(_LAUNCHES)
    launched: collections.Counter[str] = collections.Counter()
    try:
        yield launched
    finally:
        launched.update(_LAUNCHES - before)


def tuning_configs(configs: list[triton.Config], interpret_config: triton.Config) -> list[triton.Config]:
    """Autotuning candidates on a GPU; a single fixed config under the interpreter (timing it would be meaningless
    and slow)."""
    return [interpret_config] if INTERPRET else configs


def block_configs(
    block_name: str, blocks_and_warps: list[tuple[int, int]], interpret_block: int
) -> list[triton.Config]:
    """:func:`tuning_configs` for kernels tuned over one block size and the warp count."""
    return tuning_configs(
        [triton.Config({block_name: block}, num_warps=warps) for block, warps in blocks_and_warps],
        interpret_config=triton.Config({block_name: interpret_block}),
    )


# --- output allocation ------------------------------------------------------------------------------------------
# Tests turn poisoning on so that every output a kernel should write starts as NaN: an element the kernel forgets
# to write then fails the comparison instead of passing on whatever the allocator happened to hand out.
_POISON = os.environ.get("SPARSEFUSE_POISON_OUTPUTS", "0") == "1"


def _poison(out: torch.Tensor) -> torch.Tensor:
    """Under poison_outputs: NaN in a float output, -1 (no valid index, count or position) in an integer one."""
    if _POISON and out.numel():
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def new_output(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _poison(torch.empty(shape, dtype=dtype, device=device))


def new_output_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like (dense inputs keep their strides), poisoned like new_output."""
    return _poison(torch.empty_like(t))


def is_dense(t: torch.Tensor) -> bool:
    """True if t's elements exactly fill their memory span (a permutation of a contiguous tensor). An elementwise
    kernel then runs over the storage as a flat array, and ``empty_like`` gives the output the same strides."""
    if t.is_contiguous():
        return True
    expected = 1
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def empty_layout_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised output for input t (an op and its fake share it): t's strides when t is dense, else
    contiguous; t's dtype unless given."""
    dtype = t.dtype if dtype is None else dtype
    if is_dense(t):
        return torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype, device=t.device)


def new_output_layout_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`empty_layout_like`, poisoned like new_output."""
    return _poison(empty_layout_like(t, dtype))


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """Fill every kernel output with NaN (integer outputs: -1) before launch while inside the block (tests use this)."""
    global _POISON
    previous, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = previous
