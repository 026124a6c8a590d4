"""Fused activations: Snake1d (:mod:`.snake`) and CELU (:mod:`.celu`).

Each is a package with fixed roles: ``reference.py`` (plain-torch ground truth), ``kernels.py`` (Triton kernels),
``launch.py`` (launchers), ``op.py`` (torch.library ops, fakes, autograd) and ``functional.py`` (the public function
that :mod:`sparsefuse` re-exports). The functions are deliberately not re-exported here, so
``sparsefuse.activations.snake`` stays the package.
"""
