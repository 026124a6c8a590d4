"""Benchmarks and correctness checks behind ``python -m sparsefuse bench|check``.

* :mod:`.harness`   generic timing (CUDA-graph replay over rotated inputs), ceilings, the workload registry
* :mod:`.workloads` one module per family of workloads; each registers ``name -> function(Options) -> list[Case]``
* :mod:`.report`    printed table, CSV / markdown / PNG output
* :mod:`.check`     every op against its float64 reference

Adding a workload: create ``sparsefuse/bench/workloads/<family>.py`` with a function decorated by
``@register("<name>")`` that returns :class:`Case` objects; it is picked up automatically.
"""

from .harness import WORKLOADS, Case, Ceilings, Options, Result, register, resolve_workloads

__all__ = ["WORKLOADS", "Case", "Ceilings", "Options", "Result", "register", "resolve_workloads"]
