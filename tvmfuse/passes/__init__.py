"""Relax → Relax passes, one pattern per file. Each is a named module pass."""

from .gather_pattern import InjectiveGather
from .gather_row_stats import GatherRowStats
from .horizontal_gemm import HorizontalGemm
from .mixed_precision import MixedPrecision
from .norm_gemm import NormGemmPrologue
from .norm_patterns import FuseDecomposedNorms
from .pack_attention_inputs import PackAttentionInputs
from .simplify import SimplifyNoOps
from .sink_reshape import RemoveRedundantReshapes, SinkReshape

__all__ = ["FuseDecomposedNorms", "GatherRowStats", "HorizontalGemm", "InjectiveGather", "MixedPrecision",
           "NormGemmPrologue", "PackAttentionInputs", "RemoveRedundantReshapes", "SimplifyNoOps",
           "SinkReshape"]
