"""Every argument check of the public ops, in one place: clear errors naming the argument, its shape/dtype and what
was expected, raised before anything is allocated or launched.

The generic checks come first; each system's own checks follow under its heading, so a reader looking for "what does
twell_mlp reject" finds it here and nowhere else."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


def describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, dtype {str(t.dtype).removeprefix('torch.')}, device {t.device}"


def check_tensor(op: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    check_tensor(op, name, t)
    if t.dtype not in allowed:
        names = ", ".join(_DTYPE_NAMES.get(d, str(d)) for d in allowed)
        raise TypeError(f"{op}: {name} must have a floating dtype ({names}); got {describe(t)}")


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on the same device"
            )


def check_scalar(op: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a Python float, got {type(value).__name__}")
    return float(value)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (what the kernels' row loads need), else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


# --- sparse formats and the shared core ---------------------------------------------------------------------------


# --- activations (Snake, CELU) ----------------------------------------------------------------------------------


# --- SAE (decode, JumpReLU and TopK encodes) --------------------------------------------------------------------


# --- SPLADE head --------------------------------------------------------------------------------------------------


# --- FFN (TwELL inference, training) ------------------------------------------------------------------------------


def check_ffn_x(op: str, x: object, K: int | None = None) -> torch.Tensor:
    """x [..., K] of a float dtype."""
    check_tensor(op, "x", x)
    check_float(op, "x", x, FLOAT_DTYPES)
    if x.dim() < 1 or (K is not None and x.shape[-1] != K):
        raise ValueError(f"{op}: x must be [..., hidden_size={K}]; got {describe(x)}")
    return x


def check_ffn_weight(op: str, name: str, w: object, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """A weight of exactly ``shape`` (nn.Linear layout [out, in]) in x's dtype."""
    check_tensor(op, name, w)
    check_float(op, name, w)
    if w.dtype != x.dtype:
        raise TypeError(f"{op}: {name} must have x's dtype {str(x.dtype).removeprefix('torch.')}; got {describe(w)}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {list(shape)} (nn.Linear layout [out, in]) for x "
                         f"{describe(x)}; got {describe(w)}")
    return w


def check_ffn_bias(op: str, name: str, b: object, n: int, x: torch.Tensor) -> None:
    """A bias [n] in x's dtype."""
    check_tensor(op, name, b)
    check_float(op, name, b)
    if b.dtype != x.dtype or tuple(b.shape) != (n,):
        raise ValueError(f"{op}: {name} must be a [{n}] tensor of x's dtype {str(x.dtype).removeprefix('torch.')}; "
                         f"got {describe(b)}")


def check_ffn_compression(op: str, compression: object) -> None:
    """The compression when the tile is left to the op: it must divide every tile the op may choose."""
    if not isinstance(compression, int) or isinstance(compression, bool) or compression <= 0 or \
            compression & (compression - 1) or compression > 1024:
        raise ValueError(f"{op}: compression must be a power of two in [1, 1024] (it must divide the power-of-two "
                         f"tile); got {compression!r}")


def check_ffn_expected_nnz(op: str, expected_nnz: object) -> None:
    if expected_nnz is not None and (isinstance(expected_nnz, bool) or not isinstance(expected_nnz, (int, float))
                                     or not expected_nnz >= 0):
        raise ValueError(f"{op}: expected_nnz must be a non-negative number; got {expected_nnz!r}")


def check_ffn_mlp(op: str, x: object, w_gate: object, b_gate: object, w_up: object, b_up: object, w_down: object,
                  b_down: object, gate_names: tuple[str, str] = ("w_gate", "b_gate")) -> None:
    """A feed-forward block's arguments: x [..., K]; w_gate, w_up [N, K]; w_down [K, N]; biases [N], [N], [K];
    one dtype and device. ``gate_names``: what the activation weight and bias are called in messages (w_up/b_up for
    the non-gated block, which passes ``w_up=None``)."""
    w_name, b_name = gate_names
    check_tensor(op, w_name, w_gate)
    if w_gate.dim() != 2:
        raise ValueError(f"{op}: {w_name} must be [intermediate_size, hidden_size] (nn.Linear layout); got "
                         f"{describe(w_gate)}")
    N, K = w_gate.shape
    check_ffn_x(op, x, K)
    check_ffn_weight(op, w_name, w_gate, (N, K), x)
    if w_up is not None:
        check_ffn_weight(op, "w_up", w_up, (N, K), x)
    check_ffn_weight(op, "w_down", w_down, (K, N), x)
    biases = {}
    for name, b, n in ((b_name, b_gate, N), ("b_up", b_up, N), ("b_down", b_down, K)):
        if b is not None:
            check_ffn_bias(op, name, b, n, x)
            biases[name] = b
    others = {w_name: w_gate, "w_down": w_down, **({"w_up": w_up} if w_up is not None else {}), **biases}
    check_same_device(op, x=x, **others)
