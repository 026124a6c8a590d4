"""Run SAELens JumpReLU and TopK SAEs on sparsefuse's sparse kernels.

    from sae_lens import SAE
    import sparsefuse.integrations.sae_lens as sf_sae_lens
    sae = SAE.from_pretrained("gemma-scope-2b-pt-res-canonical", "layer_12/width_65k/canonical", device="cuda")
    sf_sae_lens.patch(sae)              # in place; returns sae
    with torch.no_grad():
        recon = sae(x)                  # fused: the dense [tokens, d_sae] activations never exist
        acts = sae.encode(x)            # still the dense activations SAELens returns
    sf_sae_lens.unpatch(sae)            # back to SAELens' own methods

What ``patch`` changes (instance attributes: the class, parameters and ``state_dict`` are untouched):

* ``forward``, when no gradient is needed (``torch.no_grad()``, ``torch.inference_mode()`` or parameters with
  ``requires_grad=False``), no hook is attached to ``hook_sae_acts_pre``/``hook_sae_acts_post`` and
  ``use_error_term`` is off, runs the fused path:
  JumpReLU, by default -- the encode matmul on cuBLAS, JumpReLU applied in place, then
  :func:`sparsefuse.sae.sparse_decode` (auto: at large batches the bitmask + ELL path). The fastest at large
  batches (H200, Gemma 2B 65k, 4096 tokens, bf16: 1.76x SAELens' own forward), but the dense [tokens, d_sae]
  activations exist for a moment.
  JumpReLU with ``fused_encode=True`` (the default when ``max_l0`` is given) -- :func:`sparsefuse.sae.jumprelu_encode`
  writes the fired features straight into ELL (width ``max_l0``) and :func:`sparsefuse.sparse.sparse_matmul`
  gathers only their decoder rows (both JumpReLU paths are :func:`sparsefuse.sae.jumprelu_sae_forward`); a token
  that fired more than ``max_l0`` features is recomputed on the device from the encoder inputs, never truncated.
  The dense activations never exist (46 MB peak instead of 2.2 GB in the case above) at 1.51x SAELens' forward; the
  epilogue matmul runs at about half cuBLAS's rate, so it trails the default.
  TopK, by default -- SAELens' encode matmul and ``torch.topk`` (the same selection as SAELens), then
  :func:`sparsefuse.sae.topk_decode` gathers only the k decoder rows per token instead of SAELens' scatter into a
  dense [tokens, d_sae] tensor and dense decode. TopK with ``fused_encode=True`` -- :func:`sparsefuse.sae.topk_encode`
  selects inside the encode matmul's epilogue (no dense pre-activations: 40 MB peak instead of 1.1 GB at 4096
  tokens) but today is 0.43-0.56x SAELens' forward at 4096 tokens.
  ``hook_sae_input``, ``hook_sae_recons`` and ``hook_sae_output`` are called as usual; the two activation hooks are
  skipped because the activations are never materialised -- attach a hook to either and ``forward`` takes the
  unfused path below instead, so hooks always see what SAELens would give them. Otherwise ``forward`` is SAELens'
  own (calling the patched ``encode``/``decode``).
* ``encode``: SAELens' dense encode (its result is the dense activations anyway), except TopK with
  ``fused_encode=True``: ``topk_encode``, its k values scattered into the dense result, skipping the dense
  pre-activations and ``torch.topk`` over them (SAELens' own encode when gradients are needed or
  ``hook_sae_acts_pre`` has a hook).
* ``decode``: :func:`sparsefuse.sae.sparse_decode` (differentiable) instead of the dense ``feature_acts @ W_dec``.

Everything SAELens does around the product is kept by calling the SAE's own pieces: the cast to the SAE dtype,
``reshape_activations="hook_z"``, run-time ``normalize_activations`` (``constant_norm_rescale``, ``layer_norm``),
``apply_b_dec_to_input`` and TopK's ``rescale_acts_by_decoder_norm``. float64 SAEs (no float64 kernels) run
SAELens' code unchanged.

Numerics: the fused paths decide which features fire (JumpReLU: ``pre > threshold``) or are selected (TopK) on the
float32 pre-activation; SAELens decides on the pre-activation rounded to the SAE dtype. In bfloat16/float16 the two
can differ for a feature whose pre-activation lies within that rounding of its threshold (or, for TopK, of the k-th
value) -- ours is the decision on the more precise value.

Supported: ``sae_lens >= 6`` ``JumpReLUSAE`` and ``TopKSAE`` (and subclasses that keep their encode, decode,
forward and activation). Anything else -- other architectures, training SAEs, transcoders, ``AbsTopKSAE`` --
raises ``ValueError``.

Lifecycle: ``copy.deepcopy`` gives a patched SAE whose methods are bound to the copy. ``torch.save``/``torch.load``
keep the patch too, but a sae_lens 6 SAE holds lambdas (its reshape and normalisation functions) that pickle
refuses, patched or not: save with SAELens' ``save_model``, load with ``load_from_disk`` (unpatched) and patch again.
Patching twice keeps the SAE patched, with the last call's settings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ..sae import jumprelu_sae_forward, sparse_decode, topk_decode, topk_encode

__all__ = ["patch", "unpatch", "is_patched"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PATCHED_METHODS = ("forward", "encode", "decode")
_ATTR = "_sparsefuse_patch"


@dataclasses.dataclass(frozen=True)
class _Patch:
    architecture: str  # "jumprelu" or "topk"
    max_l0: int  # ELL width of the fused JumpReLU encode and of sparse_decode's fixed-width methods
    decode_method: str  # sparse_decode's method
    fused_encode: bool  # epilogue-compacting encode (memory) or cuBLAS encode (speed)


def _sae_lens_classes() -> dict[str, Any]:
    try:
        import sae_lens
        from sae_lens.saes.jumprelu_sae import JumpReLUSAE
        from sae_lens.saes.sae import SAE
        from sae_lens.saes.topk_sae import TopK, TopKSAE
    except ImportError as exc:
        raise ImportError(
            "sparsefuse.integrations.sae_lens needs sae_lens >= 6 (pip install 'sae-lens>=6'); "
            f"importing it failed: {exc}"
        ) from exc
    return dict(
        version=getattr(sae_lens, "__version__", "?"), SAE=SAE, JumpReLUSAE=JumpReLUSAE, TopKSAE=TopKSAE, TopK=TopK
    )


def _architecture(sae: nn.Module) -> str:
    """ "jumprelu" or "topk" when the SAE computes exactly what SAELens' JumpReLUSAE / TopKSAE compute; else raises."""
    c = _sae_lens_classes()
    if not isinstance(sae, c["SAE"]):
        raise TypeError(f"sparsefuse.integrations.sae_lens.patch: expected a sae_lens SAE, got {type(sae).__name__}")
    cls, act = type(sae), getattr(sae, "activation_fn", None)
    keeps = lambda base: all(getattr(cls, m) is getattr(base, m) for m in ("encode", "decode"))  # noqa: E731
    if isinstance(sae, c["JumpReLUSAE"]) and keeps(c["JumpReLUSAE"]) and type(act) is nn.ReLU:
        architecture = "jumprelu"
    elif isinstance(sae, c["TopKSAE"]) and keeps(c["TopKSAE"]) and type(act) is c["TopK"]:
        if act.use_sparse_activations:
            raise ValueError(
                "sparsefuse.integrations.sae_lens.patch: TopK with use_sparse_activations=True "
                "(sparse COO activations) is not supported"
            )
        architecture = "topk"
    else:
        arch = getattr(getattr(sae, "cfg", None), "architecture", lambda: "?")
        raise ValueError(
            f"sparsefuse.integrations.sae_lens.patch supports SAELens JumpReLUSAE and TopKSAE (inference SAEs with "
            f"their own encode, decode and activation); got {cls.__name__} (architecture {arch()!r}, activation "
            f"{type(act).__name__}, sae_lens {c['version']})"
        )
    if cls.forward is not c["SAE"].forward:
        raise ValueError(f"sparsefuse.integrations.sae_lens.patch: {cls.__name__} overrides SAE.forward; not supported")
    return architecture


def patch(
    sae: nn.Module, *, max_l0: int | None = None, decode_method: str = "auto", fused_encode: bool | None = None
) -> nn.Module:
    """Route a SAELens JumpReLUSAE/TopKSAE through sparsefuse's kernels, in place (see module docstring).

    Args:
        sae: a ``sae_lens`` ``JumpReLUSAE`` or ``TopKSAE``.
        max_l0: JumpReLU fused forward -- fired features stored per token before the overflow path (default 256,
            capped at d_sae; tokens above it are recomputed, never truncated); also passed to ``sparse_decode``.
        decode_method: ``sparse_decode``'s method for ``decode`` and the JumpReLU forward ("auto", "fixed", ...).
        fused_encode: the epilogue-compacting encodes (no dense [tokens, d_sae] tensor in memory) instead of the
            cuBLAS encode (faster). JumpReLU: ``jumprelu_encode`` instead of cuBLAS + in-place JumpReLU, by default
            exactly when ``max_l0`` is given. TopK: ``topk_encode`` for ``forward`` and ``encode`` instead of the
            cuBLAS encode + ``torch.topk``, off by default.
    Returns: ``sae``. Patching an already patched SAE keeps it patched, with this call's settings (the same
    arguments: a no-op).
    """
    architecture = _architecture(sae)
    d_sae = sae.W_dec.shape[0]
    if max_l0 is not None and (not isinstance(max_l0, int) or isinstance(max_l0, bool) or max_l0 <= 0):
        raise ValueError(f"sparsefuse.integrations.sae_lens.patch: max_l0 must be a positive int; got {max_l0!r}")
    width = min(max_l0 if max_l0 is not None else 256, d_sae)
    fused = fused_encode if fused_encode is not None else (architecture == "jumprelu" and max_l0 is not None)
    setattr(sae, _ATTR, _Patch(architecture, width, decode_method, bool(fused)))
    methods = {"jumprelu": (_jumprelu_forward, None, _decode), "topk": (_topk_forward, _topk_encode, _decode)}
    for name, fn in zip(_PATCHED_METHODS, methods[architecture]):
        if fn is not None:
            # A partial, not a bound method: pickle stores a bound method as getattr(instance, its function's
            # name), which the SAE lacks; a partial pickles the function by name and the SAE by reference
            # (deepcopy rebinds it to the copy).
            setattr(sae, name, functools.partial(fn, sae))
    return sae


def unpatch(sae: nn.Module) -> nn.Module:
    """Undo :func:`patch` (SAELens' own methods again). Returns ``sae``."""
    for name in (*_PATCHED_METHODS, _ATTR):
        sae.__dict__.pop(name, None)
    return sae


def is_patched(sae: nn.Module) -> bool:
    return _ATTR in sae.__dict__


# --- when the fused paths apply -----------------------------------------------------------------------------------
def _has_hooks(module: Any) -> bool:
    return isinstance(module, nn.Module) and bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )


def _needs_grad(sae: nn.Module, x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in sae.parameters()))


def _runs_kernels(sae: nn.Module, x: torch.Tensor) -> bool:
    """Whether the sparse encode may replace SAELens' (see module docstring)."""
    return sae.W_enc.dtype in _KERNEL_DTYPES and not _needs_grad(sae, x) and not _has_hooks(sae.hook_sae_acts_pre)


def _sae_input(sae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SAELens' ``process_sae_in`` up to (not including) the b_dec subtraction, which the kernels fuse."""
    sae_in = sae.reshape_fn_in(x.to(sae.dtype))
    return sae.run_time_activation_norm_fn_in(sae.hook_sae_input(sae_in))


def _decode_tail(sae: nn.Module, recon: torch.Tensor) -> torch.Tensor:
    """What SAELens' decode does after ``feature_acts @ W_dec + b_dec``."""
    recon = sae.run_time_activation_norm_fn_out(sae.hook_sae_recons(recon))
    return sae.reshape_fn_out(recon, sae.d_head)


def _input_b_dec(sae: nn.Module) -> torch.Tensor | None:
    return sae.b_dec if sae.cfg.apply_b_dec_to_input else None


def _decoder_scale(sae: nn.Module) -> torch.Tensor | None:
    """TopK ``rescale_acts_by_decoder_norm``: the pre-activations are scaled by the decoder row norms."""
    return sae.W_dec.norm(dim=-1) if getattr(sae.cfg, "rescale_acts_by_decoder_norm", False) else None


# --- patched methods (bound to the SAE instance by patch) ---------------------------------------------------------
def _decode(self: nn.Module, feature_acts: torch.Tensor) -> torch.Tensor:
    settings: _Patch = getattr(self, _ATTR)
    if feature_acts.is_sparse or self.W_dec.dtype not in _KERNEL_DTYPES:
        return type(self).decode(self, feature_acts)
    scale = _decoder_scale(self) if settings.architecture == "topk" else None
    if scale is not None:
        feature_acts = feature_acts * (1 / scale)  # SAELens' act_times_W_dec
    recon = sparse_decode(feature_acts, self.W_dec, method=settings.decode_method, max_l0=settings.max_l0)
    return _decode_tail(self, recon + self.b_dec)


def _topk_encode(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not _runs_kernels(self, x) or not getattr(self, _ATTR).fused_encode:
        return type(self).encode(self, x)
    sae_in = _sae_input(self, x)
    indices, acts = topk_encode(
        sae_in,
        self.W_enc,
        self.b_enc,
        self.activation_fn.k,
        b_dec=_input_b_dec(self),
        feature_scale=_decoder_scale(self),
    )
    dense = acts.new_zeros(*acts.shape[:-1], self.W_enc.shape[1]).scatter_(-1, indices, acts)
    return self.hook_sae_acts_post(dense)


def _fused_forward_applies(sae: nn.Module, x: torch.Tensor) -> bool:
    return _runs_kernels(sae, x) and not _has_hooks(sae.hook_sae_acts_post) and not sae.use_error_term


def _jumprelu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not _fused_forward_applies(self, x):
        return type(self).forward(self, x)
    settings: _Patch = getattr(self, _ATTR)
    sae_in = _sae_input(self, x)
    recon = jumprelu_sae_forward(
        sae_in,
        self.W_enc,
        self.b_enc,
        self.threshold,
        self.W_dec,
        self.b_dec,
        apply_b_dec_to_input=self.cfg.apply_b_dec_to_input,
        max_l0=settings.max_l0,
        fused_encode=settings.fused_encode,
        decode_method=settings.decode_method,
    )
    return self.hook_sae_output(_decode_tail(self, recon))


def _topk_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not _fused_forward_applies(self, x):
        return type(self).forward(self, x)
    sae_in = _sae_input(self, x)
    scale, k, b_dec = _decoder_scale(self), self.activation_fn.k, _input_b_dec(self)
    if getattr(self, _ATTR).fused_encode:
        indices, acts = topk_encode(sae_in, self.W_enc, self.b_enc, k, b_dec=b_dec, feature_scale=scale)
    else:  # SAELens' own ops up to the selection (so it selects exactly what SAELens does), then the sparse decode
        pre = (sae_in - b_dec if b_dec is not None else sae_in) @ self.W_enc + self.b_enc
        values, indices = (pre * scale if scale is not None else pre).topk(k, dim=-1, sorted=False)
        acts = values.relu()
    if scale is not None:
        acts = acts * (1 / scale)[indices]  # SAELens' act_times_W_dec
    recon = topk_decode(indices, acts, self.W_dec, check_indices=False) + self.b_dec
    return self.hook_sae_output(_decode_tail(self, recon))
