"""Benchmark results (``results/``) and the lab (``lab/``): run from the repository root, never installed."""
