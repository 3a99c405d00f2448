"""Relax → Relax passes, one pattern per file. Each is a named module pass."""

from .horizontal_gemm import HorizontalGemm
from .mixed_precision import MixedPrecision
from .norm_gemm import NormGemmPrologue
from .norm_patterns import FuseDecomposedNorms
from .simplify import SimplifyNoOps
from .sink_reshape import SinkReshape

__all__ = ["FuseDecomposedNorms", "HorizontalGemm", "MixedPrecision", "NormGemmPrologue", "SimplifyNoOps",
           "SinkReshape"]
