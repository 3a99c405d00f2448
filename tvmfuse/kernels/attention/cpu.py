"""CPU attention kernel: tiled online softmax, one query row at a time (llvm target).

For each (b, h, i) the key axis is walked in tiles of ``_KV_TILE`` keys, every tile (causal: keys
right of the diagonal masked) or, with a sliding window, only the tiles from the one holding the
row's first visible key to its diagonal's (:func:`.spec.band_tiles`)::

    s_j   = (scale · q[b,i,h]·k[b,j,g] + bias[b,h,i,j]) · log2 e      j in tile, visible(i, j)
            (soft-capped: c · tanh(scale · q·k / c) in place of scale · q·k)
    m'    = max(m, max_j s_j);   α = 2^(m − m');   l = α·l + Σ_j 2^(s_j − m')
    acc   = α·acc + Σ_j 2^(s_j − m') · v[b,j,g]              (g = h // group; Dv-long)
    out   = acc / l

(indices of the spec's formula; the buffers are read and written in ``qkv_layout`` /
``out_layout`` through :func:`.spec.at`), with ``m``, ``l`` and ``acc`` (Dv floats) in
fp32 scratch local to the row: no Sq×Skv buffer exists. A row that sees no key (BottomRight
with Sq > Skv, or an all −inf bias row) yields 0. The (b, h) loop is parallel. This is the
numerics reference of the cpu target, not a fast kernel.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .spec import AttentionSpec, at, band_tiles, causal_offset

_KV_TILE = 32
_LOG2E = math.log2(math.e)


def bias_strides(spec: AttentionSpec) -> tuple[int, int, int]:
    """(b, h, i) multipliers into the bias buffer: 0 on broadcast axes, 1 otherwise."""
    assert spec.bias_shape is not None
    bb, bh, bi, bj = spec.bias_shape
    if bj != spec.kv_len or bb not in (1, spec.batch) or bh not in (1, spec.q_heads) or bi not in (
        1, spec.q_len
    ):
        raise ValueError(
            f"attention bias shape {spec.bias_shape} does not broadcast to "
            f"(B={spec.batch}, Hq={spec.q_heads}, Sq={spec.q_len}, Skv={spec.kv_len})"
        )
    return int(bb != 1), int(bh != 1), int(bi != 1)


def row_macro(spec: AttentionSpec, scope: str = "global"):
    """The per-query-row body: ``row(q, k, v, bias, out, bh, i)`` for (b·Hq + h, i).

    ``scope`` is where the row's fp32 scratch (``acc[Dv]``, ``s[TK]``, 4 scalars) lives: "global"
    (llvm: the stack) or "local" (CUDA: registers / local memory of the thread).
    """
    Skv, Hq, D, DV = spec.kv_len, spec.q_heads, spec.head_dim, spec.value_dim
    G = spec.group
    odt = spec.result_dtype
    has_bias = spec.bias_shape is not None
    fb, fh, fi = bias_strides(spec) if has_bias else (0, 0, 0)
    off = causal_offset(spec)
    # a non-causal call gets an offset no key index reaches
    cmax = 0 if off is not None else Skv
    off = off or 0
    TK = min(_KV_TILE, Skv)
    n_tiles = (Skv + TK - 1) // TK
    sc = float(spec.score_unit * _LOG2E)  # S·log2e = t·sc, t the raw product or its tanh
    l2e = float(_LOG2E)
    neg_inf = float("-inf")
    cap_in = spec.tanh_scale
    QKV_L, OUT_L = spec.qkv_layout, spec.out_layout  # memory layouts (spec.at)

    def keep(i, j):
        # key j is in range and visible to row i (window: not left of the band)
        conds = [j < Skv, j <= i + off + cmax]
        if spec.window is not None:
            conds.append(j > i + off - spec.window)
        return tirx.all(*conds)

    @T.macro
    def row(q, k, v, bias, out, bh, i):
        with T.sblock("row"):
            T.reads()
            T.writes()
            acc = T.sblock_alloc_buffer((DV,), "float32", scope=scope)
            s = T.sblock_alloc_buffer((TK,), "float32", scope=scope)
            st = T.sblock_alloc_buffer((4,), "float32", scope=scope)  # m, l, m_new, alpha
            b: T.let[T.int32] = bh // Hq
            h: T.let[T.int32] = bh % Hq
            g: T.let[T.int32] = h // G
            st[0] = neg_inf
            st[1] = T.float32(0)
            for d in T.serial(DV):
                acc[d] = T.float32(0)
            if spec.window is None:  # every tile (Python values: nothing emitted)
                t0 = T.meta_var(0)
                n_it = T.meta_var(n_tiles)
            else:  # the band's tiles only
                t0: T.let[T.int32] = band_tiles(spec, i, i, TK)[0]
                n_it = T.meta_var(band_tiles(spec, i, i, TK)[3] - t0)
            for t in T.serial(n_it):
                kt = T.meta_var(t0 + t)  # the KV tile
                st[2] = st[0]
                for jj in T.serial(TK):
                    j: T.let[T.int32] = kt * TK + jj
                    s[jj] = neg_inf
                    if keep(i, j):
                        s[jj] = T.float32(0)
                        for d in T.serial(D):
                            s[jj] += T.Cast("float32", q[at(QKV_L, b, i, h, d)]) * T.Cast(
                                "float32", k[at(QKV_L, b, j, g, d)])
                        if cap_in is not None:  # t = tanh(scale · q·k / c)
                            s[jj] = T.tanh(s[jj] * T.float32(cap_in))
                        s[jj] = s[jj] * sc
                        if has_bias:
                            s[jj] += T.Cast("float32", bias[b * fb, h * fh, i * fi, j]) * l2e
                    st[2] = T.max(st[2], s[jj])
                # alpha = 2^(m - m_new); 0 while nothing was visible (m = -inf)
                st[3] = T.if_then_else(st[0] == neg_inf, T.float32(0),
                                       T.exp2(st[0] - st[2]))
                st[1] = st[1] * st[3]
                for d in T.serial(DV):
                    acc[d] = acc[d] * st[3]
                for jj in T.serial(TK):
                    s[jj] = T.if_then_else(s[jj] == neg_inf, T.float32(0),
                                           T.exp2(s[jj] - st[2]))
                    st[1] = st[1] + s[jj]
                for jj in T.serial(TK):
                    if s[jj] > T.float32(0):
                        for d in T.serial(DV):
                            acc[d] += s[jj] * T.Cast("float32", v[at(QKV_L, b, kt * TK + jj, g, d)])
                st[0] = st[2]
            for d in T.serial(DV):
                out[at(OUT_L, b, i, h, d)] = T.Cast(
                    odt, T.if_then_else(st[1] > T.float32(0), acc[d] / st[1], T.float32(0)))

    return row


def primfunc_around(spec: AttentionSpec, body) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``(q, k, v, [bias,] out)`` of ``spec`` whose body is the macro
    ``body(q, k, v, bias, out)`` (``bias`` is ``q``, unused, when the spec has none)."""
    q_shape, kv_shape, v_shape, out_shape = spec.q_shape, spec.kv_shape, spec.v_shape, spec.out_shape
    dt, odt = spec.dtype, spec.result_dtype
    bias_shape = spec.bias_shape or (1, 1, 1, 1)
    bdt = spec.bias_dtype or dt

    if spec.bias_shape is not None:

        @T.prim_func(s_tir=True)
        def attention(q: T.Buffer(q_shape, dt), k: T.Buffer(kv_shape, dt),
                      v: T.Buffer(v_shape, dt), bias: T.Buffer(bias_shape, bdt),
                      out: T.Buffer(out_shape, odt)):
            T.func_attr({"tir.noalias": True})
            body(q, k, v, bias, out)

    else:

        @T.prim_func(s_tir=True)
        def attention(q: T.Buffer(q_shape, dt), k: T.Buffer(kv_shape, dt),
                      v: T.Buffer(v_shape, dt), out: T.Buffer(out_shape, odt)):
            T.func_attr({"tir.noalias": True})
            body(q, k, v, q, out)

    return attention


def attention_cpu_primfunc(spec: AttentionSpec) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(q, k, v, [bias,] out)`` for the llvm target; see the module docstring."""
    Sq, Hq = spec.q_len, spec.q_heads
    rows = spec.batch * Hq
    row = row_macro(spec)

    @T.macro
    def body(q, k, v, bias, out):
        for bh in T.parallel(rows):
            for i in T.serial(Sq):
                row(q, k, v, bias, out, bh, i)

    return primfunc_around(spec, body)
