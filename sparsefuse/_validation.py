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
