"""Every argument check of the public ops, in one place: clear errors naming the argument, its shape/dtype and what
was expected, raised before anything is allocated or launched.

The generic checks come first; each system's own checks follow under its heading, so a reader looking for "what does
twell_mlp reject" finds it here and nowhere else."""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


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
    """One device for every tensor, and one the kernels run on (CUDA, or the CPU through Triton's interpreter or the
    torch reference): a meta tensor, say, gets this error rather than a failure deep in a launch."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {first_name} is on {first.device}; "
                "all tensors must be on the same device"
            )
    if first.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{op}: {first_name} is on {first.device}; sparsefuse runs on CUDA devices and on the CPU "
            f"(Triton's interpreter or the torch reference); got {describe(first)}"
        )


def check_scalar(op: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a Python float, got {type(value).__name__}")
    return float(value)


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., n] as [rows, n] -- ``reshape(-1, n)``, but also for n = 0, where -1 would be ambiguous."""
    rows = 1
    for size in t.shape[:-1]:
        rows *= size
    return t.reshape(rows, t.shape[-1])


def unit_last_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` itself when its last dimension is contiguous (what the kernels' row loads need), else a contiguous copy
    (None, an absent optional tensor, passes through)."""
    if t is None:
        return None
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


# --- sparse formats and the shared core ---------------------------------------------------------------------------


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_rows(name: str, t: torch.Tensor, dims: int) -> None:
    """ValueError unless ``t`` has ``dims`` dimensions (a format's values, a dense operand)."""
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s); got shape {list(t.shape)}")


def check_indices(fmt: str, values: torch.Tensor, indices: torch.Tensor) -> None:
    """ValueError unless a format's ``indices`` are int32 of its ``values``' shape."""
    if indices.shape != values.shape or indices.dtype != torch.int32:
        raise ValueError(
            f"{fmt}.indices must be int32 of shape {list(values.shape)}; got {indices.dtype} {list(indices.shape)}"
        )


def check_twell_geometry(op: str, tile: object, compression: object) -> None:
    """ValueError unless ``tile`` is a power of two in [16, 1024] and ``compression`` a positive int dividing it."""
    for name, value in (("tile", tile), ("compression", compression)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{op}: {name} must be a positive int; got {value!r}")
    if not (_is_power_of_two(tile) and 16 <= tile <= 1024):
        raise ValueError(f"{op}: tile must be a power of two between 16 and 1024; got tile={tile}")
    if tile % compression:
        raise ValueError(
            f"{op}: compression={compression} does not divide tile={tile} (a tile keeps "
            f"tile / compression slots, which must be a whole number)"
        )


def check_block_rows(fmt: str, block_rows: object) -> None:
    """ValueError unless ``block_rows`` is a tensor-core row block: a power of two in [16, 256]."""
    if (
        not isinstance(block_rows, int)
        or isinstance(block_rows, bool)
        or not _is_power_of_two(block_rows)
        or not 16 <= block_rows <= 256
    ):
        raise ValueError(
            f"{fmt}: block_rows must be a power of two in [16, 256] (a tensor-core row block); got {block_rows!r}"
        )


def check_row_order(fmt: str, row_order: torch.Tensor | None, M: int) -> None:
    """ValueError unless ``row_order`` is None or int32 [M] (a permutation of the rows)."""
    if row_order is not None and (row_order.shape != (M,) or row_order.dtype != torch.int32):
        raise ValueError(
            f"{fmt}.row_order must be None or int32 of shape [{M}] (a permutation of the rows); got "
            f"{row_order.dtype} {list(row_order.shape)}"
        )


def check_dense(op: str, dense: torch.Tensor) -> None:
    """The dense [rows, cols] float operand of a compaction."""
    check_float(op, "dense", dense)
    if dense.dim() != 2:
        raise ValueError(f"{op}: dense must be 2-D [rows, cols]; got {describe(dense)}")


def check_sparse_weight(op: str, sparse: Any, weight: torch.Tensor) -> None:
    """``weight`` [n_in, n_out] of a sparse x dense product whose sparse operand (ELL, CSR, BlockELL) is
    [M, n_in]."""
    check_float(op, "weight", weight)
    if weight.dim() != 2 or weight.shape[0] != sparse.n_cols:
        raise ValueError(
            f"{op}: weight must be [{sparse.n_cols}, n_out] for a sparse matrix of shape "
            f"{list(sparse.shape)}; got {describe(weight)}"
        )
    check_same_device(op, values=sparse.values, weight=weight)


def check_overflow_completion(op: str, sparse: Any, is_ell: bool, dense: torch.Tensor | None, encoder: Any) -> None:
    """``sparse_matmul``'s ways of completing overflowed ELL rows: at most one of ``dense`` (the rows' dense form,
    [M, n_in]) and ``encoder`` (a thresholded linear layer with one input row per sparse row), for an ELL only."""
    if dense is not None and encoder is not None:
        raise ValueError(f"{op}: pass dense or encoder, not both")
    if encoder is not None and (not is_ell or encoder.x.shape[0] != sparse.shape[0]):
        raise ValueError(f"{op}: encoder completes overflowed ELL rows and needs one input row per sparse row")
    if dense is not None:
        if not is_ell:
            raise ValueError(f"{op}: dense is only used to complete overflowed ELL rows; a CSR is always complete")
        if dense.shape != sparse.shape:
            raise ValueError(f"{op}: dense must have shape {list(sparse.shape)}; got {describe(dense)}")


def check_matmul_skip_zeros(op: str, a: torch.Tensor, weight: torch.Tensor, splits: object) -> None:
    """``a`` [M, n_in] and ``weight`` [n_in, n_out] float on one device; ``splits`` a positive int or None."""
    check_float(op, "a", a)
    check_float(op, "weight", weight)
    check_same_device(op, a=a, weight=weight)
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[0]:
        raise ValueError(
            f"{op}: expected a [M, n_in] and weight [n_in, n_out]; got a {describe(a)}, weight {describe(weight)}"
        )
    if splits is not None and (not isinstance(splits, int) or isinstance(splits, bool) or splits < 1):
        raise ValueError(f"{op}: splits must be a positive int or None; got {splits!r}")


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
    check_same_device(op, x=x)
    alpha, scale, input_scale = (
        check_scalar(op, n, v) for n, v in (("alpha", alpha), ("scale", scale), ("input_scale", input_scale))
    )
    if alpha == 0.0:
        raise ValueError(f"{op}: alpha must be non-zero (CELU divides by alpha); got alpha=0 for x with {describe(x)}")
    return alpha, scale, input_scale


# --- SAE (decode, JumpReLU and TopK encodes) --------------------------------------------------------------------

SAE_MATMUL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the encodes' tl.dot operand dtypes


def check_positive_int(op: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{op}: {name} must be a positive int; got {value!r}")


def check_optional_count(op: str, name: str, value: object) -> None:
    """None, or a non-negative int (a capacity or a number of rows)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{op}: {name} must be a non-negative int or None; got {value!r}")


def check_sparse_decode(
    op: str,
    feature_acts: torch.Tensor,
    W_dec: torch.Tensor,
    method: str,
    methods: tuple[str, ...],
    max_l0: int | None,
    expected_l0: float | None,
) -> None:
    """feature_acts [..., d_sae] and W_dec [d_sae, d_model], float, one device; method one of ``methods``;
    max_l0 None or a positive int; expected_l0 None or a non-negative number."""
    check_float(op, "feature_acts", feature_acts)
    check_float(op, "W_dec", W_dec)
    check_same_device(op, feature_acts=feature_acts, W_dec=W_dec)
    check_matmul_dtypes(op, ("feature_acts", "W_dec"), feature_acts, W_dec)
    if W_dec.dim() != 2 or feature_acts.dim() < 1 or feature_acts.shape[-1] != W_dec.shape[0]:
        raise ValueError(
            f"{op}: feature_acts [..., d_sae] and W_dec [d_sae, d_model] disagree on d_sae: "
            f"feature_acts {describe(feature_acts)}, W_dec {describe(W_dec)}"
        )
    if method not in methods:
        raise ValueError(f"{op}: method must be one of {', '.join(methods)}; got {method!r}")
    if max_l0 is not None:
        check_positive_int(op, "max_l0", max_l0)
    if expected_l0 is not None and (
        isinstance(expected_l0, bool) or not isinstance(expected_l0, (int, float)) or not expected_l0 >= 0
    ):
        raise ValueError(f"{op}: expected_l0 must be a non-negative number; got {expected_l0!r}")


def check_matmul_dtypes(op: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> None:
    """Torch's rule for ``a @ b``: one floating dtype (outside autocast; the caller casts under it)."""
    if a.dtype != b.dtype:
        raise TypeError(
            f"{op}: {names[0]} and {names[1]} must have the same dtype, as for {names[0]} @ {names[1]} in torch "
            f"(or run under torch.autocast); got {names[0]} {describe(a)}, {names[1]} {describe(b)}"
        )


def check_out(
    op: str,
    out: torch.Tensor,
    shape: tuple[int, ...],
    device: torch.device,
    out_dtype: torch.dtype | None,
    *,
    contiguous: bool,
    transposed: bool = False,
) -> None:
    """A product's ``out=`` tensor: float, of ``shape``, on ``device``, in ``out_dtype`` when one is given, and
    contiguous (``contiguous``) or at unit last stride; with ``transposed`` (a 2-D ``out``) also the transpose of a
    contiguous tensor. ``ValueError`` naming what it is otherwise."""
    layout_ok = out.is_contiguous() if contiguous else out.stride(-1) == 1
    if transposed and not layout_ok and out.dim() == 2:
        layout_ok = out.t().is_contiguous()
    if (
        tuple(out.shape) != tuple(shape)
        or not layout_ok
        or out.device != device
        or not out.is_floating_point()
        or out_dtype not in (None, out.dtype)
    ):
        layout = "contiguous" if contiguous else "with unit last stride"
        layout += " (or the transpose of a contiguous one)" if transposed else ""
        dtype = f" in {str(out_dtype).removeprefix('torch.')} (out_dtype)" if out_dtype is not None else ""
        raise ValueError(
            f"{op}: out must be a float {list(shape)} tensor {layout} on {device}{dtype}; got {describe(out)}"
        )


def autocast_off(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast switched off on ``t``'s device for the block's duration (where it is on): for a step whose operands
    :func:`autocast_operands` already cast, which must run in their dtype as it would inside an op."""
    device_type = t.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_operands(*tensors: object) -> tuple:
    """Under ``torch.autocast`` for the first tensor's device, the floating tensors in the autocast dtype (as
    torch.matmul and F.linear take them); anything else (None, integers, a non-tensor the checks will name) and
    everything outside autocast as given."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    kind = first.device.type if first is not None else "cpu"
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):  # (meta etc.: the device check says so)
        return tensors
    cast = torch.get_autocast_dtype(kind)
    return tuple(t.to(cast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def check_topk_decode(op: str, top_indices: torch.Tensor, top_acts: torch.Tensor, W_dec: torch.Tensor) -> None:
    """top_indices int32/int64 and top_acts float, both [..., k]; W_dec [d_sae, d_model] float; one device. (The
    range of the indices is checked by the caller: it costs a host sync.)"""
    check_float(op, "top_acts", top_acts)
    check_float(op, "W_dec", W_dec)
    if top_indices.dtype not in (torch.int32, torch.int64) or top_indices.shape != top_acts.shape:
        raise TypeError(
            f"{op}: top_indices must be int32/int64 with top_acts' shape {list(top_acts.shape)}; got "
            f"{describe(top_indices)}"
        )
    check_same_device(op, top_acts=top_acts, top_indices=top_indices, W_dec=W_dec)
    check_matmul_dtypes(op, ("top_acts", "W_dec"), top_acts, W_dec)


def check_index_range(op: str, top_indices: torch.Tensor, d_sae: int) -> None:
    """ValueError unless every id lies in [0, d_sae): one host sync."""
    if top_indices.numel() and (int(top_indices.min()) < 0 or int(top_indices.max()) >= d_sae):
        raise ValueError(
            f"{op}: top_indices must lie in [0, {d_sae}); got range [{int(top_indices.min())}, "
            f"{int(top_indices.max())}]"
        )


def check_jumprelu_encode(
    op: str,
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    threshold: torch.Tensor,
    b_dec: torch.Tensor | None,
    max_l0: object,
) -> None:
    """x [..., d_in], W_enc [d_in, d_sae], b_enc and threshold [d_sae] (tl.dot dtypes, one device); b_dec None or
    a floating [d_in]; max_l0 a positive int."""
    for name, t in (("x", x), ("W_enc", W_enc), ("b_enc", b_enc), ("threshold", threshold)):
        check_float(op, name, t, SAE_MATMUL_DTYPES)
    check_same_device(op, x=x, W_enc=W_enc, b_enc=b_enc, threshold=threshold)
    d_in, d_sae = W_enc.shape if W_enc.dim() == 2 else (-1, -1)
    if W_enc.dim() != 2 or x.shape[-1] != d_in or b_enc.shape != (d_sae,) or threshold.shape != (d_sae,):
        raise ValueError(
            f"{op}: expected x [..., d_in], W_enc [d_in, d_sae], b_enc and threshold [d_sae]; got x "
            f"{describe(x)}, W_enc {describe(W_enc)}, b_enc {describe(b_enc)}, threshold "
            f"{describe(threshold)}"
        )
    if b_dec is not None and (b_dec.shape != (d_in,) or not b_dec.is_floating_point()):
        raise ValueError(f"{op}: b_dec must be a floating [{d_in}] tensor; got {describe(b_dec)}")
    check_positive_int(op, "max_l0", max_l0)


def check_jumprelu_decoder(op: str, W_enc: torch.Tensor, W_dec: torch.Tensor, b_dec: torch.Tensor) -> None:
    """W_dec [d_sae, d_model] and b_dec [d_model] (float, on W_enc's device) of a JumpReLU SAE with encoder W_enc
    [d_in, d_sae]."""
    check_float(op, "W_dec", W_dec)
    check_float(op, "b_dec", b_dec)
    check_same_device(op, W_enc=W_enc, W_dec=W_dec, b_dec=b_dec)
    if W_dec.dim() != 2 or W_dec.shape[0] != W_enc.shape[1] or b_dec.shape != (W_dec.shape[1],):
        raise ValueError(
            f"{op}: expected W_dec [d_sae={W_enc.shape[1]}, d_model] and b_dec [d_model]; got W_dec "
            f"{describe(W_dec)}, b_dec {describe(b_dec)}"
        )


def check_topk_encode(
    op: str,
    x: torch.Tensor,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    k: object,
    b_dec: torch.Tensor | None,
    activation: str,
    activations: tuple[str, ...],
    feature_scale: torch.Tensor | None,
) -> None:
    """x [..., d_in], W_enc [d_in, d_sae], b_enc [d_sae] (tl.dot dtypes, one device); k in [1, d_sae]; activation
    one of ``activations``; b_dec [d_in] and feature_scale [d_sae] optional, feature_scale not requiring grad."""
    for name, t in (("x", x), ("W_enc", W_enc), ("b_enc", b_enc)):
        check_float(op, name, t, SAE_MATMUL_DTYPES)
    check_same_device(op, x=x, W_enc=W_enc, b_enc=b_enc)
    d_in, d_sae = W_enc.shape if W_enc.dim() == 2 else (-1, -1)
    if W_enc.dim() != 2 or x.dim() < 1 or x.shape[-1] != d_in or b_enc.shape != (d_sae,):
        raise ValueError(
            f"{op}: expected x [..., d_in], W_enc [d_in, d_sae] and b_enc [d_sae]; got x {describe(x)}, "
            f"W_enc {describe(W_enc)}, b_enc {describe(b_enc)}"
        )
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= d_sae:
        raise ValueError(f"{op}: k must be an int in [1, d_sae={d_sae}]; got {k!r}")
    if activation not in activations:
        raise ValueError(f"{op}: activation must be one of {', '.join(activations)}; got {activation!r}")
    for name, t, size in (("b_dec", b_dec, d_in), ("feature_scale", feature_scale, d_sae)):
        if t is not None:
            check_float(op, name, t, SAE_MATMUL_DTYPES)
            check_same_device(op, x=x, **{name: t})
            if t.shape != (size,):
                raise ValueError(f"{op}: {name} must have shape [{size}]; got {describe(t)}")
    if feature_scale is not None and feature_scale.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: feature_scale is not differentiated; pass feature_scale.detach()")


# --- SPLADE head --------------------------------------------------------------------------------------------------

SPLADE_POOLINGS = ("max", "sum")
SPLADE_DTYPES = FLOAT_DTYPES  # hidden and weight; the bias may also be float64


def check_splade_args(
    op: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    pooling: str,
) -> None:
    """hidden [B, S, H] and weight [V, H] of one float dtype, bias [V] or None, attention_mask [B, S] (bool, integer
    or floating) or None, all on one device; pooling one of :data:`SPLADE_POOLINGS`."""
    check_float(op, "hidden", hidden, SPLADE_DTYPES)
    check_float(op, "weight", weight, SPLADE_DTYPES)
    if hidden.dim() != 3:
        raise ValueError(f"{op}: hidden must be [batch, seq_len, hidden_size]; got {describe(hidden)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"{op}: weight must be [vocab_size, hidden_size={hidden.shape[2]}] (the MLM decoder's "
            f"weight) for hidden of {describe(hidden)}; got weight with {describe(weight)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"{op}: hidden and weight must have the same dtype (as for hidden @ weight.T); got hidden "
            f"{describe(hidden)} and weight {describe(weight)}"
        )
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
            raise ValueError(
                f"{op}: attention_mask must be [batch, seq_len] = {list(hidden.shape[:2])} to match "
                f"hidden of {describe(hidden)}; got {describe(attention_mask)}"
            )
        tensors["attention_mask"] = attention_mask
    check_same_device(op, **tensors)
    if pooling not in SPLADE_POOLINGS:
        raise ValueError(f"{op}: pooling must be one of {SPLADE_POOLINGS}; got {pooling!r}")


# --- FFN (TwELL inference, training) ------------------------------------------------------------------------------


def check_ffn_x(
    op: str, x: object, K: int | None = None, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> torch.Tensor:
    """x [..., K] of a float dtype."""
    check_tensor(op, "x", x)
    check_float(op, "x", x, dtypes)
    if x.dim() < 1 or (K is not None and x.shape[-1] != K):
        raise ValueError(f"{op}: x must be [..., hidden_size={K}]; got {describe(x)}")
    return x


def check_ffn_weight(
    op: str,
    name: str,
    w: object,
    shape: tuple[int, int],
    x: torch.Tensor,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> torch.Tensor:
    """A weight of exactly ``shape`` (nn.Linear layout [out, in]) in x's dtype."""
    check_tensor(op, name, w)
    check_float(op, name, w, dtypes)
    if w.dtype != x.dtype:
        raise TypeError(f"{op}: {name} must have x's dtype {str(x.dtype).removeprefix('torch.')}; got {describe(w)}")
    if tuple(w.shape) != shape:
        raise ValueError(
            f"{op}: {name} must have shape {list(shape)} (nn.Linear layout [out, in]) for x "
            f"{describe(x)}; got {describe(w)}"
        )
    return w


def check_ffn_bias(
    op: str, name: str, b: object, n: int, x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> None:
    """A bias [n] in x's dtype."""
    check_tensor(op, name, b)
    check_float(op, name, b, dtypes)
    if b.dtype != x.dtype or tuple(b.shape) != (n,):
        raise ValueError(
            f"{op}: {name} must be a [{n}] tensor of x's dtype {str(x.dtype).removeprefix('torch.')}; got {describe(b)}"
        )


def check_ffn_geometry(op: str, tile: object, compression: object) -> None:
    """An explicit TwELL tile and compression, or the compression alone when the tile is left to the op."""
    if tile is not None:
        check_twell_geometry(op, tile, compression)
    else:
        check_ffn_compression(op, compression)


def check_ffn_compression(op: str, compression: object) -> None:
    """The compression when the tile is left to the op: it must divide every tile the op may choose."""
    if (
        not isinstance(compression, int)
        or isinstance(compression, bool)
        or compression <= 0
        or compression & (compression - 1)
        or compression > 1024
    ):
        raise ValueError(
            f"{op}: compression must be a power of two in [1, 1024] (it must divide the power-of-two "
            f"tile); got {compression!r}"
        )


def check_ffn_expected_nnz(op: str, expected_nnz: object) -> None:
    if expected_nnz is not None and (
        isinstance(expected_nnz, bool) or not isinstance(expected_nnz, (int, float)) or not expected_nnz >= 0
    ):
        raise ValueError(f"{op}: expected_nnz must be a non-negative number; got {expected_nnz!r}")


def check_ffn_activation(
    op: str, activation: object, threshold: object, activations: tuple[str, ...] = ("relu", "fatrelu", "drelu")
) -> float:
    """A gated block's gate activation (one of ``activations``) and its firing threshold: a finite number >= 0,
    non-zero only for ``"fatrelu"``. Returns the threshold as a float."""
    if not isinstance(activation, str):
        raise TypeError(f"{op}: activation must be a str ({', '.join(map(repr, activations))}); got {activation!r}")
    if activation not in activations:
        raise ValueError(f"{op}: activation must be one of {', '.join(map(repr, activations))}; got {activation!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"{op}: threshold must be a Python float, got {type(threshold).__name__}")
    # one chained comparison (NaN fails it): a threshold torch.compile made dynamic is guarded on, not a graph break
    if not 0 <= threshold < math.inf:
        raise ValueError(f"{op}: threshold must be a finite number >= 0; got {threshold!r}")
    if threshold != 0 and activation != "fatrelu":
        raise ValueError(
            f"{op}: threshold={threshold!r} applies to activation='fatrelu' only; got activation={activation!r}"
        )
    return float(threshold)


def check_ffn_mlp(
    op: str,
    x: object,
    w_gate: object,
    b_gate: object,
    w_up: object,
    b_up: object,
    w_down: object,
    b_down: object,
    gate_names: tuple[str, str] = ("w_gate", "b_gate"),
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> None:
    """A feed-forward block's arguments: x [..., K]; w_gate, w_up [N, K]; w_down [K, N]; biases [N], [N], [K];
    one dtype (of ``dtypes``) and device. ``gate_names``: what the activation weight and bias are called in
    messages (w_up/b_up for the non-gated block, which passes ``w_up=None``)."""
    w_name, b_name = gate_names
    check_tensor(op, w_name, w_gate)
    if w_gate.dim() != 2:
        raise ValueError(
            f"{op}: {w_name} must be [intermediate_size, hidden_size] (nn.Linear layout); got {describe(w_gate)}"
        )
    N, K = w_gate.shape
    check_ffn_x(op, x, K, dtypes)
    check_ffn_weight(op, w_name, w_gate, (N, K), x, dtypes)
    if w_up is not None:
        check_ffn_weight(op, "w_up", w_up, (N, K), x, dtypes)
    check_ffn_weight(op, "w_down", w_down, (K, N), x, dtypes)
    biases = {}
    for name, b, n in ((b_name, b_gate, N), ("b_up", b_up, N), ("b_down", b_down, K)):
        if b is not None:
            check_ffn_bias(op, name, b, n, x, dtypes)
            biases[name] = b
    others = {w_name: w_gate, "w_down": w_down, **({"w_up": w_up} if w_up is not None else {}), **biases}
    check_same_device(op, x=x, **others)
