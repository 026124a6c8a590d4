"""Fused activations: Snake1d (:mod:`.snake`) and CELU (:mod:`.celu`).

Each module holds, top to bottom: the plain-torch reference, the Triton kernels, the launchers, the torch.library
ops (fake + autograd) and the functional API that :mod:`sparsefuse` re-exports. The functions are deliberately not
re-exported here, so ``sparsefuse.activations.snake`` stays the module.
"""
