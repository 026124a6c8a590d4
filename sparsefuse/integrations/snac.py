"""Patch SNAC (and DAC) models so every Snake1d runs sparsefuse's fused kernel.

    import snac, sparsefuse.integrations.snac as sf_snac
    model = snac.SNAC.from_pretrained("hubertsiuzdak/snac_24khz").eval().cuda()
    sf_snac.patch(model)          # in place; returns the model

Neither library is imported here: a module counts as a Snake1d when its class is named ``Snake1d`` and it holds
an ``alpha`` parameter of shape [1, C, 1] -- true of ``snac.layers.Snake1d`` and ``dac.nn.layers.Snake1d``. The
replacement shares that very Parameter object, so optimisers, ``state_dict`` keys and tied weights are unchanged.

Lifecycle: the replacements are ordinary modules, so ``copy.deepcopy`` and ``torch.save``/``torch.load`` keep them
(a whole SNAC model cannot go through ``torch.save``, patched or not: torch refuses its weight-norm
parametrizations; save its ``state_dict``, load it into a fresh model and patch that). Patching a patched model is
a no-op.
"""

from __future__ import annotations

from torch import nn

from ..nn import Snake1d

__all__ = ["patch", "is_snake1d", "is_patched"]


def is_snake1d(module: nn.Module) -> bool:
    alpha = getattr(module, "alpha", None)
    return (
        type(module).__name__ == "Snake1d"
        and not isinstance(module, Snake1d)
        and isinstance(alpha, nn.Parameter)
        and alpha.dim() == 3
        and alpha.shape[0] == 1
        and alpha.shape[2] == 1
    )


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` holds sparsefuse Snake1d modules and no SNAC/DAC Snake1d left to replace."""
    modules = list(model.modules())
    return any(isinstance(m, Snake1d) for m in modules) and not any(is_snake1d(m) for m in modules)


def _replacement(module: nn.Module, fast_sin: bool) -> Snake1d:
    alpha = module.alpha
    fused = Snake1d(alpha.shape[1], fast_sin=fast_sin, device="meta")
    fused.alpha = alpha  # share the Parameter itself, not a copy
    fused.train(module.training)
    return fused


def patch(model: nn.Module, *, fast_sin: bool = False) -> nn.Module:
    """Replace every SNAC/DAC ``Snake1d`` inside ``model`` (in place) with :class:`sparsefuse.nn.Snake1d`.

    Returns the model (or, if ``model`` itself is a Snake1d, its replacement). A model already patched (see
    :func:`is_patched`) is returned unchanged, its ``fast_sin`` as first patched. Raises ``ValueError`` if the model
    holds no Snake1d of either kind, which usually means the wrong object was passed."""
    if is_snake1d(model):
        return _replacement(model, fast_sin)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_snake1d(child):
                setattr(parent, name, _replacement(child, fast_sin))
                replaced += 1
    if replaced == 0 and not is_patched(model):
        raise ValueError(f"sparsefuse.integrations.snac.patch: no Snake1d module found in {type(model).__name__}")
    return model
