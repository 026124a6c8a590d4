"""The lab: benchmarks that probe how sparsefuse's results come about rather than state them, run from the
repository root and never installed. ``python -m benchmarks.lab bench|check ...`` is sparsefuse's own command line
(``python -m sparsefuse``) with the lab's workloads registered and its knobs applied:

* :mod:`.ffn_products`  the ``ffn_products`` workload: the block training step product by product against its floor
* :mod:`.train_knobs`   environment knobs of ``bench train``'s distributed mode (FSDP2 units, FFN replay, the
                        backward's thread, CPU pinning, steps per timed call), for ``torchrun -m benchmarks.lab``

The lab imports sparsefuse; nothing in sparsefuse imports the lab. This module imports nothing, so that
``__main__`` can choose Triton's interpreter before sparsefuse is imported.
"""
