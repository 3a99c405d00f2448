"""Schedule rules for fused kernels, tried in order per PrimFunc (dlight style).

A rule returns ``None`` when a function is not its kind; the first rule that returns a schedule
wins. Later issues add tensor-core GEMM, flash attention and memory-bound rules in front of
TVM's generic ones.
"""

from __future__ import annotations


def gpu_rules() -> list:
    """Rules for CUDA targets, most specific first."""
    from tvm.s_tir import dlight as dl

    return [
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]
