"""Relax → Relax passes, one pattern per file. Each is a named module pass."""

from .mixed_precision import MixedPrecision

__all__ = ["MixedPrecision"]
