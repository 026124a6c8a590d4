"""Patch a sentence-transformers ``SparseEncoder`` (a masked-LM ``Transformer``/``MLMTransformer`` followed by
``SpladePooling``) so the vocabulary projection and the pooling run as sparsefuse's fused SPLADE head.

    from sentence_transformers import SparseEncoder
    import sparsefuse.integrations.sentence_transformers as sf_st

    model = SparseEncoder("naver/splade-v3", device="cuda")
    sf_st.patch(model)                 # in place; returns the model
    embeddings = model.encode(texts)   # same vectors; training works too (fused sparse backward)

What changes, for every (masked-LM transformer, ``SpladePooling``) pair found in the model:

* the masked LM's vocabulary projection (``get_output_embeddings()``) passes its input through, so the
  transformer's ``token_embeddings`` feature holds the [B, S, hidden] states entering the projection instead of
  the [B, S, vocab] logits;
* the ``SpladePooling`` module computes ``sentence_embedding`` with :func:`sparsefuse.splade.splade_pool` from
  those states and the projection's weight and bias (read at every call, so ``.to()``, ``.half()`` and tied
  weights keep working).

Both are instance-level ``forward`` overrides: the classes, parameters, state_dict and ``model.save`` output stay
those of sentence-transformers. :func:`unpatch` restores the original behaviour. Lifecycle: ``torch.save``/
``torch.load(weights_only=False)`` and ``copy.deepcopy`` give a patched model (bound to its own masked LM);
``model.save(dir)`` then ``SparseEncoder(dir)`` gives an unpatched one (the patch is not in the saved files: patch
it again); patching a patched model is a no-op. ``SpladePooling.chunk_size``
becomes irrelevant (nothing of size [B, S, vocab] is allocated). Inputs that sentence-transformers flattened for
FlashAttention (``cu_seq_lens_q``) are pooled one sequence at a time. If the projection module was replaced after
patching (e.g. ``resize_token_embeddings``), the transformer produces logits again and the pooling falls back to
the original computation.

Not supported (``patch`` raises ``ValueError``): ``SpladePooling(activation_function="log1p_relu")``.
sentence-transformers itself is not imported here: modules are recognised by class name and attributes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..splade import splade_pool
from .transformers_mlm import bypass_projection, is_bypassed, restore_projection, vocabulary_projection

__all__ = ["patch", "unpatch", "is_splade_pooling", "is_patched"]

_MLM_ATTR = "_sparsefuse_mlm"  # on a patched SpladePooling: the masked LM whose projection it applies


def is_splade_pooling(module: nn.Module) -> bool:
    return type(module).__name__ == "SpladePooling" and hasattr(module, "pooling_strategy")


def _is_patched_pooling(module: nn.Module) -> bool:
    return _MLM_ATTR in module.__dict__


def is_patched(module: nn.Module) -> bool:
    """Whether ``module`` is a patched ``SpladePooling`` or a model (``SparseEncoder``) holding one."""
    return _is_patched_pooling(module) or any(_is_patched_pooling(m) for m in module.children())


def _masked_lm_of(module: nn.Module) -> nn.Module | None:
    """The transformers masked LM inside a sentence-transformers Transformer/MLMTransformer module, if any."""
    for name in ("auto_model", "model"):
        try:
            candidate = getattr(module, name, None)
        except Exception:  # noqa: BLE001  (a property that fails means: not this attribute)
            candidate = None
        if isinstance(candidate, nn.Module) and callable(getattr(candidate, "get_output_embeddings", None)):
            try:
                vocabulary_projection(candidate)
            except TypeError:
                continue
            return candidate
    return None


def _fused_splade_pooling_forward(self: nn.Module, features: dict[str, Any]) -> dict[str, Any]:
    mlm = self.__dict__[_MLM_ATTR]
    decoder = vocabulary_projection(mlm)
    hidden = features["token_embeddings"]
    if not is_bypassed(decoder) or hidden.shape[-1] != decoder.weight.shape[1]:
        # The projection ran (it was replaced after patching): these are logits, pool them as sentence-transformers
        # does.
        return type(self).forward(self, features)
    weight, bias = decoder.weight, getattr(decoder, "bias", None)
    if "cu_seq_lens_q" in features:  # FlashAttention-unpadded inputs: one flat [1, total_tokens, hidden] row
        flat = hidden.squeeze(0)
        bounds = features["cu_seq_lens_q"].tolist()
        pooled = torch.cat(
            [
                splade_pool(flat[start:end].unsqueeze(0), weight, bias, pooling=self.pooling_strategy)
                for start, end in zip(bounds[:-1], bounds[1:])
            ]
        )
    else:
        pooled = splade_pool(hidden, weight, bias, features["attention_mask"], pooling=self.pooling_strategy)
    if self.embedding_dimension is None:
        self.embedding_dimension = pooled.shape[1]
    features["sentence_embedding"] = pooled
    return features


def _patch_pair(transformer: nn.Module, pooling: nn.Module) -> bool:
    mlm = _masked_lm_of(transformer)
    if mlm is None:
        return False
    activation = getattr(pooling, "activation_function", "relu")
    if activation != "relu":
        raise ValueError(
            f"sparsefuse.integrations.sentence_transformers.patch: SpladePooling(activation_function="
            f"{activation!r}) is not supported by the fused head (only 'relu')"
        )
    if pooling.pooling_strategy not in ("max", "sum"):
        raise ValueError(
            f"sparsefuse.integrations.sentence_transformers.patch: unknown pooling_strategy "
            f"{pooling.pooling_strategy!r}"
        )
    bypass_projection(vocabulary_projection(mlm))
    pooling.__dict__[_MLM_ATTR] = mlm  # plain attribute: not registered as a submodule (no state_dict keys)
    # A partial, not a bound method: pickle stores a bound method as getattr(instance, its function's name), which
    # the module lacks; a partial pickles the function by name and the module by reference (deepcopy rebinds it).
    pooling.forward = functools.partial(_fused_splade_pooling_forward, pooling)
    return True


def patch(model: nn.Module) -> nn.Module:
    """Fuse every masked-LM transformer + ``SpladePooling`` pair of a sentence-transformers model (in place; see
    module docstring). Returns the model; a model already patched is returned unchanged. Raises ``ValueError`` if
    no such pair was found or a pooling module uses an unsupported activation."""
    modules = list(model.children())
    patched = 0
    for first, second in zip(modules, modules[1:]):
        if is_splade_pooling(second) and not _is_patched_pooling(second):
            patched += _patch_pair(first, second)
    if patched == 0 and not any(_is_patched_pooling(m) for m in modules):
        raise ValueError(
            f"sparsefuse.integrations.sentence_transformers.patch: no masked-LM transformer followed by "
            f"SpladePooling found in {type(model).__name__}"
        )
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` (in place); returns the model."""
    for module in model.children():
        if is_splade_pooling(module) and _is_patched_pooling(module):
            mlm = module.__dict__.pop(_MLM_ATTR)
            del module.forward
            restore_projection(vocabulary_projection(mlm))
    return model
