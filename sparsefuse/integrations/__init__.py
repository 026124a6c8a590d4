"""Patches for the model libraries users run. Each submodule imports its library lazily (or not at all)."""
