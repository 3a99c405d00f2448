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

from .attention import AttentionSpec
from .attention_cpu import row_macro

THREADS = 64


def attention_generic_cuda_primfunc(spec: AttentionSpec, reason: str) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(q, k, v, [bias,] out)``, scheduled for CUDA; ``reason`` says why the flash
    kernel was not used (stored as ``tvmfuse.fallback``)."""
    B, Sq, Skv, Hq, Hkv, D = (spec.batch, spec.q_len, spec.kv_len, spec.q_heads, spec.kv_heads,
                              spec.head_dim)
    dt, odt = spec.dtype, spec.result_dtype
    has_bias = spec.bias_shape is not None
    bias_shape = spec.bias_shape if has_bias else (1, 1, 1, 1)
    bdt = spec.bias_dtype or dt
    row = row_macro(spec, scope="local")
    blocks = (Sq + THREADS - 1) // THREADS

    @T.macro
    def body(q, k, v, bias, out):
        for bh in T.thread_binding(B * Hq, thread="blockIdx.y"):
            for bx in T.thread_binding(blocks, thread="blockIdx.x"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    if bx * THREADS + tx < Sq:
                        row(q, k, v, bias, out, bh, bx * THREADS + tx)

    if has_bias:

        @T.prim_func(s_tir=True)
        def attention_generic(q: T.Buffer((B, Sq, Hq, D), dt), k: T.Buffer((B, Skv, Hkv, D), dt),
                              v: T.Buffer((B, Skv, Hkv, D), dt), bias: T.Buffer(bias_shape, bdt),
                              out: T.Buffer((B, Sq, Hq, D), odt)):
            T.func_attr({"tir.noalias": True, "tir.is_scheduled": True})
            body(q, k, v, bias, out)

    else:

        @T.prim_func(s_tir=True)
        def attention_generic(q: T.Buffer((B, Sq, Hq, D), dt), k: T.Buffer((B, Skv, Hkv, D), dt),
                              v: T.Buffer((B, Skv, Hkv, D), dt), out: T.Buffer((B, Sq, Hq, D), odt)):
            T.func_attr({"tir.noalias": True, "tir.is_scheduled": True})
            body(q, k, v, q, out)

    return attention_generic.with_attr("tvmfuse.fallback", reason)
