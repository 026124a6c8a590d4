"""Benchmark workloads. Every module in this package is imported here and registers its workloads with
:func:`sparsefuse.bench.harness.register`; adding a workload is adding a module, nothing else.

Modules must import only torch/sparsefuse at top level: optional dependencies (model libraries) are imported inside
the workload function, which then prints why it is skipped and returns no cases.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
