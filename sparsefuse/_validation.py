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

SNAKE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
CELU_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_snake_shape(shape: torch.Size) -> tuple[int, int, int]:
    """Snake's canonical view of x: [B, C, *] -> (B, C, prod(*)); [C, T] -> (1, C, T)."""
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) < 2:
        raise ValueError(f"snake: x must have shape [C, T] or [B, C, *]; got shape {list(shape)}")
    t = 1
    for d in shape[2:]:
        t *= d
    return (shape[0], shape[1], t)


def check_snake_args(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> tuple[tuple[int, int, int], float]:
    """((B, C, T), eps as a float) for ``snake(x, alpha, eps)``; alpha must be [C] or [1, C, 1]."""
    op = "snake"
    check_float(op, "x", x, SNAKE_DTYPES)
    check_tensor(op, "alpha", alpha)
    check_float(op, "alpha", alpha, SNAKE_DTYPES)
    check_same_device(op, x=x, alpha=alpha)
    eps = check_scalar(op, "eps", eps)
    B, C, T = check_snake_shape(x.shape)
    if alpha.numel() != C or not (alpha.dim() == 1 or (alpha.dim() == 3 and alpha.shape == (1, C, 1))):
        raise ValueError(
            f"snake: alpha must have shape [{C}] or [1, {C}, 1] for x of shape {list(x.shape)}; got {describe(alpha)}"
        )
    return (B, C, T), eps


def check_celu_args(
    op: str, x: torch.Tensor, alpha: float, scale: float, input_scale: float
) -> tuple[float, float, float]:
    """(alpha, scale, input_scale) as floats for ``celu`` / ``celu_``; alpha must be non-zero (CELU divides by it)."""
    check_float(op, "x", x, CELU_DTYPES)
    alpha, scale, input_scale = (
        check_scalar(op, n, v) for n, v in (("alpha", alpha), ("scale", scale), ("input_scale", input_scale))
    )
    if alpha == 0.0:
        raise ValueError(f"{op}: alpha must be non-zero (CELU divides by alpha); got alpha=0 for x with {describe(x)}")
    return alpha, scale, input_scale



# --- SAE (decode, JumpReLU and TopK encodes) --------------------------------------------------------------------


# --- SPLADE head --------------------------------------------------------------------------------------------------

SPLADE_POOLINGS = ("max", "sum")
SPLADE_DTYPES = FLOAT_DTYPES  # hidden and weight; the bias may also be float64


def check_splade_args(op: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      attention_mask: torch.Tensor | None, pooling: str) -> None:
    """hidden [B, S, H] and weight [V, H] of one float dtype, bias [V] or None, attention_mask [B, S] (bool, integer
    or floating) or None, all on one device; pooling one of :data:`SPLADE_POOLINGS`."""
    check_float(op, "hidden", hidden, SPLADE_DTYPES)
    check_float(op, "weight", weight, SPLADE_DTYPES)
    if hidden.dim() != 3:
        raise ValueError(f"{op}: hidden must be [batch, seq_len, hidden_size]; got {describe(hidden)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"{op}: weight must be [vocab_size, hidden_size={hidden.shape[2]}] (the MLM decoder's "
                         f"weight) for hidden of {describe(hidden)}; got weight with {describe(weight)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: hidden and weight must have the same dtype (as for hidden @ weight.T); got hidden "
                        f"{describe(hidden)} and weight {describe(weight)}")
    tensors = {"hidden": hidden, "weight": weight}
    if bias is not None:
        check_float(op, "bias", bias, SPLADE_DTYPES + (torch.float64,))
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must be [vocab_size={weight.shape[0]}]; got {describe(bias)}")
        tensors["bias"] = bias
    if attention_mask is not None:
        check_tensor(op, "attention_mask", attention_mask)
        if attention_mask.is_complex():
            raise TypeError(f"{op}: attention_mask must be bool, integer or floating; got {describe(attention_mask)}")
        if attention_mask.shape != hidden.shape[:2]:
            raise ValueError(f"{op}: attention_mask must be [batch, seq_len] = {list(hidden.shape[:2])} to match "
                             f"hidden of {describe(hidden)}; got {describe(attention_mask)}")
        tensors["attention_mask"] = attention_mask
    check_same_device(op, **tensors)
    if pooling not in SPLADE_POOLINGS:
        raise ValueError(f"{op}: pooling must be one of {SPLADE_POOLINGS}; got {pooling!r}")


# --- FFN (TwELL inference, training) ------------------------------------------------------------------------------
