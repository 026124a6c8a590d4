"""Normalisation layers fused into one kernel each way: :mod:`.rmsnorm`."""

from .rmsnorm import rms_norm

__all__ = ["rms_norm"]
