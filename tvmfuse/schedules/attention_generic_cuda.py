"""Any-spec CUDA attention: one thread per query row, online softmax on CUDA cores.

The fallback behind the flash kernels for what they do not take (fp32, head dims other than
64 / 128, scale ≤ 0): the same row body as the cpu kernel (``attention_cpu.row_macro``), with
the rows spread over the GPU::

    blockIdx.y = b·Hq + h,   blockIdx.x · THREADS + threadIdx.x = i   (query row)
    scratch acc[D], s[TK], (m, l) in the thread's local memory

Still one kernel and no Sq×Skv buffer, so the graph keeps its single attention launch; but each
thread re-reads K and V from L2 for its row (no tensor cores, no shared-memory reuse), so it is
a correctness path, reported as a fallback, not a fast one.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from ..attrs import FALLBACK_ATTR
from .attention_cpu import primfunc_around, row_macro
from .attention_spec import AttentionSpec

THREADS = 64


def attention_generic_cuda_primfunc(spec: AttentionSpec, reason: str) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(q, k, v, [bias,] out)``, scheduled for CUDA; ``reason`` says why the flash
    kernel was not used (stored as ``tvmfuse.fallback``)."""
    Sq, rows = spec.q_len, spec.batch * spec.q_heads
    row = row_macro(spec, scope="local")
    blocks = (Sq + THREADS - 1) // THREADS

    @T.macro
    def body(q, k, v, bias, out):
        for bh in T.thread_binding(rows, thread="blockIdx.y"):
            for bx in T.thread_binding(blocks, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    if bx * THREADS + tx < Sq:
                        row(q, k, v, bias, out, bh, bx * THREADS + tx)

    return primfunc_around(spec, body).with_attrs(
        {"tir.is_scheduled": True, FALLBACK_ATTR: reason})
