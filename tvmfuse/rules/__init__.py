"""Schedule rules for fused kernels, tried in order per PrimFunc (dlight style).

A rule returns ``None`` when a function is not its kind; the first rule that returns a schedule
wins. Order: :class:`GemmSimtRowStats` (only the fp32 GEMMs that ``gemm_row_stats_simt`` gave
their norm statistics), :class:`Gemv` (M ≤ 64 with an (N, K) weight: the weight-streaming
kernel; the ``gemv`` pipeline stage already took the decode GEMMs it could),
:class:`GemmSM80` (tensor-core GEMM + epilogue for sm_80 and newer; the GEMMs it
does not take it hands to dlight's GEMV / Matmul itself, marked ``"tvmfuse.fallback"``), then
dlight's Matmul (:class:`Matmul`: given an arch it reads as tensor-core capable) and GEMV
(:class:`GuardedGEMV`: dlight's, with reductions of ≤ 64 elements on its
Fallback; they only take GEMM / GEMV shapes), then tvmfuse's
memory-bound rules (:class:`RowNorm` for LayerNorm / RMSNorm / softmax rows, :class:`RowStats` for
per-row statistics (NormGemmPrologue's mean / rstd kernels), :class:`Elementwise`
for purely spatial functions; all three mark the PrimFunc with ``"tvmfuse.rule"``), then dlight's
generic Reduction, GeneralReduction and Fallback for everything else; last,
:class:`SingleThread` puts what none of them takes (sequential ``te.extern`` kernels) on one GPU
thread, since an unbound kernel would be compiled for the host.
"""

from __future__ import annotations

from tvm.s_tir import dlight as dl

from ..attrs import RULE_ATTR
from .elementwise import Elementwise
from .gemm_simt_stats import GemmSimtRowStats
from .gemm_sm80 import GemmSM80, Matmul
from .gemv import Gemv
from .guarded_gemv import GuardedGEMV
from .row_norm import RowNorm
from .row_stats import RowStats
from .single_thread import SingleThread


def gpu_rules() -> list:
    """Rules for CUDA targets, most specific first."""
    return [
        GemmSimtRowStats(),
        Gemv(),
        GemmSM80(),
        Matmul(),
        GuardedGEMV(),
        RowNorm(),
        RowStats(),
        Elementwise(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
        SingleThread(),
    ]


__all__ = ["RULE_ATTR", "Matmul", "Elementwise", "GemmSM80", "GemmSimtRowStats", "Gemv",
           "GuardedGEMV", "RowNorm", "RowStats", "SingleThread", "gpu_rules"]
